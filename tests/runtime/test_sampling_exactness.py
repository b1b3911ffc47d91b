"""Speculative sampling emits exactly the target's (transformed) distribution.

On a tiny model with a 16-token vocabulary, the exact distribution of the first three generated
tokens is computed from HF transformers logits and the numpy transform reference; thousands of
speculative samples (a batch of sequences per seed, several seeds) must pass a chi-square test
against it, for several sampling settings and a draft that disagrees with the target a lot. The same
test must reject samples from a build whose residual step is deliberately broken.
"""

import numpy as np
import pytest
import torch
import transformers

import speccompile
from speccompile.compiler import spec_accept, transformer
from speccompile.core.processors import Processors, ProcessorState, min_p_reference
from speccompile.core.processors import reference as processors_reference
from speccompile.core.sampling import transform
from tests.tiny_models import make_checkpoint, make_word_tokenizer

VOCAB = 16
PROMPT = [3, 1, 4]
# 2000 samples per setting: call k is seeded k * BATCH, its request i k * BATCH + i. Enough power: the
# broken builds below score 3x and 37x the critical value of the pairs' test (at 4000 samples: 5x and 60x)
BATCH, SEEDS = 500, 4
GAMMA = 3
Z_0001 = 3.09  # one-sided standard normal quantile for alpha = 0.001


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("small-vocab")
    tok = make_word_tokenizer(VOCAB)
    no_specials = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    # init_std 0.5: peaked but not one-hot distributions, and a draft far from the target
    target = make_checkpoint(root / "t", "llama", seed=0, tokenizer=tok, init_std=0.5, **no_specials)
    draft = make_checkpoint(root / "d", "llama", seed=7, size="draft", tokenizer=tok, init_std=0.5, **no_specials)
    return target, draft


def build(pair, out):
    return speccompile.build(*pair, out, gammas=[GAMMA], max_seq=16, max_batch=BATCH)


def exact_joint(target_dir, temperature, top_k, top_p, prompt=PROMPT) -> np.ndarray:
    """P(t1, t2, t3) [V, V, V] from HF logits and the numpy transform."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()

    def next_probs(prefixes):
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1].numpy()
        return transform(logits, temperature, top_k, top_p).astype(np.float64)

    p1 = next_probs([prompt])[0]
    p2 = next_probs([prompt + [a] for a in range(VOCAB)])  # [t1, t2]
    p3 = next_probs([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).reshape(VOCAB, VOCAB, VOCAB)
    return p1[:, None, None] * p2[:, :, None] * p3


def exact_processed_joint(target_dir, temperature, processors: Processors, prompt=PROMPT) -> np.ndarray:
    """P(t1, t2, t3) [V, V, V] with the logits processors applied (their numpy reference) to HF's logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()

    def next_probs(prefix):
        with torch.no_grad():
            logits = model(torch.tensor([prefix])).logits[0, -1:].numpy()
        state = ProcessorState.start(processors, prompt, VOCAB, ())
        state.observe(prefix[len(prompt):])
        probs = transform(processors_reference(logits, state, len(prefix) - len(prompt)), temperature)
        return min_p_reference(probs, processors.min_p)[0].astype(np.float64)

    joint = np.zeros((VOCAB,) * 3)
    p1 = next_probs(prompt)
    for a in range(VOCAB):
        p2 = next_probs(prompt + [a])
        for b in range(VOCAB):
            joint[a, b] = p1[a] * p2[b] * next_probs(prompt + [a, b])
    return joint


def speculative_samples(bundle, temperature, top_k, top_p, prompt=PROMPT, proposer="draft", stats=None,
                        p_min=0.0, sampling_rule="coupled", max_new_tokens=3, **controls) -> np.ndarray:
    """Each request's first three tokens (of max_new_tokens: more let later iterations carry more drafts)."""
    runtime = speccompile.load(bundle)
    samples = []
    for seed in range(SEEDS):
        results = runtime.generate([prompt] * BATCH, max_new_tokens=max_new_tokens, gamma=GAMMA,
                                   temperature=temperature,
                                   top_k=top_k, top_p=top_p, seed=seed * BATCH, proposer=proposer, p_min=p_min,
                                   sampling_rule=sampling_rule, **controls)
        samples += [r.token_ids[:3] for r in results]
        if stats is not None:
            stats += [r.stats for r in results]
    return np.array(samples)


