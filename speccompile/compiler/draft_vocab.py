"""Draft vocabulary: the draft's greedy LM head cut to the K most frequent tokens (as in FR-Spec).

Why: a small draft spends a large share of each step in its LM head (hidden × vocab is often its
biggest matrix: half the demo draft's parameters), while a target's greedy output concentrates on
few tokens (the demo target's continuations of held-out code: 99.5% within the 2048 most frequent
of 8192 tokens). Scoring only K candidates makes every greedy draft step cheaper.

Why the output does not change: the subset only limits which tokens the draft can *propose*. The
target's argmax decides every emitted token; a target token outside the subset just ends the
accepted prefix, and the target's own correction token is appended as usual.

What it costs: text that copies rare tokens from its context. Code repeats identifiers from the
prompt, and a target that copies one outside the subset rejects the draft at every copy. On the demo
pair's held-out code bodies, greedy acceptance at γ=4 is 0.73 with the whole vocabulary, 0.74 with
K = 3072 and 0.66 with K = 2048: measure K on the text you serve.

Why only greedy graphs: when sampling, the draft's proposal distribution q must cover the tokens the
target samples, which reach far into the tail. Rejection sampling would stay exact with q = 0
outside the subset (it yields p for any q), but acceptance falls: on the demo pair at temperature
1, from 0.61 to 0.51 with K = 2048. The sampling graph keeps the whole head.

Frequencies come from text the draft is meant for: `speccompile distill` records them for its
corpus in the draft checkpoint (`token_frequencies.json`); `speccompile build --draft-vocab-corpus`
counts them on any corpus instead.
"""

import json
from pathlib import Path

import numpy as np

from speccompile.corpus import corpus_tokens
from speccompile.errors import SpecCompileError

FREQUENCIES_FILE = "token_frequencies.json"


def count_tokens(tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    return np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)[:vocab_size]


def write_frequencies(directory, counts: np.ndarray, corpus: str) -> Path:
    path = Path(directory) / FREQUENCIES_FILE
    path.write_text(json.dumps({"corpus": corpus, "tokens": int(counts.sum()), "counts": [int(c) for c in counts]}))
    return path


def read_frequencies(directory) -> np.ndarray | None:
    path = Path(directory) / FREQUENCIES_FILE
    if not path.is_file():
        return None
    try:
        return np.asarray(json.loads(path.read_text())["counts"], dtype=np.int64)
    except (ValueError, KeyError, TypeError) as e:
        raise SpecCompileError(f"{path}: not a token frequency file ({e})") from None


def corpus_frequencies(corpus, tokenizer, vocab_size: int) -> np.ndarray:
    """Token counts of a corpus argument (as `speccompile distill --corpus`), train part only."""
    encode = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    train, _ = corpus_tokens(corpus, encode, tokenizer.eos_token_id or 0)
    if len(train) == 0:
        raise SpecCompileError(f"corpus {corpus} has no tokens to count")
    return count_tokens(train, vocab_size)


def select_vocab(counts: np.ndarray, size: int, vocab_size: int, always: list[int]) -> np.ndarray:
    """The `size` most frequent ids (ties: lower id first), always including `always` (EOS, so the
    draft can propose the end of a sequence), sorted ascending."""
    if not 0 < size < vocab_size:
        raise SpecCompileError(f"--draft-vocab must be between 1 and {vocab_size - 1} "
                               f"(the vocabulary has {vocab_size} tokens), got {size}")
    always = sorted({i for i in always if 0 <= i < vocab_size})
    if size < len(always):
        raise SpecCompileError(f"--draft-vocab {size} is smaller than the {len(always)} end-of-sequence token(s) "
                               "it must keep")
    counts = np.pad(np.asarray(counts, np.int64)[:vocab_size], (0, max(0, vocab_size - len(counts))))
    ranked = np.argsort(-counts, kind="stable")
    ranked = [i for i in ranked.tolist() if i not in always]
    return np.array(sorted(always + ranked[: size - len(always)]), dtype=np.int64)
