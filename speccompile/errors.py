"""The one exception type for user errors.

Anything the user can fix (a bad path, an unsupported model, a corrupt bundle, an option out of
range) raises `SpecCompileError` with one line that says what is wrong and, where it helps, what to
do. The CLI prints that line and exits 1. Bugs are assertions, not this.
"""


class SpecCompileError(Exception):
    """A user-facing error: its message is printed as one line by the CLI."""


def read_json_object(path) -> dict:
    """A JSON object from a user-supplied file, or a SpecCompileError saying what is wrong with it."""
    import json

    try:
        value = json.loads(open(path, encoding="utf-8").read())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecCompileError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise SpecCompileError(f"{path}: expected a JSON object")
    return value


MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format's own limit on its JSON header


def read_safetensors_header(path) -> tuple[dict, int]:
    """A safetensors file's header (8 bytes of length, then JSON: each tensor's dtype, shape and byte
    range) and where the tensors' bytes begin, or a SpecCompileError saying what is wrong with it."""
    import json
    import struct

    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > MAX_SAFETENSORS_HEADER:
                raise ValueError(f"header of {length} bytes")
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError, UnicodeDecodeError) as e:
        raise SpecCompileError(f"{path}: cannot read safetensors file ({e})") from None
    if not isinstance(header, dict):
        raise SpecCompileError(f"{path}: cannot read safetensors file (header is not a JSON object)")
    return header, 8 + length
