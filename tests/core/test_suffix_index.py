"""core/suffix_index.py: suffix trie counts, incremental extension, eviction, proposals, the request/global cache."""

import numpy as np
import pytest

from speccompile.core.suffix_index import SuffixCache, SuffixTree, expected_accepted


def snapshot(tree, path=()):
    """A trie as nested plain data: (count, {token: child snapshot})."""
    return tree.count(list(path)), {token: snapshot(tree, path + (token,)) for token in sorted(tree.children(path))}


def occurrences(sequences, path, max_depth):
    """Brute force: the suffix starts whose first len(path) tokens are `path` (what a node must count)."""
    n = len(path)
    starts = [(seq, i) for seq in sequences for i in range(len(seq) - n + 1)]
    return sum(n <= max_depth and list(seq[i:i + n]) == list(path) for seq, i in starts)


def paths(tree, prefix=()):
    for token, count in tree.children(list(prefix)).items():
        yield prefix + (token,), count
        yield from paths(tree, prefix + (token,))


def random_sequence(seed, length, alphabet=4):
    return [int(t) for t in np.random.default_rng(seed).integers(0, alphabet, length)]


@pytest.mark.parametrize("max_depth", [1, 3, 6])
def test_every_node_counts_the_indexed_occurrences_of_its_path(max_depth):
    sequences = [random_sequence(0, 40), random_sequence(1, 25), [2, 2, 2, 2]]
    tree = SuffixTree(max_depth)
    for i, seq in enumerate(sequences):
        tree.add(i, seq)
    assert tree.count([]) == sum(len(s) for s in sequences)
    found = dict(paths(tree))
    assert max(len(p) for p in found) == max_depth
    for path, count in found.items():
        assert count == tree.count(list(path)) == occurrences(sequences, path, max_depth) > 0
    for seq in sequences:  # and every substring up to max_depth is there
        for i in range(len(seq)):
            assert all(tuple(seq[i:j]) in found for j in range(i + 1, min(i + max_depth, len(seq)) + 1))


def test_extend_in_chunks_builds_the_same_trie_and_proposals_as_one_add():
    seq = random_sequence(2, 300, alphabet=5)
    whole, pieces = SuffixTree(8), SuffixTree(8)
    whole.add(7, seq)
    pieces.add(7, seq[:3])
    rng, at = np.random.default_rng(3), 3
    while at < len(seq):
        step = int(rng.integers(1, 9))
        pieces.extend(7, seq[at:at + step])
        at += step
    assert snapshot(whole) == snapshot(pieces)
    assert pieces.sequence(7) == seq
    for end in range(2, len(seq), 7):
        assert whole.speculate(seq[:end], 6) == pieces.speculate(seq[:end], 6)


def test_repeated_structure_proposes_its_continuation():
    tree = SuffixTree()
    history = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    tree.add(0, history)
    # [9, 1, 2, 3] only ends the sequence; [1, 2, 3] was seen twice, once followed by 4 -> 5 -> 9 -> 1
    assert tree.speculate(history, 4) == ([4, 5, 9, 1], 0.5, 3)
    assert tree.speculate(history, 10) == ([4, 5, 9, 1, 2, 3], 0.5, 3)  # up to the end of the indexed run
    assert tree.speculate([7, 7, 2, 3], 2) == ([4, 5], 0.5, 2)  # a shorter match when the longer is unseen
    assert tree.speculate(history, 4, max_match=2) == ([4, 5, 9, 1], 0.5, 2)


def test_the_most_frequent_continuation_wins_whatever_the_order_seen():
    tree = SuffixTree()
    for i, seq in enumerate([[5, 6, 2, 0], [5, 6, 1, 0], [5, 6, 1, 0]]):
        tree.add(i, seq)
    tokens, probability, matched = tree.speculate([9, 5, 6], 2)
    assert (tokens, matched) == ([1, 0], 2)
    assert probability == pytest.approx(2 / 3)
    tree.add(3, [5, 6, 2, 0])  # a tie now: the smaller token
    assert tree.speculate([5, 6], 1)[0] == [1]


def test_min_probability_cuts_the_proposal_where_the_branch_ratio_falls():
    tree = SuffixTree()
    for i, last in enumerate([5, 6, 7]):
        tree.add(i, [1, 2, 3, 4, last, 0])
    assert tree.speculate([1, 2, 3], 5, min_probability=0.5) == ([4], 1.0, 3)  # 4 -> {5, 6, 7}: 1/3 each
    tokens, probability, _ = tree.speculate([1, 2, 3], 5, min_probability=0.3)
    assert tokens == [4, 5, 0] and probability == pytest.approx(1 / 3)
    tokens, probabilities, _ = tree.propose([1, 2, 3], 5, min_probability=0.3)
    assert probabilities == pytest.approx([1, 1 / 3, 1 / 3])
    assert tree.speculate([9, 3, 4], 5, min_probability=0.5) == ([], 0.0, 2)  # matched, first step too unsure


