"""What a caller holds and what serves it: the handles of queued requests (results, streams,
cancellation; their tokens arrive through the runtime's edge, edge.py) and the engine thread that
runs the scheduler's iterations.
"""

import logging
import queue
import threading
from collections import deque
from typing import TYPE_CHECKING

from speccompile.core.request import Request
from speccompile.core.scheduler import Scheduler
from speccompile.errors import SpecCompileError
from speccompile.runtime.output import Delta, OutputProcessor

if TYPE_CHECKING:  # imported where used: asyncio adds 50 ms to every start, and only async callers need it
    import asyncio

log = logging.getLogger("speccompile")


class _Handle:
    """What both handles do with their request."""

    request: Request

    def cancel(self) -> None:
        """End the request; its slot is freed at the engine's next iteration."""
        self.request.cancelled = True
        self._runtime._engine and self._runtime._engine.wake()

    def _raise_its_error(self) -> None:
        if self.request.error is not None:
            raise self.request.error


class RequestHandle(_Handle):
    """A queued request: `.result()` waits for it, `.stream()` yields its tokens as they are
    accepted, `.deltas()` what its output processor makes of them, `.cancel()` ends it (its slot is
    freed at the engine's next iteration)."""

    def __init__(self, request: Request, runtime, output: OutputProcessor):
        self.request, self._runtime, self.output, self.prompt = request, runtime, output, output.prompt
        self._done = threading.Event()
        self._deltas: queue.Queue | None = None
        self._delivered: list[Delta] = []  # what the edge handed over before anyone asked
        self._lock = threading.Lock()  # between the thread delivering and a first `deltas` call
        self._user_sink = request.on_tokens  # the edge calls _push and _finished (edge.py)

    def result(self, timeout: float | None = None):
        if not self._done.wait(timeout):
            raise TimeoutError(f"request not finished after {timeout} s")
        self._raise_its_error()
        return self.output.result()

    def stream(self):
        """Lists of newly accepted token ids, until the request ends. Tokens accepted before the first
        call are yielded first. One consumer."""
        for delta in self.deltas():
            if delta.token_ids:
                yield delta.token_ids

    def deltas(self):
        """What each delivery adds (output.Delta: token ids, and their text and log-probabilities
        where the request follows them: submit(..., stream_text=True)), until the request ends.
        Deliveries before the first call come first. One consumer."""
        with self._lock:
            if self._deltas is None:
                self._deltas = queue.Queue()
                for delta in self._delivered:
                    self._deltas.put(delta)
                if self._done.is_set():
                    self._deltas.put(None)
        while (delta := self._deltas.get()) is not None:
            yield delta
        self._raise_its_error()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _push(self, delta: Delta) -> None:
        if self._user_sink is not None:
            self._user_sink(delta.token_ids)
        with self._lock:
            if self._deltas is not None:
                self._deltas.put(delta)
            else:
                self._delivered.append(delta)

    def _finished(self, request: Request) -> None:
        with self._lock:
            if self._deltas is not None:
                self._deltas.put(None)
            self._done.set()


class AsyncRequestHandle(_Handle):
    """The asyncio counterpart of RequestHandle: results and tokens are handed to the event loop."""

    def __init__(self, loop: "asyncio.AbstractEventLoop", runtime, output: OutputProcessor, on_tokens=None,
                 on_finish=None):
        import asyncio

        self._loop, self._runtime, self.output, self.prompt = loop, runtime, output, output.prompt
        self.request = output.request
        self._deltas: asyncio.Queue = asyncio.Queue()
        self._done = loop.create_future()
        self.user_sink, self.user_finish = on_tokens, on_finish

    @property
    def done(self) -> bool:
        return self._done.done()

    async def result(self):
        import asyncio

        await asyncio.shield(self._done)
        self._raise_its_error()
        return self.output.result()

    async def stream(self):
        """Lists of newly accepted token ids, until the request ends."""
        async for delta in self.deltas():
            yield delta.token_ids

    async def deltas(self):
        """What each delivery adds (output.Delta: token ids, and their text and log-probabilities
        where the request follows them), until the request ends."""
        while True:
            delta = await self._deltas.get()
            if delta is None:
                break
            yield delta
        self._raise_its_error()


    def _push(self, delta: Delta) -> None:  # the engine or the edge thread
        if self.user_sink is not None:
            self.user_sink(delta.token_ids)
        self._loop.call_soon_threadsafe(self._deltas.put_nowait, delta)

    def _finished(self, request: Request) -> None:  # the engine or the edge thread
        if self.user_finish is not None:
            self.user_finish(request)
        self._loop.call_soon_threadsafe(self._deltas.put_nowait, None)
        self._loop.call_soon_threadsafe(lambda: self._done.done() or self._done.set_result(None))


class EngineThread:
    """Runs scheduler iterations on one thread while there is work; sleeps otherwise. Submissions
    land in an inbox that the thread moves into the scheduler between iterations, so the scheduler
    itself is only ever touched by this thread."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.failures_in_a_row = 0  # iterations that raised since the last that did not (health)
        self.last_error: Exception | None = None
        self._inbox: deque[Request] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="speccompile-engine", daemon=True)
        self._thread.start()

    def submit(self, request: Request) -> None:
        with self._wake:
            if self._closed:
                raise SpecCompileError("this runtime is closed")
            self._inbox.append(request)
            self._wake.notify()

    def wake(self) -> None:
        with self._wake:
            self._wake.notify()

    def close(self, timeout: float = 30.0) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._inbox and self.scheduler.idle and not self._closed:
                    self._wake.wait()
                if self._closed:
                    break
                while self._inbox:
                    self.scheduler.add(self._inbox.popleft())
            try:
                self.scheduler.step()
                self.failures_in_a_row = 0
            except Exception as error:  # a backend failure ends the requests it touched, not the engine
                log.exception("engine iteration failed")
                self.failures_in_a_row += 1
                self.last_error = error
                self.scheduler.fail_in_flight(error)
        self.scheduler.cancel_all()
        while self._inbox:
            self._inbox.popleft().finish("cancelled")
