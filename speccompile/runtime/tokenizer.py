"""The bundle's tokenizer, through the `tokenizers` library alone (no transformers at run time)."""

from pathlib import Path

from speccompile.errors import SpecCompileError


class Tokenizer:
    def __init__(self, directory: Path, info: dict):
        from tokenizers import Tokenizer as _Tokenizer

        self._tok = _Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
        self.eos_token_ids = set(info.get("eos_token_ids", []))

    def encode(self, text: str) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=True).ids
        if not ids:
            raise SpecCompileError(f"prompt {text!r} encodes to no tokens")
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decode_continuation(self, prompt_ids: list[int], ids: list[int], prompt_text: str | None = None) -> str:
        """The text `ids` add after `prompt_ids`. Decoded after the prompt's tokens, not alone: a
        SentencePiece decoder drops the leading space of a text's first word, which is no first word
        here (HF pipelines cut the prompt's text off the whole decoded sequence the same way)."""
        prompt_text = self.decode(prompt_ids) if prompt_text is None else prompt_text
        return self.decode(prompt_ids + ids)[len(prompt_text):]
