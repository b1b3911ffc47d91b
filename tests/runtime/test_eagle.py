"""EAGLE-3 bundles end to end: `build --eagle HEAD` (either published layout, with or without a draft
model), then proposer "eagle".

Oracles: the target decoding alone (mode autoregressive) and HF's greedy generate, for every output;
the torch reference of the head's drafting (tests/eagle_reference.py) over HF's own hidden states,
for every draft the head proposes: a random head's, which the target rejects, and those of a head made
to agree with a target often, so that the head reads back verifications that kept some of its drafts.
"""

import dataclasses
import json
import types

import numpy as np
import pytest
import torch
import transformers

import speccompile
from speccompile.bundle import GraphId
from speccompile.compiler.build import build_bundle
from speccompile.eagle_head import Eagle3Head, Layout, draft_to_target, write_eagle3_head
from speccompile.errors import SpecCompileError
from tests.eagle_reference import Eagle3Reference, draft, random_head
from tests.runtime.test_generate import hf_greedy
from tests.tiny_models import make_checkpoint

LAYERS = 4
AUX = (0, 2, 3)
PROMPTS = [[5, 17, 33, 2, 9, 100, 7], [8, 9, 10, 11], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
MAX_NEW = 20
GAMMAS = (1, 4, "auto")


def eagle_target(path, tokenizer, identity: tuple[int, ...] = ()):
    """A tiny Llama of LAYERS layers, those of `identity` adding nothing to the residual stream
    (o_proj and down_proj zero)."""
    from safetensors.numpy import load_file, save_file

    path = make_checkpoint(path, "llama", tokenizer=tokenizer, num_hidden_layers=LAYERS)
    tensors = load_file(path / "model.safetensors")
    for layer in identity:
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            weight = f"model.layers.{layer}.{name}.weight"
            tensors[weight] = np.zeros_like(tensors[weight])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def target_config(target) -> dict:
    return json.loads((target / "config.json").read_text())


def agreeing_head(target) -> Eagle3Head:
    """For a target whose layers all add nothing (a bigram model: its next token is a function of its
    last), a head that drafts as it does, mostly: attention over the token embeddings, most of it on
    its own position's (q and k one projection), is its output (o_proj the identity, the MLP and the
    fed-back residual nothing), read by the target's own final norm and LM head over three quarters of
    the vocabulary. Drafts of the other quarter are wrong, and the rest of the attention makes every
    draft depend on what the head's cache holds."""
    from safetensors.numpy import load_file

    config, tensors = target_config(target), load_file(target / "model.safetensors")
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    head = random_head(config, seed=4, draft_vocab_size=3 * vocab // 4, aux_layer_ids=AUX, num_kv_heads=4,
                       norm_before_residual=True)
    identity = np.eye(hidden, dtype=np.float32)
    embedding_half = np.concatenate([identity, np.zeros_like(identity)], axis=1)  # of [embedding, features]
    drafted = np.arange(head.config.draft_vocab_size) + head.d2t  # the target ids of the draft vocabulary
    return dataclasses.replace(
        head, fc=np.zeros_like(head.fc), hidden_norm=np.zeros(hidden, np.float32),
        input_layernorm=np.ones(hidden, np.float32), q_proj=4 * embedding_half, k_proj=4 * embedding_half,
        v_proj=embedding_half, o_proj=identity, down_proj=np.zeros_like(head.down_proj),
        norm=tensors["model.norm.weight"], lm_head=tensors["lm_head.weight"][drafted])


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer):
    return eagle_target(tmp_path_factory.mktemp("eagle-target") / "ckpt", tokenizer)


@pytest.fixture(scope="module")
def head(target) -> Eagle3Head:
    """Random weights, seeded: drafts the reference predicts, which the target hardly ever keeps."""
    return random_head(target_config(target), seed=5, aux_layer_ids=AUX)


@pytest.fixture(scope="module")
def bigram_target(tmp_path_factory, tokenizer):
    return eagle_target(tmp_path_factory.mktemp("bigram-target") / "ckpt", tokenizer, identity=tuple(range(LAYERS)))