def chi_square_rejects(counts: np.ndarray, expected_probs: np.ndarray) -> tuple[bool, float, float]:
    """Pearson's test at alpha = 0.001; cells expecting < 5 samples are pooled into one."""
    n = counts.sum()
    expected = expected_probs * n
    big = expected >= 5
    observed = np.append(counts[big], counts[~big].sum())
    expected = np.append(expected[big], expected[~big].sum())
    keep = expected > 0
    statistic = float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    df = keep.sum() - 1
    # Wilson-Hilferty approximation of the chi-square quantile (no scipy needed)
    critical = df * (1 - 2 / (9 * df) + Z_0001 * np.sqrt(2 / (9 * df))) ** 3
    return statistic > critical, statistic, critical


def check(samples, joint, later_pair: bool = False):
    """Test the (t1, t2) joint and the t3 marginal (with later_pair, the (t2, t3) joint too: what a
    token's dependence on the one before it shows); returns True when any test rejects."""
    pairs = np.bincount(samples[:, 0] * VOCAB + samples[:, 1], minlength=VOCAB * VOCAB)
    third = np.bincount(samples[:, 2], minlength=VOCAB)
    verdicts = [chi_square_rejects(pairs, joint.sum(2).ravel()), chi_square_rejects(third, joint.sum((0, 1)))]
    if later_pair:
        later = np.bincount(samples[:, 1] * VOCAB + samples[:, 2], minlength=VOCAB * VOCAB)
        verdicts.append(chi_square_rejects(later, joint.sum(0).ravel()))
    return any(v[0] for v in verdicts), verdicts


SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 8, 0.9)]


@pytest.fixture(scope="module")
def bundle(pair, tmp_path_factory):
    return build(pair, tmp_path_factory.mktemp("b") / "bundle")


RULES = ["coupled", "rejection"]


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("temperature, top_k, top_p", SETTINGS)
def test_speculative_samples_follow_the_target_distribution(pair, bundle, temperature, top_k, top_p, rule):
    samples = speculative_samples(bundle, temperature, top_k, top_p, sampling_rule=rule)
    rejected, verdicts = check(samples, exact_joint(pair[0], temperature, top_k, top_p))
    assert not rejected, verdicts


PROCESSORS = Processors(presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.6,
                        logit_bias=((2, 1.5), (9, -2.0)), min_p=0.08)


@pytest.fixture(scope="module")
def agreeing_bundle(pair, tmp_path_factory):
    """The target drafting for itself: drafts are mostly kept, so most tokens come from the positions
    of a verification after its first, whose penalties count the drafts before them."""
    return build((pair[0], pair[0]), tmp_path_factory.mktemp("copy") / "bundle")


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES)
def test_samples_with_logits_processors_follow_the_processed_distribution(pair, agreeing_bundle, rule):
    """Penalties that depend on the drafts before each position, a bias and min_p: the output is the
    processed target's (and the processors do change it: the unprocessed one is rejected)."""
    controls = {"presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.6,
                "logit_bias": dict(PROCESSORS.logit_bias), "min_p": 0.08}
    stats = []
    samples = speculative_samples(agreeing_bundle, 1.0, 0, 1.0, sampling_rule=rule, stats=stats, **controls)
    assert sum(s.accepted_tokens for s in stats) > 0.5 * sum(s.draft_tokens for s in stats)
    rejected, verdicts = check(samples, exact_processed_joint(pair[0], 1.0, PROCESSORS), later_pair=True)
    assert not rejected, verdicts
    assert check(samples, exact_joint(pair[0], 1.0, 0, 1.0))[0]


