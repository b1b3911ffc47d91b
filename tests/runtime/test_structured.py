"""Structured output under speculation (core/grammar.py): a constraint applies to the draft's proposals
and to every position the target scores, so that

- on the demo pair, constrained greedy output is identical to constrained autoregressive decoding,
  with the draft model, prompt lookup and auto proposing, alone and batched beside unconstrained
  requests, and every output validates against its schema;
- a seeded sampled request (coupled rule) gives the same tokens with speculation and without;
- on a Medusa bundle, greedy trees verified under the mask equal constrained decoding;
- sampled output follows the masked target distribution (chi-square, on a 16-token family);
- what cannot be constrained is refused in one line.
"""

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch
import transformers

import speccompile
from speccompile.core.grammar import Constraint, GrammarEngine
from speccompile.core.sampling import transform
from speccompile.errors import SpecCompileError
from tests.runtime.test_sampling_exactness import BATCH, GAMMA, PROMPT, SEEDS, VOCAB, check
from tests.tiny_models import make_checkpoint

# objects with required fields, enums, arrays and nesting: the schemas `speccompile bench --json-schema` measures
SCHEMAS = {path.stem: json.loads(path.read_text())
           for path in sorted((Path(__file__).parents[2] / "tools" / "schemas").glob("*.json"))}
PROMPTS = ["The record, as JSON:", "def parse(config):\n    return", "user = {'name': 'Ada', 'age': 36}\nuser ="]
MAX_NEW = 80


@pytest.fixture(scope="module")
def demo():
    with speccompile.load() as runtime:
        yield runtime


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_constrained_greedy_is_constrained_autoregressive_decoding_and_validates(demo, name):
    schema = SCHEMAS[name]
    plain = demo.generate(PROMPTS, max_new_tokens=MAX_NEW, json_schema=schema, mode="autoregressive")
    for result in plain:
        assert result.finish_reason == "stop", result.text  # the grammar closed the object and EOS followed
        jsonschema.validate(json.loads(result.text), schema)
    for proposer in ("draft", "ngram", "auto"):
        speculative = demo.generate(PROMPTS, max_new_tokens=MAX_NEW, json_schema=schema, proposer=proposer,
                                    mode="speculative")
        assert [r.token_ids for r in speculative] == [r.token_ids for r in plain], proposer
        if proposer == "draft":
            assert sum(r.stats.accepted_tokens for r in speculative) > 0  # speculation stayed on


def test_constrained_and_unconstrained_requests_share_a_batch(demo):
    schema = SCHEMAS["nested"]
    alone = [demo.generate([p], max_new_tokens=40, **kw)[0].token_ids
             for p in PROMPTS for kw in ({"json_schema": schema}, {})]
    handles = [demo.submit(p, max_new_tokens=40, **kw) for p in PROMPTS for kw in ({"json_schema": schema}, {})]
    assert [h.result().token_ids for h in handles] == alone


MOODS = ("positive", "negative", "neutral")


def test_every_constraint_kind_holds_under_speculation(demo):
    # any JSON object: a small model may write one key until max_tokens, so only its start is certain
    cases = [({"json_object": True}, lambda text: text.startswith("{")),
             ({"regex": r"[A-Z][a-z]{2,6} [0-9]{2}"}, lambda text: text[0].isupper() and text[-2:].isdigit()),
             ({"choice": list(MOODS)}, lambda text: text in MOODS),
             ({"grammar": 'root ::= "x = " [0-9] [0-9]? ";"'}, lambda text: text[:4] == "x = " and text[-1] == ";")]
    for constraint, holds in cases:
        plain = demo.generate(PROMPTS, max_new_tokens=40, mode="autoregressive", **constraint)
        speculative = demo.generate(PROMPTS, max_new_tokens=40, **constraint)
        assert [r.token_ids for r in speculative] == [r.token_ids for r in plain], constraint
        assert all(holds(r.text) for r in plain), (constraint, [r.text for r in plain])


def test_a_seeded_constrained_sample_is_the_same_with_speculation_and_without(demo):
    schema = SCHEMAS["record"]
    # seeds 5, 6, 7 (request i: seed + i) all close their JSON within MAX_NEW tokens; some seeds' do not
    runs = [demo.generate(PROMPTS, max_new_tokens=MAX_NEW, json_schema=schema, temperature=0.9, seed=5, mode=mode)
            for mode in ("autoregressive", "speculative")]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    for result in runs[0]:
        jsonschema.validate(json.loads(result.text), schema)


def test_logprobs_of_a_constrained_request_are_those_of_the_masked_distribution(demo):
    result = demo.generate([PROMPTS[0]], max_new_tokens=12, json_schema=SCHEMAS["enums"], logprobs=5)[0]
    first, top_ids, top = result.logprobs[0]
    assert result.token_ids[0] == top_ids[0] and first == pytest.approx(0.0, abs=1e-5)  # `{` is forced
    assert top[1] < -1000  # everything else is impossible under the mask