@pytest.fixture(scope="module")
def runtimes(target, head, bigram_target, checkpoints, tmp_path_factory):
    """runtimes(name, **load options) -> a loaded runtime of the bundle `name`: "eagle" (the random head
    in the EAGLE authors' layout, beside a draft model), "speculators" (in that layout, the target
    alone beside it), "agreeing" (agreeing_head, on bigram_target)."""
    root = tmp_path_factory.mktemp("eagle-bundles")
    made = {}

    def get(name: str, **options):
        key = name, tuple(sorted(options.items()))
        if key not in made:
            bundle = root / f"bundle-{name}"
            if not bundle.exists():
                model = bigram_target if name == "agreeing" else target
                made_head = agreeing_head(model) if name == "agreeing" else head
                layout = Layout.EAGLE if name == "eagle" else Layout.SPECULATORS
                head_dir = write_eagle3_head(root / f"head-{name}", made_head, layout)
                build_bundle(model, checkpoints("llama", "draft") if name == "eagle" else None, bundle,
                             gammas=[1, 4], max_seq=96, max_batch=4, eagle_dir=head_dir, eagle_weights="float32")
            made[key] = speccompile.load(bundle, **options)
        return made[key]

    yield get
    for runtime in made.values():
        runtime.close()


@pytest.fixture(scope="module")
def expected(target, runtimes):
    """The target alone, which must agree with HF's greedy generate."""
    alone = [r.token_ids for r in runtimes("speculators").generate(PROMPTS, max_new_tokens=MAX_NEW,
                                                                   mode="autoregressive")]
    assert alone == [hf_greedy(target, prompt, MAX_NEW) for prompt in PROMPTS]
    return alone


def eagle_runs(runtime) -> dict:
    """γ -> (results one by one, results batched) of greedy requests with proposer eagle."""
    runs = {}
    for gamma in GAMMAS:
        options = dict(max_new_tokens=MAX_NEW, gamma=gamma, proposer="eagle")
        runs[gamma] = [runtime.generate([p], **options)[0] for p in PROMPTS], runtime.generate(PROMPTS, **options)
    return runs


def recorded_drafts(runtime) -> list[tuple[list[int], list[int]]]:
    """Every draft the runtime's head proposes from now on: (the request's tokens then, its drafts)."""
    runner, log = runtime.proposers.eagle, []
    drafting = runner.draft

    def draft_and_record(rows, offers, drafts, proposed, sampling):
        out = drafting(rows, offers, drafts, proposed, sampling)
        log.extend((list(request.tokens), proposed[row, : drafts[row]].tolist())
                   for row, (request, offer) in enumerate(zip(rows, offers))
                   if offer.source.runner is runner and drafts[row])
        return out

    runner.draft = draft_and_record
    return log


# ---------------------------------------------------------------------------------------------


def test_greedy_eagle_is_the_target_alone_in_both_layouts_with_the_same_drafts(runtimes, expected):
    """One by one and batched, at γ 1, 4 and auto: the target's tokens (and HF's). The two layouts of
    one head draft alike: the same acceptance, draft for draft, at each fixed γ."""
    runs = {name: eagle_runs(runtimes(name)) for name in ("eagle", "speculators")}
    for name, by_gamma in runs.items():
        for gamma, (alone, batched) in by_gamma.items():
            assert [r.token_ids for r in alone] == expected, (name, gamma, "batch 1")
            assert [r.token_ids for r in batched] == expected, (name, gamma, "batch 3")
            assert all(set(r.stats.by_proposer) <= {"eagle"} for r in alone + batched), (name, gamma)
            if gamma != "auto":  # γ auto may find the head's drafts not worth verifying, and decode plainly
                assert all(r.stats.draft_tokens > 0 for r in alone + batched), (name, gamma)
    for gamma in (1, 4):
        stats = [[(r.stats.by_proposer, r.stats.draft_tokens, r.stats.accepted_tokens) for r in results]
                 for name in runs for results in runs[name][gamma]]
        assert stats[0] == stats[2] and stats[1] == stats[3], gamma


