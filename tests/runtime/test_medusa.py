"""Medusa bundles (`speccompile build --medusa`): token trees verified in one target pass, greedy output
exactly the target's (HF's), the accepted path's cache entries moved into place; typical acceptance
opt-in and labelled; what Medusa does not do is refused in one line."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

import speccompile
from speccompile.cli import main
from speccompile.core.tree import TokenTree
from speccompile.errors import SpecCompileError
from tests.conftest import FAMILIES, MEDUSA_HEADS
from tests.runtime.test_generate import MAX_NEW, PROMPTS, hf_greedy

# the oracle's trees hold the right tokens along ranks (1, 1, ..) only: accepted paths leave the first
# branch, so their cache entries must move (a chain's never do)
ORACLE_TREE = TokenTree.from_paths([(0,), (1,), (0, 0), (1, 0), (1, 1), (1, 1, 0), (1, 1, 1)])


def test_a_medusa_bundle_records_its_heads_and_has_no_draft(bundles):
    manifest = json.loads((bundles("llama", "medusa") / "manifest.json").read_text())
    assert set(manifest["models"]) == {"target"}
    assert manifest["medusa"]["num_heads"] == MEDUSA_HEADS and len(manifest["medusa"]["top_k_accuracy"]) == 3
    assert {"target_verify_tree", "target_verify_tree_typical"} <= set(manifest["graphs"])
    assert "verify_tree" in manifest["models"]["target"]["session"]["kinds"]


@pytest.mark.parametrize("family", FAMILIES)
def test_medusa_greedy_is_hf_with_any_tree_alone_and_in_a_batch(family, bundles, checkpoints):
    runtime = speccompile.load(bundles(family, "medusa"))
    expected = [hf_greedy(checkpoints(family), p, MAX_NEW) for p in PROMPTS]
    for tree in (None, "chain", 5):
        if tree is not None:
            runtime.set_tree(tree)
        batched = runtime.generate(PROMPTS, max_new_tokens=MAX_NEW)
        alone = [runtime.generate([p], max_new_tokens=MAX_NEW)[0] for p in PROMPTS]
        assert [r.token_ids for r in batched] == expected and [r.token_ids for r in alone] == expected, tree
        assert all(set(r.stats.by_proposer) == {"medusa"} for r in batched + alone)
    assert runtime.tree_sizing.record is not None  # the first generation sized the tree by measured cost


def with_oracle_heads(runtime, continuations: dict):
    """Replace each verification's next tree by one that holds the target's own continuation along
    ranks (1, 1, ..) and wrong tokens elsewhere, so that paths off the first branch are accepted."""
    verify_tree = runtime.target.verify_tree

    def oracle(tokens, draft_len, tree, typical=None, first=0, forbidden=None):
        best, next_token, next_tree = verify_tree(tokens, draft_len, tree, typical, first, forbidden)
        for row, request in enumerate(runtime.scheduler.decoding):
            full = continuations[tuple(request.prompt)]
            start = int(runtime.target.cache_lengths[first + row]) + 1  # the root is the first uncached token
            for node, path in enumerate(tree.paths, start=1):
                right = full[start + len(path) - 1] if start + len(path) - 1 < len(full) else 0
                next_tree[row, node] = right if set(path) == {1} else (right + 1) % runtime.target.vocab_size
        return best, next_token, next_tree

    runtime.target.verify_tree = oracle


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_paths_off_the_first_branch_are_compacted_into_place(family, bundles, checkpoints):
    runtime = speccompile.load(bundles(family, "medusa"))
    expected = [hf_greedy(checkpoints(family), p, MAX_NEW) for p in PROMPTS]
    with_oracle_heads(runtime, {tuple(p): p + e for p, e in zip(PROMPTS, expected)})
    runtime.set_tree(ORACLE_TREE)
    results = runtime.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert [r.token_ids for r in results] == expected  # entries left at node slots would change the logits
    for r in results:
        assert r.stats.mean_acceptance_length > 2.5, r.stats.to_dict()  # the oracle's depth-3 paths were kept


def test_a_request_verifies_no_deeper_than_its_gamma_or_its_remaining_tokens(bundles, checkpoints):
    runtime = speccompile.load(bundles("llama", "medusa"))
    expected = hf_greedy(checkpoints("llama"), PROMPTS[0], 7)
    with_oracle_heads(runtime, {tuple(PROMPTS[0]): PROMPTS[0] + expected + [0] * 8})
    runtime.set_tree(ORACLE_TREE)
    [result] = runtime.generate([PROMPTS[0]], max_new_tokens=7, gamma=1)
    assert result.token_ids == expected and set(result.stats.gammas_used) <= {0, 1}


def test_typical_acceptance_is_opt_in_labelled_and_applied(bundles):
    runtime = speccompile.load(bundles("llama", "medusa"))
    rules = []
    verify_tree = runtime.target.verify_tree

    def recorded(tokens, draft_len, tree, typical=None, first=0, forbidden=None):
        rules.append(None if typical is None else tuple(float(v[0]) for v in typical))
        return verify_tree(tokens, draft_len, tree, typical, first, forbidden)

    runtime.target.verify_tree = recorded
    [exact] = runtime.generate([PROMPTS[0]], max_new_tokens=8)
    assert exact.stats.to_dict()["acceptance"] == "exact" and set(rules) == {None}
    rules.clear()
    [typical] = runtime.generate([PROMPTS[0]], max_new_tokens=8, acceptance="typical")
    assert typical.stats.to_dict()["acceptance"] == "typical" and len(typical.token_ids) == 8
    assert rules and all(r == pytest.approx((0.09, 0.3)) for r in rules)  # Medusa's ε and δ, every verification
    alone = runtime.generate([PROMPTS[1]], max_new_tokens=8)[0].token_ids
    batch = [runtime.submit(PROMPTS[0], max_new_tokens=8, acceptance="typical"),
             runtime.submit(PROMPTS[1], max_new_tokens=8)]
    assert batch[1].result(timeout=60).token_ids == alone  # beside a typical request, an exact one stays exact
    runtime.close()


def test_what_medusa_bundles_do_not_do_is_refused_in_one_line(bundles):
    runtime = speccompile.load(bundles("llama", "medusa"))
    with pytest.raises(SpecCompileError, match="greedy only"):
        runtime.generate([PROMPTS[0]], max_new_tokens=4, temperature=0.8)
    with pytest.raises(SpecCompileError, match="Medusa heads"):
        runtime.generate([PROMPTS[0]], max_new_tokens=4, proposer="draft")
    with pytest.raises(SpecCompileError, match="heads"):
        runtime.set_tree(TokenTree.chain(MEDUSA_HEADS + 1))  # deeper than the bundle's heads
    with pytest.raises(SpecCompileError, match="acceptance must be"):
        runtime.generate([PROMPTS[0]], max_new_tokens=4, acceptance="lenient")
    plain = speccompile.load(bundles("llama", "none"))
    with pytest.raises(SpecCompileError, match="--medusa"):
        plain.generate([PROMPTS[0]], max_new_tokens=4, acceptance="typical")
    with pytest.raises(SpecCompileError, match="--medusa"):
        plain.set_tree("chain")


def test_cli_generate_shows_the_tree_and_the_typical_label(bundles):
    bundle = str(bundles("llama", "medusa"))
    out = CliRunner().invoke(main, ["generate", bundle, "--prompt", "hello", "--max-new-tokens", "6", "--tree",
                                    "chain", "--acceptance", "typical"])
    assert out.exit_code == 0, out.output
    assert "Medusa tree" in out.output and "TYPICAL acceptance" in out.output
    bad = CliRunner().invoke(main, ["generate", bundle, "--prompt", "hello", "--tree", "wide"])
    assert bad.exit_code == 1 and "--tree must be" in bad.output


def test_build_refuses_a_draft_and_heads_together(checkpoints, tmp_path):
    from tests.conftest import random_medusa_heads

    heads = random_medusa_heads(checkpoints("llama"), tmp_path / "heads")
    out = CliRunner().invoke(main, ["build", "--target", str(checkpoints("llama")), "--draft",
                                    str(checkpoints("llama")), "--medusa", str(heads), "--out", str(tmp_path / "b")])
    assert out.exit_code == 1 and "not both" in out.output


def test_bench_acceptance_reports_speed_and_deviation(bundles):
    from speccompile.core.params import GenerationParams
    from speccompile.runtime.bench import ACCEPTANCE_KEYS, bench_acceptance

    runtime = speccompile.load(bundles("llama", "medusa"))
    rows = [r.to_json() for r in bench_acceptance(runtime, ["hello world", "def f"], ["exact", "typical"],
                                                  GenerationParams(max_new_tokens=8), repeats=1)]
    assert [list(r) for r in rows] == [ACCEPTANCE_KEYS] * 2
    exact = rows[0]
    assert exact["token_agreement"] == 1.0 and exact["identical_outputs"] == 1.0  # exact is the greedy output
    assert exact["mean_log_likelihood"] == pytest.approx(exact["exact_mean_log_likelihood"])
    assert np.isfinite(rows[1]["perplexity"]) and 0.0 <= rows[1]["token_agreement"] <= 1.0


def test_a_tree_shrinks_to_the_room_left_and_grows_back(bundles, checkpoints):
    """Near the end of the cache a tree verifies its first nodes only; once that row leaves, the rows
    beside it verify the whole tree again (from the smaller tree their last pass proposed)."""
    runtime = speccompile.load(bundles("llama", "medusa"))  # max_seq 96
    long, short = list(range(3, 73)), PROMPTS[1]
    expected = {tuple(long): hf_greedy(checkpoints("llama"), long, 24),
                tuple(short): hf_greedy(checkpoints("llama"), short, 48)}
    with_oracle_heads(runtime, {p: list(p) + e + [0] * 16 for p, e in expected.items()})
    runtime.set_tree(ORACLE_TREE)
    handles = [runtime.submit(long, max_new_tokens=24), runtime.submit(short, max_new_tokens=48)]
    assert [h.result(timeout=60).token_ids for h in handles] == list(expected.values())
    runtime.close()


def test_compaction_leaves_the_cache_a_sequential_pass_would(bundles, checkpoints):
    """After a tree verification whose path leaves the first branch, the cache up to the new length
    holds what feeding the accepted tokens one after another writes (ONNX Runtime's cache arrays)."""
    target = speccompile.load(bundles("llama", "medusa")).target
    prompt = PROMPTS[0]
    truth = hf_greedy(checkpoints("llama"), prompt, 4)  # truth[0] is the prefill's token, the tree's root
    tree = TokenTree.from_paths([(0,), (1,), (0, 0), (1, 0), (1, 1)])  # the right path: nodes 2 -> 5
    tokens = np.array([[truth[0], truth[1] + 1, truth[1], truth[2] + 1, truth[2] + 1, truth[2]]])
    target.start(2)
    for slot in (0, 1):
        target.forward(np.array([prompt]), np.array([len(prompt)]), first=slot)
    best, next_token, _ = target.verify_tree(tokens, np.array([5]), tree, first=0)
    assert (best[0], next_token[0]) == (5, truth[3])
    target.forward(np.array([truth[:3]]), np.array([3]), first=1)  # root, node 2, node 5 in a row
    length = len(prompt) + 3
    assert target.cache_lengths[0] == target.cache_lengths[1] == length
    for layer in target.cache:
        np.testing.assert_allclose(layer[0, :, :length], layer[1, :, :length], atol=1e-5)


def test_a_larger_batch_verifies_the_prefix_sized_for_it(bundles, checkpoints):
    runtime = speccompile.load(bundles("llama", "medusa"))
    runtime.generate([PROMPTS[0]], max_new_tokens=2)  # sizes the tree, and the prefix per batch size
    assert set(runtime.proposers.tree.nodes_per_batch) == set(range(1, runtime.max_batch + 1))
    runtime.set_tree(ORACLE_TREE)
    runtime.proposers.tree.nodes_per_batch = {2: 3}
    widths = []
    verify_tree = runtime.target.verify_tree

    def recorded(tokens, draft_len, tree, typical=None, first=0, forbidden=None):
        widths.append((len(tokens), tokens.shape[1], tree.size))
        return verify_tree(tokens, draft_len, tree, typical, first, forbidden)

    runtime.target.verify_tree = recorded
    expected = [hf_greedy(checkpoints("llama"), p, MAX_NEW) for p in PROMPTS[:2]]
    assert [r.token_ids for r in runtime.generate(PROMPTS[:2], max_new_tokens=MAX_NEW)] == expected
    pairs = [(n, size) for batch, n, size in widths if batch == 2]
    assert pairs and set(pairs) == {(3, 3)}  # two rows: the first 3 nodes of the tree
    assert all(n == size == ORACLE_TREE.size for batch, n, size in widths if batch == 1)


def test_the_sized_tree_is_recorded_in_the_bundle_and_read_back(bundles, monkeypatch):
    bundle = bundles("llama", "medusa")
    first = speccompile.load(bundle)
    first.generate([PROMPTS[0]], max_new_tokens=2)
    [record] = (bundle / "profiles").glob("tree-*.json")
    assert json.loads(record.read_text())["tree"] == first.proposers.tree.tree.to_json()
    import speccompile.runtime.calibration as calibration

    monkeypatch.setattr(calibration, "measure_tree_costs", lambda *a, **k: pytest.fail("sized again"))
    second = speccompile.load(bundle)
    second.generate([PROMPTS[0]], max_new_tokens=2)
    assert second.proposers.tree == first.proposers.tree  # the tree and its prefix per batch size
