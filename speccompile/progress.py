"""Long work reports through `logging`, and shows progress one way.

Modules log to `logging.getLogger(__name__)`, children of the "speccompile" logger; none prints.
The CLI shows that logger's lines on stderr as plain text; a program that uses the library sees
what it configures (Python's default: warnings only).

`Progress` is the one display for work in numbered steps (build phases, TensorRT engines,
distillation steps): "[3/6] export graphs (4.1 s so far)".
"""

import logging
import time


class Progress:
    """Numbered steps out of `total`, each an INFO line on `logger` with the time since the work began."""

    def __init__(self, total: int, logger: logging.Logger):
        self.total, self.logger, self.done = total, logger, 0
        self.started = time.perf_counter()

    def step(self, what: str, done: int | None = None) -> None:
        """Report step `done` (default: the one after the last reported) as begun or reached."""
        self.done = self.done + 1 if done is None else done
        elapsed = time.perf_counter() - self.started
        self.logger.info(f"[{self.done}/{self.total}] {what} ({elapsed:.1f} s so far)")