def test_on_one_session_graph_the_head_reads_the_same_features(runtimes, expected):
    """The target's session graph returns aux_hidden for every kind it runs: the same drafts as its graphs'."""
    per_graph, one = runtimes("speculators"), runtimes("speculators", one_session=True)
    assert one.target.one_session and not one.eagle.one_session
    options = dict(max_new_tokens=MAX_NEW, gamma=4, proposer="eagle")
    for batches in ([[p] for p in PROMPTS], [PROMPTS]):  # one by one, then batched
        ours = [r for prompts in batches for r in one.generate(prompts, **options)]
        theirs = [r for prompts in batches for r in per_graph.generate(prompts, **options)]
        assert [r.token_ids for r in ours] == expected
        assert [r.stats.by_proposer for r in ours] == [r.stats.by_proposer for r in theirs]


def test_tensorrt_refuses_the_bundle_in_one_line(runtimes):
    bundle = runtimes("speculators").bundle.path
    with pytest.raises(SpecCompileError) as refused:
        speccompile.load(bundle, backend="tensorrt")
    assert "EAGLE-3 head" in str(refused.value) and "backend='onnxruntime'" in str(refused.value)
    assert "\n" not in str(refused.value)


def assert_the_reference_s(log: list, target, head) -> None:
    """Each recorded draft is the torch reference's from the request's whole history then, over HF's
    hidden states, though the runtime's head read it call by call and rolled back what it drafted."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
    embedding = hf.get_input_embeddings().weight.detach().numpy()
    for tokens, drafts in log:
        with torch.no_grad():
            states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        features = np.concatenate([states[i][0].numpy() for i in AUX], axis=-1)
        assert drafts == draft(head, features, tokens, len(drafts), embed_tokens=embedding)[0].tolist(), tokens


def test_every_draft_is_the_reference_s_over_hf_s_hidden_states(runtimes, target, head):
    """Prompts prefilled in chunks of 4 (the head catches up on each), in a batch, every iteration."""
    runtime = runtimes("speculators", prefill_chunk=4)
    log = recorded_drafts(runtime)
    runtime.generate(PROMPTS, max_new_tokens=MAX_NEW, gamma=4, proposer="eagle")
    assert len(log) >= len(PROMPTS) * 3
    assert_the_reference_s(log, target, head)


def test_a_request_alone_drafts_the_reference_s_through_the_batch_1_variants(runtimes, target, head, expected):
    """One sequence runs the head's batch-1 graphs (fused attention): its drafts are the reference's too."""
    runtime = runtimes("speculators")
    log = recorded_drafts(runtime)
    [result] = runtime.generate([PROMPTS[1]], max_new_tokens=MAX_NEW, gamma=4, proposer="eagle")
    assert result.token_ids == expected[1] and len(log) >= 3
    assert runtime.eagle.graph_file(GraphId.eagle_step(), 1).endswith("_b1.onnx")
    assert_the_reference_s(log, target, head)


def test_samples_of_one_prompt_share_its_prefill_and_the_head_what_it_read(runtimes, target, head, expected):
    """n samples of a prompt copy its prefilled cache (the target's, and what the head read or holds of
    it) rather than prefill it again: each sample's drafts are still the reference's."""
    runtime = runtimes("speculators")
    log = recorded_drafts(runtime)
    results = runtime.generate([PROMPTS[0]], max_new_tokens=MAX_NEW, gamma=4, proposer="eagle", n=3)
    assert [r.token_ids for r in results] == [expected[0]] * 3
    assert all(r.stats.by_proposer["eagle"][1] > 0 for r in results) and len(log) >= 6
    assert_the_reference_s(log, target, head)


def test_a_head_whose_drafts_are_kept_in_part_reads_back_what_was_kept(runtimes, bigram_target):
    """Verifications that keep all of the head's drafts, some, or none: the head reads the target's
    features of the positions kept (as many as γ + 1 in a call) and drops what it drafted past them,
    so its next drafts are still the reference's; and the output is the target's."""
    runtime = runtimes("agreeing")
    alone = [r.token_ids for r in runtime.generate(PROMPTS, max_new_tokens=MAX_NEW, mode="autoregressive")]
    assert alone == [hf_greedy(bigram_target, prompt, MAX_NEW) for prompt in PROMPTS]
    log = recorded_drafts(runtime)
    results = runtime.generate(PROMPTS, max_new_tokens=MAX_NEW, gamma=4, proposer="eagle")
    assert [r.token_ids for r in results] == alone
    assert_the_reference_s(log, bigram_target, agreeing_head(bigram_target))
    outputs = [prompt + tokens for prompt, tokens in zip(PROMPTS, alone)]
    kept = [kept_of(drafts, next(o for o in outputs if o[: len(tokens)] == tokens)[len(tokens) :])
            for tokens, drafts in log]
    assert sum(r.stats.accepted_tokens for r in results) == sum(kept)
    assert {"all", "some", "none"} == {"none" if k == 0 else "all" if k == len(d) else "some"
                                       for k, (_, d) in zip(kept, log)}


def kept_of(drafts: list[int], then: list[int]) -> int:
    """How many of the drafts the output's next tokens begin with."""
    count = 0
    while count < len(drafts) and count < len(then) and drafts[count] == then[count]:
        count += 1
    return count


