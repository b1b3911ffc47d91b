"""The bundle's tokenizer, through the `tokenizers` library alone (no transformers at run time)."""

from pathlib import Path

from speccompile.errors import SpecCompileError

# the special tokens a chat template sees by name, as transformers passes them (its special_tokens_map)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    def __init__(self, directory: Path, info: dict):
        from tokenizers import Tokenizer as _Tokenizer

        self.directory = Path(directory)
        self._tok = _Tokenizer.from_file(str(self.directory / "tokenizer.json"))
        self.eos_token_ids = set(info.get("eos_token_ids", []))

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """special_tokens=False for text that writes its own (a rendered chat template)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate (JSON can carry one): no tokenizer takes it
            raise SpecCompileError(f"the text is not valid Unicode: {e.reason} at position {e.start}") from None
        ids = self._tok.encode(text, add_special_tokens=special_tokens).ids
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

    def chat_template(self) -> str | None:
        """The checkpoint's chat template as saved with its tokenizer (chat_template.jinja, or the
        "chat_template" of tokenizer_config.json); None when there is none."""
        template_file = self.directory / "chat_template.jinja"
        template = template_file.read_text() if template_file.is_file() else self._config().get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return template or None

    def special_tokens(self) -> dict[str, str]:
        """The special tokens a chat template may name (bos_token, eos_token, ...), as their text."""
        return {name: (value["content"] if isinstance(value, dict) else value)
                for name in SPECIAL_TOKENS if (value := self._config().get(name))}

    def _config(self) -> dict:
        import json

        config_file = self.directory / "tokenizer_config.json"
        return json.loads(config_file.read_text()) if config_file.is_file() else {}

    def token_texts(self, ids) -> list[str]:
        """Each token's text alone, special tokens included (how OpenAI's logprobs name tokens). A token
        that is part of a UTF-8 character is named by its bytes, as vLLM names it ("bytes:\\xe2\\x80"),
        so that two such tokens never share a name."""
        texts = []
        for token in map(int, ids):
            text = self._tok.decode([token], skip_special_tokens=False)
            if "\ufffd" in text and (raw := self._token_bytes(token)) is not None:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            texts.append(text)
        return texts

    def _token_bytes(self, token: int) -> bytes | None:
        """A byte-level BPE piece's bytes (GPT-2's printable alphabet), or a SentencePiece byte-fallback
        piece's (<0xE2>); None for anything else."""
        piece = self._tok.id_to_token(token) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        decoder = _byte_decoder()
        return bytes(decoder[c] for c in piece) if piece and all(c in decoder for c in piece) else None

    def stream(self, prompt_ids: list[int]) -> "TextStream":
        """An incremental decode_continuation, for printing tokens as they come."""
        return TextStream(self._tok, prompt_ids)


class TextStream:
    """The text that each next batch of a continuation's tokens adds, in time for those tokens alone
    (tokenizers' DecodeStream re-decodes a few tokens of context, not the whole text each time).

    A token that ends inside a UTF-8 character (byte-level BPE splits them) adds "" until the
    character is whole. The pieces joined are decode_continuation's text, except that an
    unfinished character at the very end is still held back."""

    def __init__(self, tokenizer, prompt_ids: list[int]):
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=True)

    def add(self, ids: list[int]) -> str:
        if not len(ids):
            return ""
        return self._stream.step(self._tok, [int(i) for i in ids]) or ""  # None: a character is unfinished


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character each byte is written as -> the byte."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        codes, extra = list(printable), 0
        for byte in range(256):
            if byte not in printable:
                printable.append(byte)
                codes.append(256 + extra)
                extra += 1
        _BYTE_DECODER = {chr(code): byte for byte, code in zip(printable, codes)}
    return _BYTE_DECODER


_BYTE_DECODER = None