def test_medusa_trees_verified_under_the_mask_are_constrained_decoding(bundles):
    runtime = speccompile.load(bundles("llama", "medusa"))
    prompts = ["hello world", "the cat sat"]
    constraint = {"regex": "[a-z ]{3,20}\\."}
    plain = runtime.generate(prompts, max_new_tokens=24, mode="autoregressive", **constraint)
    trees = runtime.generate(prompts, max_new_tokens=24, **constraint)
    assert [r.token_ids for r in trees] == [r.token_ids for r in plain]
    assert all(set(r.stats.by_proposer) == {"medusa"} for r in trees)
    unconstrained = runtime.generate(prompts, max_new_tokens=24, mode="autoregressive")
    assert [r.token_ids for r in unconstrained] != [r.token_ids for r in plain]  # the mask did change them


def test_what_cannot_be_constrained_is_refused_in_one_line(demo):
    for kwargs, message in (({"json_schema": {"type": "nope"}}, "json_schema does not compile"),
                            ({"regex": "(", "json_schema": {}}, "give one constraint"),
                            ({"grammar": "start: undefined"}, "grammar does not compile")):
        with pytest.raises(SpecCompileError, match=message):
            demo.generate([PROMPTS[0]], max_new_tokens=4, **kwargs)


# -- the masked distribution, sampled ----------------------------------------------------------------
REGEX = "[b-f][g-jb][bdfhj]+"  # over single-letter tokens a..p: which tokens may follow depends on the position


@pytest.fixture(scope="module")
def letters(tmp_path_factory):
    """A 16-token family whose tokens are the letters a..p (a tokenizer llguidance reads bytes from),
    a target and a draft far from it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    root = tmp_path_factory.mktemp("letters")
    backend = Tokenizer(models.BPE({chr(97 + i): i for i in range(VOCAB)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    no_specials = dict(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = make_checkpoint(root / "t", "llama", seed=0, tokenizer=tok, init_std=0.5, **no_specials)
    draft = make_checkpoint(root / "d", "llama", seed=7, size="draft", tokenizer=tok, init_std=0.5, **no_specials)
    bundle = speccompile.build(target, draft, root / "bundle", gammas=[GAMMA], max_seq=16, max_batch=BATCH)
    return target, bundle


def masked_joint(target_dir, bundle, temperature) -> np.ndarray:
    """P(t1, t2, t3) [V, V, V]: HF's logits, masked by the grammar after the tokens before each, transformed."""
    model = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    engine = GrammarEngine(bundle / "tokenizer" / "tokenizer.json", VOCAB, set())
    state = engine.start(Constraint.of(regex=REGEX))

    def next_probs(generated):
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + generated])).logits[0, -1:].numpy()
        bits = np.unpackbits(state.mask_after(generated).view(np.uint8), bitorder="little")[:VOCAB].astype(bool)
        return transform(np.where(bits, np.float32(-1e30), logits), temperature)[0].astype(np.float64)

    joint = np.zeros((VOCAB,) * 3)
    p1 = next_probs([])
    for a in np.flatnonzero(p1):
        p2 = next_probs([int(a)])
        for b in np.flatnonzero(p2):
            joint[a, b] = p1[a] * p2[b] * next_probs([int(a), int(b)])
    return joint


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_constrained_samples_follow_the_masked_target_distribution(letters, rule):
    target, bundle = letters
    runtime = speccompile.load(bundle)
    samples, stats = [], []
    for seed in range(SEEDS):
        results = runtime.generate([PROMPT] * BATCH, max_new_tokens=3, gamma=GAMMA, temperature=1.0, seed=seed * BATCH,
                                   sampling_rule=rule, regex=REGEX)
        samples += [r.token_ids for r in results]
        stats += [r.stats for r in results]
    samples = np.array(samples)
    assert sum(s.accepted_tokens for s in stats) > 0.2 * sum(s.draft_tokens for s in stats) > 0
    joint = masked_joint(target, bundle, 1.0)
    assert (joint[tuple(samples.T)] > 0).all()  # nothing the grammar forbids
    rejected, verdicts = check(samples, joint, later_pair=True)
    assert not rejected, verdicts


def test_a_grammar_that_must_end_where_min_tokens_forbids_it_stops_cleanly(demo):
    """The grammar allows only EOS after one digit; min_tokens bans EOS: no token is left, and the
    request stops there (finish "stop") with what the grammar allowed, instead of writing past it."""
    for mode in ("autoregressive", "speculative"):
        [result] = demo.generate([PROMPTS[0]], max_new_tokens=20, regex="[0-9]", min_tokens=5, mode=mode)
        assert result.finish_reason == "stop" and len(result.text) == 1 and result.text.isdigit(), (mode, result)