def test_a_scored_prompt_beside_drafting_requests_drafts_nothing_and_stays_in_its_cache(runtimes):
    """A prompt scored for its log-probabilities returns no features: its row falls out of step with
    the head, whose steps for the rows beside it still run over it, iteration after iteration, longer
    than the cache, and whose catch-ups read nothing there: both within the cache, the output exact."""
    runtime = runtimes("speculators")
    prompts, long = PROMPTS[:2], dict(max_new_tokens=70, gamma=4, proposer="eagle")
    alone = [r.token_ids for r in runtime.generate(prompts, max_new_tokens=70, mode="autoregressive")]
    scored = runtime.submit(prompts[0], prompt_logprobs=1, **long)
    drafting = runtime.submit(prompts[1], **long)
    scored, drafting = scored.result(timeout=60), drafting.result(timeout=60)
    assert [scored.token_ids, drafting.token_ids] == alone
    assert scored.stats.draft_tokens == 0 and drafting.stats.draft_tokens > 70
    assert runtime.proposers.eagle.engine.cache_lengths.max() > runtime.max_seq  # its steps were clamped


def test_auto_weighs_the_head_and_chooses_it_where_its_drafts_are_kept(runtimes, expected, bigram_target,
                                                                      monkeypatch):
    """auto offers the head beside the others (a random head's output still the target's), and runs
    it where its drafts are kept: an agreeing head's iterations are the head's. The choice is made on
    fixed costs (a head step a tenth of a target step), not on what this machine's timings happen to
    be while other work shares it: the rule is tested, not the clock."""
    from speccompile.core.cost_model import LoopCosts
    from speccompile.core.gamma_policy import GammaPolicy
    from speccompile.runtime.policies import LoadPolicies

    for name in ("eagle", "speculators"):
        results = runtimes(name).generate(PROMPTS, max_new_tokens=MAX_NEW, proposer="auto")
        assert [r.token_ids for r in results] == expected
        assert "eagle" in runtimes(name).speculative_config()["proposers"]
    costs = LoopCosts(target_step=1.0, draft={1: 0.0, 4: 0.0}, verify={1: 1.1, 4: 1.3},  # no draft model
                      head_step=0.1, head_catch_up=0.2)

    def fixed_costs(self, *args, **kwargs) -> bool:
        self.calibration = costs
        return False

    monkeypatch.setattr(LoadPolicies, "calibrate", fixed_costs)
    monkeypatch.setattr(GammaPolicy, "observe_timing", lambda self, timing: None)
    fresh = runtimes("agreeing", max_batch=4)  # its own load: nothing learned by the tests before this one
    results = fresh.generate(PROMPTS, max_new_tokens=MAX_NEW, proposer="auto")
    assert [r.token_ids for r in results] == [hf_greedy(bigram_target, prompt, MAX_NEW) for prompt in PROMPTS]
    # every iteration the head's, but for a last one with a single token left to generate (nothing to draft)
    assert all(list(r.stats.by_proposer) == ["eagle"] and r.stats.by_proposer["eagle"][0] >= r.stats.iterations - 1
               for r in results), [(r.stats.by_proposer, r.stats.iterations) for r in results]


