"""The runtime's output side: tokens leave the engine here, and text is made of them.

For a request with stop strings, the engine thread only appends its newly accepted tokens to a
queue; the edge thread decodes them incrementally, checks the stop strings on the new text alone
(with the few characters before it that a stop string could begin in) and delivers them to the
request's handle (and its user's callback). When one completes, the tokens after the one completing
it are never delivered, and the request is told to stop (`Request.stop_at`): the engine retires it at
its next iteration. So no iteration waits on detokenizing, and the cost per iteration does not grow
with the output's length (vLLM's output processor does the same). A request without stop strings
has nothing to decode: its tokens go to its handle from the engine thread.
"""

import logging
import queue
import threading
import time

log = logging.getLogger("speccompile")
_delivering = threading.local()  # what the edge thread is delivering now (`emitted_at`)


def emitted_at() -> float:
    """In an on_tokens callback: when the engine emitted the tokens being delivered
    (time.perf_counter()), which for a request with stop strings is earlier than the callback by
    however long the edge thread took to reach them (on the engine thread: now). What a measurement
    of iteration times needs (runtime/profile.py)."""
    return getattr(_delivering, "emitted", None) or time.perf_counter()


class StopWatcher:
    """A request's stop strings over its continuation, fed token by token."""

    def __init__(self, tokenizer, prompt: list[int], stops: list[str]):
        self.text = tokenizer.stream(prompt)
        self.stops = stops
        self.reach = max(len(s) for s in stops) - 1  # characters a stop string may reach back
        self.tail = ""  # the last `reach` characters decoded
        self.delivered = 0  # tokens passed on so far
        self.stopped = False

    def feed(self, tokens: list[int]) -> int | None:
        """How many of `tokens` to keep when one of them completes a stop string (it is kept; the
        text is cut before the stop string), else None."""
        for i, token in enumerate(tokens):
            piece = self.text.add([token])
            if not piece:
                continue
            window = self.tail + piece
            if any(stop in window for stop in self.stops):
                return i + 1
            self.tail = window[-self.reach :] if self.reach else ""
        return None


class Edge:
    """One thread per runtime that hands each request's tokens and its end to its sink (a handle:
    `_push(tokens)`, `_finished(request)`), in the order the engine produced them."""

    def __init__(self):
        self._items: queue.SimpleQueue = queue.SimpleQueue()  # put without a Python-level lock: the engine's side
        self._thread = threading.Thread(target=self._run, name="speccompile-edge", daemon=True)
        self._thread.start()

    def attach(self, request, sink, watcher: StopWatcher | None = None) -> None:
        """Route the request's tokens and its end to `sink`: through the edge thread when it has stop
        strings to match (`watcher`), else straight from the engine thread, which then only hands
        them over (a second Python thread costs the engine its GIL while it delivers: on the demo pair
        at batch 8, 0.97 against 1.20 ms of loop work an iteration, medians of 5 interleaved runs)."""
        if watcher is None:  # a fresh list from the engine (Request.emit), delivered as it is emitted
            request.on_tokens, request.on_finish = sink._push, sink._finished
            return
        put, clock = self._items.put, time.perf_counter
        request.on_tokens = lambda tokens: put((request, sink, watcher, list(tokens), clock()))
        request.on_finish = lambda finished: put((request, sink, watcher, None, clock()))

    def close(self, timeout: float = 30.0) -> None:
        """Deliver what is queued, then stop."""
        self._items.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while (item := self._items.get()) is not None:
            try:
                self._deliver(*item)
            except Exception:  # a user's callback failed: the other requests go on
                log.exception("delivering a request's tokens failed")

    @staticmethod
    def _deliver(request, sink, watcher: StopWatcher | None, tokens: list[int] | None, emitted: float) -> None:
        _delivering.emitted = emitted
        if tokens is None:
            sink._finished(request)
            return
        if watcher is not None:
            if watcher.stopped:
                return
            keep = watcher.feed(tokens)
            if keep is not None:
                watcher.stopped = True
                tokens = tokens[:keep]
                request.stop_at(watcher.delivered + keep)
            watcher.delivered += len(tokens)
        if tokens:
            sink._push(tokens)
