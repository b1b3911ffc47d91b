"""Tokenizer export and the draft/target compatibility gate."""

import json
from pathlib import Path

from speccompile.compiler.checkpoint import ModelSpec
from speccompile.errors import SpecCompileError

SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def load_tokenizer(path: Path, required: bool = True):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), use_fast=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a missing/broken tokenizer
        if not required:
            return None
        raise SpecCompileError(f"{path}: cannot load a tokenizer ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def check_compatible(target: ModelSpec, draft: ModelSpec, target_tok, draft_tok) -> int:
    """Refuse a pair whose token ids mean different things; returns the shared vocabulary size.

    Embedding matrices may be padded differently (Qwen2.5 0.5B has 151936 rows, 7B 152064) as long
    as both cover every id the tokenizer can produce: logits are cut to the smaller matrix.
    """
    if draft_tok is not None:
        _compare_vocab(target_tok, draft_tok)
    vocab_out = min(target.hp["vocab_size"], draft.hp["vocab_size"])
    if len(target_tok) > vocab_out:
        which = "draft" if draft.hp["vocab_size"] < target.hp["vocab_size"] else "target"
        raise SpecCompileError(f"tokenizer has {len(target_tok)} tokens but the {which} model embeds only {vocab_out}")
    return vocab_out


def _compare_vocab(target_tok, draft_tok) -> None:
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab != draft_vocab:
        only_target = sorted(set(target_vocab) - set(draft_vocab), key=target_vocab.get)
        only_draft = sorted(set(draft_vocab) - set(target_vocab), key=draft_vocab.get)
        moved = [t for t in target_vocab if t in draft_vocab and target_vocab[t] != draft_vocab[t]]
        details = [f"{len(target_vocab)} vs {len(draft_vocab)} tokens"]
        if only_target:
            details.append(f"{len(only_target)} only in target (first {only_target[0]!r})")
        if only_draft:
            details.append(f"{len(only_draft)} only in draft (first {only_draft[0]!r})")
        if moved:
            details.append(f"{len(moved)} with different ids (first {moved[0]!r}: {target_vocab[moved[0]]} vs {draft_vocab[moved[0]]})")
        raise SpecCompileError("draft and target tokenizers differ: " + "; ".join(details))
    for name in SPECIAL_TOKENS:
        t, d = getattr(target_tok, name, None), getattr(draft_tok, name, None)
        if t != d:
            raise SpecCompileError(f"draft and target tokenizers differ: {name} is {t} in target, {d} in draft")


def eos_token_ids(spec: ModelSpec, tokenizer) -> list[int]:
    """EOS ids as HF generate would use them: generation_config.json, then config.json, then tokenizer."""
    for source in (spec.path / "generation_config.json",):
        if source.is_file():
            value = json.loads(source.read_text()).get("eos_token_id")
            if value is not None:
                return sorted(set(value if isinstance(value, list) else [value]))
    value = spec.config.get("eos_token_id")
    if value is None:
        value = tokenizer.eos_token_id
    if value is None:
        return []
    return sorted(set(value if isinstance(value, list) else [value]))


def save_tokenizer(tokenizer, directory: Path) -> None:
    """Save HF tokenizer files plus tokenizer.json, which the runtime reads with `tokenizers`."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(directory))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise SpecCompileError("the target's tokenizer has no fast (tokenizers) version; the runtime needs tokenizer.json")
    backend.save(str(directory / "tokenizer.json"))
