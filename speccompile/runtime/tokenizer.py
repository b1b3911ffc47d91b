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