@pytest.fixture(scope="module")
def repeating_prompt(pair) -> list[int]:
    """[11, 13, a, c, 2, 7, 11, 13, a] with the (a, c) the target most likely continues with c, and
    then with 2: the first token then often completes [11, 13, a, c], which occurred before (a
    4-token match, which auto trusts), and prompt lookup proposes what followed it (2, a point mass:
    q one-hot), which the target then draws often enough to be kept and rejected both; otherwise the
    draft model drafts (auto) or nothing does (ngram)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(pair[0]).eval()
    candidates = [[11, 13, a, c, 2, 7, 11, 13, a] for a in range(VOCAB) for c in range(VOCAB)
                  if len({a, c, 2, 7, 11, 13}) == 6]
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor(candidates)).logits[:, -1], -1).numpy()
        second = torch.softmax(model(torch.tensor([p + [p[3]] for p in candidates])).logits[:, -1], -1).numpy()
    match = np.array([first[i, p[3]] for i, p in enumerate(candidates)])
    kept = second[:, 2]
    best = int(np.argmax(np.minimum(match, 2 * kept)))
    assert match[best] > 0.2 and 0.05 < kept[best] < 0.95, "no prompt makes a lookup likely and uncertain"
    return candidates[best]


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("proposer", ["ngram", "suffix", "auto"])
def test_lookup_proposals_sample_the_target_distribution(pair, bundle, repeating_prompt, proposer, rule):
    stats = []
    samples = speculative_samples(bundle, 1.0, 0, 1.0, prompt=repeating_prompt, proposer=proposer, stats=stats,
                                  sampling_rule=rule)
    free = ("ngram", "suffix") if proposer == "auto" else (proposer,)  # point proposals: q one-hot
    lookups = sum(s.by_proposer.get(name, [0, 0, 0])[1] for s in stats for name in free)
    kept = sum(s.by_proposer.get(name, [0, 0, 0])[2] for s in stats for name in free)
    assert lookups > 500 and 0 < kept < lookups, (lookups, kept)  # proposed often, and sometimes rejected
    rejected, verdicts = check(samples, exact_joint(pair[0], 1.0, 0, 1.0, prompt=repeating_prompt))
    assert not rejected, verdicts


@pytest.mark.slow
@pytest.mark.parametrize("rule", RULES)
def test_thresholded_drafts_sample_the_target_distribution(pair, bundle, rule):
    """A row that stops drafting at an unsure token verifies fewer drafts: still exact."""
    stats = []
    samples = speculative_samples(bundle, 1.0, 0, 1.0, stats=stats, p_min=0.3, sampling_rule=rule)
    # unthresholded, every request drafts in its first iteration (2 tokens to go: 1 draft)
    none, some = sum(s.draft_tokens == 0 for s in stats), sum(s.draft_tokens > 0 for s in stats)
    assert none > 0 and some > 0, (none, some)
    rejected, verdicts = check(samples, exact_joint(pair[0], 1.0, 0, 1.0))
    assert not rejected, verdicts


def test_the_draft_really_disagrees(bundle):
    results = speccompile.load(bundle).generate([PROMPT] * 64, max_new_tokens=8, gamma=GAMMA, temperature=1.0, seed=0)
    rate = sum(r.stats.accepted_tokens for r in results) / sum(r.stats.draft_tokens for r in results)
    assert rate < 0.6, rate


@pytest.mark.slow
def test_a_broken_residual_step_is_detected(pair, tmp_path, monkeypatch):
    """Negative control: sampling the correction from p instead of max(0, p - q) must fail the test."""
    monkeypatch.setattr(spec_accept, "residual_weights", lambda f, p_n, q_n: p_n)
    broken = build(pair, tmp_path / "broken")
    samples = speculative_samples(broken, 1.0, 0, 1.0, sampling_rule="rejection")
    rejected, verdicts = check(samples, exact_joint(pair[0], 1.0, 0, 1.0))
    assert rejected, verdicts


@pytest.mark.slow
def test_a_broken_gumbel_draw_is_detected(pair, tmp_path, monkeypatch):
    """Negative control of the coupled rule: perturbing log p with the uniform itself instead of the
    Gumbel noise -log(-log u) (a draw biased towards the likeliest token) must fail the test."""
    monkeypatch.setattr(transformer, "gumbel_scores", lambda b, probs, noise: b.op("Add", b.op("Log", probs), noise))
    broken = build(pair, tmp_path / "broken")
    samples = speculative_samples(broken, 1.0, 0, 1.0)
    rejected, verdicts = check(samples, exact_joint(pair[0], 1.0, 0, 1.0))
    assert rejected, verdicts


def test_same_seed_same_tokens_different_seeds_differ(bundle):
    runtime = speccompile.load(bundle)
    def run(seed):
        return [r.token_ids for r in runtime.generate([PROMPT] * 4, max_new_tokens=8, temperature=1.0, seed=seed)]

    assert run(11) == run(11)
    assert run(11) != run(12)
    rows = run(11)
    assert len({tuple(r) for r in rows}) > 1  # each sequence has its own stream


def test_a_sequence_samples_the_same_alone_or_in_a_batch(bundle):
    """Alone, a sequence runs the single-sequence graph variants (fused attention); in a batch, the
    standard graphs, whose samples the chi-square tests above check. Same draws, same tokens."""
    runtime = speccompile.load(bundle)
    for seed in range(20):
        alone = runtime.generate([PROMPT], max_new_tokens=8, temperature=1.0, seed=seed)[0].token_ids
        batched = runtime.generate([PROMPT, [2, 2]], max_new_tokens=8, temperature=1.0, seed=seed)[0].token_ids
        assert alone == batched, seed
    assert "target_verify_sample_g3_b1.onnx" in runtime.target.loaded_files


@pytest.mark.slow
def test_autoregressive_sampling_follows_the_target_distribution(pair, bundle):
    runtime = speccompile.load(bundle)
    samples = []
    for seed in range(SEEDS):
        samples += [r.token_ids for r in runtime.generate([PROMPT] * BATCH, max_new_tokens=3, mode="autoregressive",
                                                          temperature=0.7, top_k=5, seed=seed * BATCH)]
    rejected, verdicts = check(np.array(samples), exact_joint(pair[0], 0.7, 5, 1.0))
    assert not rejected, verdicts


# ---------------------------------------------------------------------------------------------
# an EAGLE-3 head's drafts


@pytest.fixture(scope="module")
def eagle_bundle(tmp_path_factory):
    """The pair's target with three layers (an EAGLE-3 head reads three distinct ones) and a random head
    over 12 of its 16 tokens (drafts of the other 4 are impossible: q is 0 there), reading layers 0-2."""
    from speccompile.compiler.build import build_bundle
    from speccompile.eagle_head import Layout, write_eagle3_head
    from tests.eagle_reference import random_head

    root = tmp_path_factory.mktemp("eagle-small-vocab")
    no_specials = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = make_checkpoint(root / "t", "llama", seed=0, tokenizer=make_word_tokenizer(VOCAB), init_std=0.5,
                             num_hidden_layers=3, **no_specials)
    config = {"hidden_size": transformers.AutoConfig.from_pretrained(target).hidden_size, "vocab_size": VOCAB}
    head = random_head(config, seed=3, draft_vocab_size=12, aux_layer_ids=(0, 1, 2))
    head_dir = write_eagle3_head(root / "head", head, Layout.EAGLE)
    return target, build_bundle(target, None, root / "bundle", gammas=[GAMMA], max_seq=16, max_batch=BATCH,
                                eagle_dir=head_dir)


@pytest.mark.parametrize("rule", RULES)
def test_eagle_drafts_sample_the_target_distribution(eagle_bundle, rule):
    """Sampled requests draft with the head (its distribution after temperature and top-k, drawn at the
    catch-up for the first draft and at the steps for the rest: 5 tokens, so that an iteration carries
    up to 3 drafts), and their first three tokens are the target's."""
    target, bundle = eagle_bundle
    stats = []
    samples = speculative_samples(bundle, 0.9, 12, 1.0, proposer="eagle", stats=stats, sampling_rule=rule,
                                  max_new_tokens=5)
    drafted = sum(s.by_proposer.get("eagle", [0, 0, 0])[1] for s in stats)
    kept = sum(s.by_proposer.get("eagle", [0, 0, 0])[2] for s in stats)
    assert drafted > 2 * len(stats) and 0 < kept < drafted, (drafted, kept)  # a random head: rarely kept
    rejected, verdicts = check(samples, exact_joint(target, 0.9, 12, 1.0), later_pair=True)
    assert not rejected, verdicts