def test_what_the_head_s_drafts_taught_carries_to_the_next_request_until_the_runtime_forgets(runtimes):
    """How often the head's drafts are kept is learned over the load, as the draft model's is: a new
    request's offers start from it, not from the prior; Runtime.forget goes back to the prior."""
    from speccompile.core.proposers.eagle import EAGLE_PRIOR

    runtime = runtimes("speculators")
    runtime.forget()
    runner = runtime.proposers.eagle
    assert runner.acceptance.by_position(1) == [pytest.approx(EAGLE_PRIOR)]
    [result] = runtime.generate([PROMPTS[0]], max_new_tokens=MAX_NEW, proposer="eagle", gamma=4)
    drafted, kept = result.stats.by_proposer["eagle"][1:]
    learned = runner.acceptance.by_position(1)[0]
    assert learned < EAGLE_PRIOR and kept < drafted / 2  # a random head's drafts are rarely kept
    greedy = types.SimpleNamespace(params=types.SimpleNamespace(greedy=True))
    offer = runtime.proposers.make("eagle").offer(greedy, 4, 4, None)  # what a next request expects
    assert offer.acceptance_by_position()[0] == pytest.approx(learned)
    runtime.forget()
    assert runner.acceptance.by_position(1) == [pytest.approx(EAGLE_PRIOR)]


SAMPLED = dict(max_new_tokens=MAX_NEW, temperature=0.9, seed=7)


def test_a_sampled_request_asking_for_the_head_samples_as_the_target_alone(runtimes):
    """A sampled request drafts with the head (its sampled graphs), and by the coupled rule its tokens are
    those the target draws alone with the same seed."""
    runtime = runtimes("speculators")
    plain = runtime.generate([PROMPTS[0]], mode="autoregressive", **SAMPLED)[0].token_ids
    for gamma in (1, 4):
        [result] = runtime.generate([PROMPTS[0]], proposer="eagle", gamma=gamma, **SAMPLED)
        assert result.token_ids == plain and result.stats.draft_tokens > 0, gamma


def test_greedy_and_sampled_requests_share_iterations_exactly(runtimes, expected):
    """A sampled request beside greedy ones: the batch's verification samples, and the greedy rows'
    drafts are point masses, as a lookup's are."""
    runtime = runtimes("speculators")
    plain = runtime.generate([PROMPTS[1]], mode="autoregressive", **{**SAMPLED, "max_new_tokens": 70})[0].token_ids
    runtime.generate(PROMPTS[:2], max_new_tokens=2, gamma=4, proposer="eagle", **{"temperature": 0.5})
    sampled = runtime.submit(PROMPTS[1], proposer="eagle", gamma=4, **{**SAMPLED, "max_new_tokens": 70})
    greedy = runtime.submit_batch(PROMPTS, max_new_tokens=MAX_NEW, gamma=4, proposer="eagle")
    assert [handle.result(timeout=60).token_ids for handle in greedy] == expected
    assert sampled.result(timeout=60).token_ids == plain


def family_target(path, family: str, tokenizer):
    """A tiny `family` checkpoint of LAYERS layers (gemma3's attention kinds alternating over them)."""
    depth = {"n_layer": LAYERS} if family == "gpt2" else {"num_hidden_layers": LAYERS}
    if family == "gemma3":
        depth["layer_types"] = ["sliding_attention", "full_attention"] * (LAYERS // 2)
    return make_checkpoint(path, family, tokenizer=tokenizer, **depth)


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "gemma3", "phi3", "gpt2"])
def test_every_family_generates_its_own_greedy_output_with_an_eagle_head(family, tmp_path, tokenizer):
    """The target's features are each family's own (its embedding scale, position embeddings, norms):
    with a head reading them, greedy output is still the target's, as HF generates it."""
    target = family_target(tmp_path / "target", family, tokenizer)
    config = target_config(target)
    config.setdefault("hidden_size", config.get("n_embd"))  # GPT-2's name
    head = write_eagle3_head(tmp_path / "head", random_head(config, seed=6, aux_layer_ids=AUX), Layout.SPECULATORS)
    bundle = build_bundle(target, None, tmp_path / "bundle", gammas=[4], max_seq=64, max_batch=2, eagle_dir=head)
    with speccompile.load(bundle) as runtime:
        results = runtime.generate(PROMPTS[:2], max_new_tokens=12, proposer="eagle", gamma=4)
        assert [r.token_ids for r in results] == [hf_greedy(target, p, 12) for p in PROMPTS[:2]]
        assert all(r.stats.by_proposer["eagle"][1] > 0 for r in results)  # the head drafted


