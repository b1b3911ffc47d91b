"""The runtime's output side: tokens leave the engine here.

For a request whose text is followed as it comes (stop strings, or a client streaming text), the
engine thread only appends its newly accepted tokens to a queue; the edge thread feeds them to the
request's output processor (output.py) and delivers what it makes of them to the request's handle
(and its user's callback). When a stop string completes, the tokens after the one completing it are
never delivered, and the request is told to stop (`Request.stop_at`): the engine retires it at its
next iteration. So no iteration waits on detokenizing. A request whose text nobody follows has
nothing to decode: its tokens go to its handle from the engine thread.
"""

import logging
import queue
import threading
import time

from speccompile.runtime.output import Delta, OutputProcessor

log = logging.getLogger("speccompile")
_delivering = threading.local()  # what the edge thread is delivering now (`emitted_at`)


def emitted_at() -> float:
    """In an on_tokens callback: when the engine emitted the tokens being delivered
    (time.perf_counter()), which for a request with stop strings is earlier than the callback by
    however long the edge thread took to reach them (on the engine thread: now). What a measurement
    of iteration times needs (runtime/profile.py)."""
    return getattr(_delivering, "emitted", None) or time.perf_counter()


class Edge:
    """One thread per runtime that hands each request's tokens and its end to its sink (a handle:
    `_push(tokens)`, `_finished(request)`), in the order the engine produced them."""

    def __init__(self):
        self._items: queue.SimpleQueue = queue.SimpleQueue()  # put without a Python-level lock: the engine's side
        self._thread = threading.Thread(target=self._run, name="speccompile-edge", daemon=True)
        self._thread.start()

    def attach(self, request, sink, output: OutputProcessor) -> None:
        """Route the request's tokens and its end to `sink` (`_push(Delta)`, `_finished(request)`):
        through the edge thread when its output processor follows the text, else straight from the
        engine thread, which then only hands them over (a second Python thread costs the engine its
        GIL while it delivers: on the demo pair at batch 8, 0.97 against 1.20 ms of loop work an
        iteration, medians of 5 interleaved runs)."""
        if not output.follows_text:  # a fresh list from the engine (Request.emit), delivered as it is emitted
            push = sink._push
            request.on_tokens, request.on_finish = (lambda tokens: push(Delta(tokens))), sink._finished
            return
        put, clock = self._items.put, time.perf_counter
        request.on_tokens = lambda tokens: put((request, sink, output, list(tokens), clock()))
        request.on_finish = lambda finished: put((request, sink, output, None, clock()))

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
    def _deliver(request, sink, output: OutputProcessor, tokens: list[int] | None, emitted: float) -> None:
        _delivering.emitted = emitted
        if tokens is None:
            sink._finished(request)
            return
        if output.stopped:
            return
        delta = output.add(tokens)
        if output.stopped:
            request.stop_at(output.delivered)
        if delta.token_ids or delta.text:
            sink._push(delta)
