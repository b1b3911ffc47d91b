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
