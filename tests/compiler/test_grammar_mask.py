"""The graphs' grammar masks (compiler/logits.py): the bytes of a bitmask of forbidden tokens (int32
words, the sign bit in use), unpacked where the logits are by a table, equal to numpy's unpacking of
the same bits, for a vocabulary that is not a multiple of 32 and for a cut draft head's subset of it;
and switched off, they leave the logits as they are."""

import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from speccompile.compiler.logits import NEG_INF, constrained
from speccompile.compiler.onnx_graph import FLOAT, GraphBuilder, WeightFile


def masked_by_graph(logits: np.ndarray, forbidden: np.ndarray, vocab: int, vocab_ids=None, on: bool = True):
    g = GraphBuilder("mask")
    z = g.input("logits", FLOAT, ["batch", "positions", logits.shape[2]])
    ids = g.const(vocab_ids) if vocab_ids is not None else None
    g.output(constrained(g, z, vocab, "positions", ids), "masked", FLOAT, ["batch", "positions", logits.shape[2]])
    with tempfile.TemporaryDirectory() as directory:  # the byte table is a weight, in a weights file
        weights = WeightFile("w.bin")
        weights.add(g.weights)
        weights.write(Path(directory) / "w.bin")
        (Path(directory) / "m.onnx").write_bytes(g.model(weights.locations).SerializeToString())
        session = ort.InferenceSession(str(Path(directory) / "m.onnx"))
    feeds = {"logits": logits, "forbidden": forbidden.view(np.uint8), "constrain": np.array(on)}
    return session.run(None, feeds)[0]


def numpy_reference(logits: np.ndarray, forbidden: np.ndarray, vocab: int, vocab_ids=None) -> np.ndarray:
    bits = np.unpackbits(forbidden.view(np.uint8), axis=-1, bitorder="little")[..., :vocab].astype(bool)
    if vocab_ids is not None:
        bits = bits[..., vocab_ids]
    return np.where(bits, logits + np.float32(NEG_INF / 2), logits)


def random_words(rng, shape) -> np.ndarray:
    return rng.integers(-(2**31), 2**31, size=shape, dtype=np.int64).astype(np.int32)


@pytest.mark.parametrize("vocab", [5, 32, 77, 1000])
def test_forbidden_bits_mask_the_logits_as_numpy_unpacks_them(vocab):
    rng = np.random.default_rng(vocab)
    forbidden = random_words(rng, (3, 4, (vocab + 31) // 32))
    forbidden[0, 0] = -1  # every bit, the sign bit included
    forbidden[0, 1] = 0
    forbidden[1, 0, 0] = np.int32(-(2**31))  # the sign bit alone: token 31
    logits = rng.standard_normal((3, 4, vocab)).astype(np.float32)
    masked = masked_by_graph(logits, forbidden, vocab)
    np.testing.assert_array_equal(masked, numpy_reference(logits, forbidden, vocab))
    allowed = masked > np.float32(NEG_INF / 4)
    assert (masked[~allowed] < -1e37).all() and np.isfinite(masked).all()  # below every allowed logit, finite


def test_a_cut_draft_head_reads_the_bits_of_its_own_tokens():
    vocab, rng = 100, np.random.default_rng(1)
    subset = np.array([3, 31, 32, 64, 99], np.int64)
    forbidden = random_words(rng, (2, 1, 4))
    logits = rng.standard_normal((2, 1, len(subset))).astype(np.float32)
    np.testing.assert_array_equal(masked_by_graph(logits, forbidden, vocab, subset),
                                  numpy_reference(logits, forbidden, vocab, subset))


def test_switched_off_the_mask_is_not_applied():
    vocab, rng = 40, np.random.default_rng(2)
    logits = rng.standard_normal((1, 3, vocab)).astype(np.float32)
    forbidden = np.full((1, 3, 2), -1, np.int32)
    np.testing.assert_array_equal(masked_by_graph(logits, forbidden, vocab, on=False), logits)
    assert (masked_by_graph(logits, forbidden, vocab) < -1e37).all()
