"""The one exception type for user errors.

Anything the user can fix (a bad path, an unsupported model, a corrupt bundle, an option out of
range) raises `SpecCompileError` with one line that says what is wrong and, where it helps, what to
do. The CLI prints that line and exits 1. Bugs are assertions, not this.
"""


class SpecCompileError(Exception):
    """A user-facing error: its message is printed as one line by the CLI."""