def test_a_sampled_request_finds_the_head_s_sampled_graphs_loaded_before_it_runs(runtimes):
    """Loading a session inside an iteration would be timed as the head's work: a sampled request's
    graphs, the head's sampled ones included, load when it is queued."""
    runtime = runtimes("speculators", max_batch=2)  # a runtime of its own: nothing sampled has run on it
    asked = []
    load_graphs = runtime.eagle.load_graphs
    runtime.eagle.load_graphs = lambda graphs, batch=None: (asked.extend(g.name for g in graphs),
                                                           load_graphs(graphs, batch))
    runtime.generate([PROMPTS[0]], proposer="eagle", gamma=4, **SAMPLED)
    assert {"eagle_catch_up_sample", "eagle_step_sample"} <= set(asked)


def test_a_profile_that_did_not_time_the_head_is_completed_by_timing_it(target, head, tmp_path):
    """A γ profile measured without the head's calls (by `speccompile profile`, which times the loop
    alone) would make its drafts look free, and teach nothing of their cost: the load times the head
    and the policies' costs from the profile price its calls."""
    from speccompile.core.cost_model import LoopCosts
    from tests.runtime.test_profile import write_profile_with

    head_dir = write_eagle3_head(tmp_path / "head", head, Layout.SPECULATORS)
    bundle = build_bundle(target, None, tmp_path / "bundle", gammas=[1, 4], max_seq=96, max_batch=2, eagle_dir=head_dir)
    write_profile_with(bundle, [0.5] * 4, LoopCosts(10.0, {1: 0.0, 4: 0.0}, {1: 11.0, 4: 12.0}))
    with speccompile.load(bundle) as runtime:
        assert runtime.profile is not None and runtime.policies.calibration.has_head
        costs = runtime.policies.policy_for(1, 16).costs
        assert costs.target_step == 10.0 and costs.verify[4] == 12.0  # the profile's
        assert costs.head_step == runtime.policies.calibration.head_step > 0
        assert costs.head_catch_up == runtime.policies.calibration.head_catch_up > 0


def recorded_trees(monkeypatch) -> list:
    """Every dynamic tree drafted from now on: (the request's tokens then, the tree, its nodes' tokens);
    every iteration that may draft a tree does (whatever the chain's measured rate)."""
    from speccompile.core import scheduler

    always_trees(monkeypatch)
    log, drafting = [], scheduler.draft_tree

    def draft_and_record(runner, request, shape, slot=0, sizing=None):
        drafted = drafting(runner, request, shape, slot, sizing)
        if drafted is not None:
            log.append((list(request.tokens), *drafted[:2]))
        return drafted

    monkeypatch.setattr(scheduler, "draft_tree", draft_and_record)
    return log


def test_every_tree_node_is_among_the_reference_heads_best_after_its_path(runtimes, target, head, monkeypatch):
    """Each node of a drafted tree is one of the `children` best tokens of the torch reference's head
    after the request's history and the node's path (each path fed through the reference afresh): the
    tree step's positions and masks are a chain's for every path."""
    from speccompile.core.proposers.eagle_tree import TreeShape

    runtime, shape = runtimes("speculators"), TreeShape()
    log = recorded_trees(monkeypatch)
    runtime.generate([PROMPTS[0]], max_new_tokens=MAX_NEW, proposer="eagle_tree")
    assert len(log) >= 3
    hf = transformers.AutoModelForCausalLM.from_pretrained(target).eval()
    embedding = hf.get_input_embeddings().weight.detach().numpy()
    for tokens, tree, nodes in log[:3]:
        with torch.no_grad():
            states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        features = np.concatenate([states[i][0].numpy() for i in AUX], axis=-1)
        assert tree.size - 1 == len(nodes) <= shape.nodes and tree.max_depth <= shape.depth
        for node in range(1, tree.size):
            path = [int(nodes[n - 1]) for n in tree.path_to(node)]
            with torch.no_grad():
                ref = Eagle3Reference(head, embedding)
                hidden = ref.forward(ref.fuse(features), tokens[1:])[-1:]
                for token in path[:-1]:
                    hidden = ref.forward(hidden, [token])
                best = ref.logits(hidden[-1]).topk(shape.children).indices.numpy()
            assert path[-1] in draft_to_target(head, best).tolist(), (tokens, path)


