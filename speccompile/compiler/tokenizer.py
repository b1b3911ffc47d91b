"""Tokenizer export and the draft/target compatibility gate."""

import json
from pathlib import Path

from speccompile.compiler.checkpoint import ModelSpec
from speccompile.errors import SpecCompileError

# What decides which ids a text becomes, as sections of tokenizer.json. The vocabulary (the model's
# plus added tokens) is compared on its own, to say which tokens differ.
IDENTITY_SECTIONS = ("model", "normalizer", "pre_tokenizer")
# Special tokens that generation uses: BOS starts a prompt, EOS ends generation. A pad token (or unk,
# which is part of the model section) only fills batches and never reaches a model: not compared.
SPECIAL_TOKENS = ("bos_token", "eos_token")


def load_tokenizer(path: Path, required: bool = True):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), use_fast=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 (transformers raises many types for a missing/broken tokenizer)
        if not required:
            return None
        first_line = str(e).splitlines()[0] if str(e) else ""
        raise SpecCompileError(f"{path}: cannot load a tokenizer ({type(e).__name__}: {first_line})") from None


def check_compatible(target: ModelSpec, draft: ModelSpec, target_tok, draft_tok) -> int:
    """Refuse a pair whose token ids mean different things; returns the shared vocabulary size.

    Compared: what decides which ids a text becomes (vocabulary, merges and model settings,
    normalizer, pre-tokenizer) and the special tokens generation uses (BOS, EOS). Not compared: the
    pad token, decoders and post-processors; the runtime tokenizes and detokenizes with the
    target's tokenizer alone, and the draft only ever sees ids.

    Embedding matrices may be padded differently (Qwen2.5 0.5B has 151936 rows, 7B 152064) as long
    as both cover every id the tokenizer can produce: logits are cut to the smaller matrix.
    """
    if draft_tok is not None:
        _compare_identity(_identity(target.files, target_tok), _identity(draft.files, draft_tok))
        _compare_special_tokens(target_tok, draft_tok)
    vocab_out = min(target.hp["vocab_size"], draft.hp["vocab_size"])
    if len(target_tok) > vocab_out:
        which = "draft" if draft.hp["vocab_size"] < target.hp["vocab_size"] else "target"
        raise SpecCompileError(f"tokenizer has {len(target_tok)} tokens but the {which} model embeds only {vocab_out}")
    return vocab_out


def _identity(path: Path, tokenizer):
    """The tokenizer as its checkpoint's tokenizer.json defines it. Loading through transformers can
    add a model class's default special tokens that the file does not have (in transformers 5, a
    Qwen2 checkpoint gains '<|endoftext|>' as its unk token), so the file is read when there is one."""
    from tokenizers import Tokenizer

    file = path / "tokenizer.json"
    return Tokenizer.from_file(str(file)) if file.is_file() else tokenizer.backend_tokenizer


def _compare_identity(target, draft) -> None:
    target_vocab, draft_vocab = target.get_vocab(with_added_tokens=True), draft.get_vocab(with_added_tokens=True)
    if target_vocab != draft_vocab:
        raise SpecCompileError("draft and target tokenizers differ: " + _vocab_difference(target_vocab, draft_vocab))
    # Re-serialised by one `tokenizers` version, so that files saved by different versions compare equal.
    target_json, draft_json = json.loads(target.to_str()), json.loads(draft.to_str())
    for section in IDENTITY_SECTIONS:
        if _canonical(section, target_json.get(section)) != _canonical(section, draft_json.get(section)):
            what = "merges or model settings" if section == "model" else section.replace("_", "-")
            raise SpecCompileError(f"draft and target tokenizers differ: same vocabulary, but different {what} "
                                   f"(tokenizer.json '{section}'), so one text becomes different ids")


def _canonical(section: str, value):
    """A section as it decides ids: the model's vocabulary is compared above (a token may sit in the
    model's vocabulary in one file and among the added tokens in another, as a GGUF's converted
    tokenizer has it), and an empty subword prefix or suffix is no prefix or suffix."""
    if section != "model" or not isinstance(value, dict):
        return value
    value = {key: item for key, item in value.items() if key != "vocab"}
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        value[key] = value.get(key) or None
    return value


def _vocab_difference(target_vocab: dict, draft_vocab: dict) -> str:
    only_target = sorted(set(target_vocab) - set(draft_vocab), key=target_vocab.get)
    only_draft = sorted(set(draft_vocab) - set(target_vocab), key=draft_vocab.get)
    moved = [t for t in target_vocab if t in draft_vocab and target_vocab[t] != draft_vocab[t]]
    details = [f"{len(target_vocab)} vs {len(draft_vocab)} tokens"]
    if only_target:
        details.append(f"{len(only_target)} only in target (first {only_target[0]!r})")
    if only_draft:
        details.append(f"{len(only_draft)} only in draft (first {only_draft[0]!r})")
    if moved:
        first = moved[0]
        details.append(f"{len(moved)} with different ids "
                       f"(first {first!r}: {target_vocab[first]} vs {draft_vocab[first]})")
    return "; ".join(details)


def _compare_special_tokens(target_tok, draft_tok) -> None:
    """BOS and EOS where both tokenizers name one; a tokenizer that names none leaves it to the other."""
    for name in SPECIAL_TOKENS:
        t, d = getattr(target_tok, name, None), getattr(draft_tok, name, None)
        if t is not None and d is not None and t != d:
            raise SpecCompileError(f"draft and target tokenizers differ: {name} is {t!r} in target, {d!r} in draft")


def eos_token_ids(spec: ModelSpec, tokenizer) -> list[int]:
    """EOS ids as HF generate would use them: generation_config.json, then config.json, then tokenizer."""
    for source in (spec.files / "generation_config.json",):
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
        raise SpecCompileError("the target's tokenizer has no fast (tokenizers) version; "
                               "the runtime needs tokenizer.json")
    backend.save(str(directory / "tokenizer.json"))