def test_match_bounds_and_no_match_give_an_empty_proposal():
    tree = SuffixTree(max_depth=6)
    tree.add(0, [1, 2, 3, 4, 5, 6, 7, 8])
    assert tree.speculate([8, 8, 8], 4) == ([], 0.0, 0)
    assert tree.speculate([2], 4) == ([], 0.0, 0)  # shorter than min_match
    assert tree.speculate([2], 8, min_match=1) == ([3, 4, 5, 6, 7], 1.0, 1)  # match + proposal <= max_depth
    assert tree.speculate([1, 2, 3, 4], 4) == ([5, 6], 1.0, 4)
    assert tree.speculate([1, 2, 3], 0) == ([], 0.0, 0)
    assert SuffixTree().speculate([1, 2, 3], 4) == ([], 0.0, 0)


def test_remove_forgets_a_sequence():
    a, b = random_sequence(4, 60), random_sequence(5, 60)
    tree, only_b = SuffixTree(5), SuffixTree(5)
    tree.add(0, a)
    tree.add(1, b)
    tree.remove(0)
    only_b.add(1, b)
    assert snapshot(tree) == snapshot(only_b)
    assert 0 not in tree and 1 in tree
    tree.remove(1)
    assert snapshot(tree) == (0, {})


def test_adds_extends_and_removes_in_any_order_match_a_rebuild_of_the_survivors():
    rng, tree, live, removed = np.random.default_rng(6), SuffixTree(5), {}, 0
    for step in range(60):
        action = int(rng.integers(0, 5))  # add, add, extend, extend, remove
        if action < 2 or not live:
            live[step] = random_sequence(step, int(rng.integers(0, 30)), alphabet=3)
            tree.add(step, live[step])
        elif action < 4:
            key = sorted(live)[int(rng.integers(0, len(live)))]
            more = random_sequence(100 + step, int(rng.integers(1, 9)), alphabet=3)
            live[key] += more
            tree.extend(key, more)
        else:
            key = sorted(live)[int(rng.integers(0, len(live)))]
            del live[key]
            tree.remove(key)
            removed += 1
    rebuilt = SuffixTree(5)
    for key, seq in live.items():
        rebuilt.add(key, seq)
    assert snapshot(tree) == snapshot(rebuilt) and removed > 5 and tree.count([]) > 20

    tree = SuffixTree()
    tree.add(0, [10, 11, 12, 13])
    tree.add(1, [20, 21, 22])
    assert tree.speculate([10, 11], 2) == ([12, 13], 1.0, 2)
    tree.remove(0)
    assert tree.speculate([10, 11], 2) == ([], 0.0, 0)
    tree.extend(1, [20, 21])  # the survivor still extends
    assert tree.speculate([20, 21], 1) == ([22], 0.5, 2)
    with pytest.raises(ValueError):
        tree.add(1, [1])


def test_cache_proposes_from_an_earlier_requests_output_when_its_own_has_no_match():
    cache = SuffixCache(max_depth=16, max_sequences=2)
    cache.start("a", [100, 101])
    cache.extend("a", [1, 2, 3, 4])
    cache.extend("a", [5, 6])
    assert cache.speculate("a", [9, 1, 2], 3) == ([3, 4, 5], 1.0, 2)  # its own tree (the global one is empty)
    cache.finish("a")
    cache.start("b", [50, 51, 52])
    assert cache.speculate("b", [50, 51, 52, 2, 3], 3) == ([4, 5, 6], 1.0, 2)  # from a's output
    assert cache.speculate("b", [100, 101], 3) == ([], 0.0, 0)  # a's prompt never joins the global tree
    assert cache.speculate("b", [9, 50, 51], 3) == ([52], 1.0, 2)  # b's own prompt
    cache.extend("b", [7, 50, 51])
    assert cache.speculate("b", [7, 50, 51], 3) == ([52, 7, 50], 0.5, 2)  # [50, 51] seen twice, continued once
    cache.finish("b", remember=False)
    cache.speculate("unknown", [1, 2], 1)  # no request tree: the global one alone
    for key, output in [("c", [30, 31, 32]), ("d", [40, 41, 42])]:
        cache.start(key, [0])
        cache.extend(key, output)
        cache.finish(key)
    assert cache.speculate("x", [2, 3], 3) == ([], 0.0, 0)  # a was the oldest of three: evicted
    assert cache.speculate("x", [30, 31], 3) == ([32], 1.0, 2)


def test_cache_keeps_the_proposal_with_more_expected_accepted_tokens():
    cache = SuffixCache(max_depth=16)
    cache.start("old", [0])
    cache.extend("old", [1, 2, 3, 4, 5, 6, 7])
    cache.finish("old")
    cache.start("new", [1, 2, 8, 1, 2])  # its own: 0.5 each (1.5 expected); global: 1.0 each (3)
    tokens, probability, matched = cache.speculate("new", [1, 2, 8, 1, 2], 3)
    assert (tokens, probability, matched) == ([3, 4, 5], 1.0, 2)
    assert expected_accepted([1.0, 0.5, 0.25]) == 1.75
    cache.start("tie", [5, 1, 2, 9])  # its own [1, 2] -> 9 and the global [1, 2] -> 3 .. : one expected token each
    assert cache.speculate("tie", [0, 1, 2], 1) == ([9], 1.0, 2)  # a tie keeps the request's own
