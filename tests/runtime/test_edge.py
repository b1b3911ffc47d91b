"""The runtime's edge: stop strings matched on each delivery's new text, tokens after a stop never
delivered, the request told where to stop; the engine's emission time for measurements."""

import time

import pytest

from speccompile.core.request import Request
from speccompile.runtime.edge import Edge, StopWatcher, emitted_at
from tests.runtime.test_tokenizer import byte_level_bpe

TEXT = "def héllo():\n    return '世界 🎉'\n\ndef main():\n    pass\n"


def fed(watcher: StopWatcher, ids: list[int], step: int) -> int | None:
    """Feed `ids` `step` at a time, as iterations would; the number of ids kept at the stop, if any."""
    for start in range(0, len(ids), step):
        keep = watcher.feed(ids[start : start + step])
        if keep is not None:
            return start + keep
    return None


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize("stop", ["\n\n", "世界", "main", "🎉'", ":\n    pass"])
def test_a_stop_string_is_found_by_the_token_that_completes_it_however_the_tokens_come(tmp_path, stop, step):
    tokenizer = byte_level_bpe(tmp_path)
    ids = tokenizer.encode(TEXT)
    prompt, continuation = ids[:2], ids[2:]
    keep = fed(StopWatcher(tokenizer, prompt, [stop, "never there"]), continuation, step)
    completes = next(k for k in range(1, len(continuation) + 1)
                     if stop in tokenizer.decode_continuation(prompt, continuation[:k]))
    assert keep == completes


def test_no_stop_string_no_cut(tmp_path):
    tokenizer = byte_level_bpe(tmp_path)
    ids = tokenizer.encode(TEXT)
    assert fed(StopWatcher(tokenizer, ids[:2], ["class ", "xyz"]), ids[2:], 4) is None


class Sink:
    def __init__(self):
        self.tokens, self.finished, self.times = [], False, []

    def _push(self, tokens):
        self.tokens += tokens
        self.times.append(emitted_at())

    def _finished(self, request):
        self.finished = True


def test_the_edge_delivers_up_to_the_stop_and_tells_the_request(tmp_path):
    tokenizer = byte_level_bpe(tmp_path)
    ids = tokenizer.encode(TEXT)
    prompt, continuation = ids[:2], ids[2:]
    edge, sink = Edge(), Sink()
    request = Request(prompt, 100, gamma=0)
    edge.attach(request, sink, StopWatcher(tokenizer, prompt, ["\n\n"]))
    before = time.perf_counter()
    for start in range(0, len(continuation), 5):  # what the engine does: emit, then finish
        request.on_tokens(continuation[start : start + 5])
    request.on_finish(request)
    edge.close()
    completes = next(k for k in range(1, len(continuation) + 1)
                     if "\n\n" in tokenizer.decode_continuation(prompt, continuation[:k]))
    assert sink.tokens == continuation[:completes] and sink.finished
    assert request.stop_keep == completes
    assert all(before <= t <= time.perf_counter() for t in sink.times)  # when the engine emitted them


def test_without_stop_strings_the_engine_hands_tokens_over_itself():
    edge, sink = Edge(), Sink()
    request = Request([1, 2], 10, gamma=0)
    edge.attach(request, sink)
    request.on_tokens([3, 4])
    assert sink.tokens == [3, 4]  # at once, on this thread
    request.on_finish(request)
    assert sink.finished
    edge.close()