def always_trees(monkeypatch) -> None:
    from speccompile.core.proposers.eagle_tree import TreeEconomy

    monkeypatch.setattr(TreeEconomy, "tree_turn", lambda self: True)


def test_a_dynamic_tree_keeps_the_target_s_greedy_output(runtimes, bigram_target, expected, monkeypatch):
    """EAGLE-2's tree (proposer eagle_tree) for a request alone: the target's greedy output exactly, with
    a random head and with an agreeing one; in a batch the proposer drafts the chain."""
    always_trees(monkeypatch)
    agreeing = runtimes("agreeing")
    assert agreeing.eagle.drafts_trees and agreeing.target.drafts_trees
    for prompt in PROMPTS:
        [result] = agreeing.generate([prompt], max_new_tokens=MAX_NEW, proposer="eagle_tree")
        assert result.token_ids == hf_greedy(bigram_target, prompt, MAX_NEW)
        assert list(result.stats.by_proposer) == ["eagle_tree"] and result.stats.accepted_tokens > 0
    random = runtimes("speculators")
    for prompt, tokens in zip(PROMPTS, expected):
        [result] = random.generate([prompt], max_new_tokens=MAX_NEW, proposer="eagle_tree")
        assert result.token_ids == tokens and result.stats.tree_nodes > 0
    batch = random.generate(PROMPTS, max_new_tokens=MAX_NEW, proposer="eagle_tree", gamma=4)
    assert [r.token_ids for r in batch] == expected and all(r.stats.tree_nodes == 0 for r in batch)


def test_on_one_session_graph_the_target_verifies_the_same_trees(runtimes, monkeypatch):
    """A real-size target runs every call on its one session graph, which serves the tree's kind: the
    same trees, the same tokens kept from each, as the target's own tree graph (trees of the whole
    shape, so that their size does not follow the measured costs)."""
    from speccompile.core.proposers.eagle_tree import TreeSizing

    always_trees(monkeypatch)
    monkeypatch.setattr(TreeSizing, "count", lambda self, scores: len(scores))
    monkeypatch.setattr(TreeSizing, "expands", lambda self, best, scores: True)
    for name in ("agreeing", "speculators"):
        per_graph, one = runtimes(name), runtimes(name, one_session=True)
        assert one.target.one_session and one.target.drafts_trees
        for prompt in PROMPTS:
            [ours] = one.generate([prompt], max_new_tokens=MAX_NEW, proposer="eagle_tree")
            [theirs] = per_graph.generate([prompt], max_new_tokens=MAX_NEW, proposer="eagle_tree")
            assert ours.token_ids == theirs.token_ids and ours.stats.tree_nodes > 0
            assert (ours.stats.tree_nodes, ours.stats.accepted_tokens) == \
                (theirs.stats.tree_nodes, theirs.stats.accepted_tokens), (name, prompt)


def test_trees_and_chains_taking_turns_keep_the_target_s_greedy_output(runtimes, bigram_target, monkeypatch):
    """Where the tree and the chain alternate (TreeEconomy.tree_turn), the head's state after a tree is
    what its chain reads on, and the other way round: the output is the target's, and both run. Trees
    of the whole shape, so that what they keep does not follow the measured costs (a loaded machine
    sizes them otherwise)."""
    from speccompile.core.proposers.eagle_tree import TreeEconomy, TreeSizing

    monkeypatch.setattr(TreeSizing, "count", lambda self, scores: len(scores))
    monkeypatch.setattr(TreeSizing, "expands", lambda self, best, scores: True)
    turns = iter([True, False] * MAX_NEW)
    agreeing = runtimes("agreeing")
    original = TreeEconomy.tree_turn
    TreeEconomy.tree_turn = lambda self: next(turns)
    try:
        for prompt in PROMPTS:
            [result] = agreeing.generate([prompt], max_new_tokens=MAX_NEW, proposer="eagle_tree", gamma=4)
            assert result.token_ids == hf_greedy(bigram_target, prompt, MAX_NEW)
            assert result.stats.tree_nodes > 0 and result.stats.gammas_used.get(4, 0) > 0
            assert result.stats.accepted_tokens > result.stats.iterations / 2, result.stats  # the chain's kept too
    finally:
        TreeEconomy.tree_turn = original
