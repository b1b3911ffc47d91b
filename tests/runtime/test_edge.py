"""The runtime's edge and a request's output processor: stop strings matched on each delivery's new
text, tokens after a stop never delivered, the request told where to stop, text delivered only where no
stop string can cut it; the engine's emission time for measurements."""

import time

import pytest

from speccompile.core.params import GenerationParams
from speccompile.core.request import Request
from speccompile.runtime.edge import Edge, emitted_at
from speccompile.runtime.output import OutputProcessor
from tests.runtime.test_tokenizer import byte_level_bpe

TEXT = "def héllo():\n    return '世界 🎉'\n\ndef main():\n    pass\n"


def watcher(tokenizer, prompt: list[int], stops: list[str]) -> OutputProcessor:
    request = Request(prompt, 100, gamma=0, spec=GenerationParams(stop=stops))
    return OutputProcessor(tokenizer, request, prompt)


def fed(output: OutputProcessor, ids: list[int], step: int) -> int | None:
    """Feed `ids` `step` at a time, as iterations would; the number of ids kept at the stop, if any."""
    for start in range(0, len(ids), step):
        delta = output.add(ids[start : start + step])
        if output.stopped:
            return start + len(delta.token_ids)
    return None


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize("stop", ["\n\n", "世界", "main", "🎉'", ":\n    pass"])
def test_a_stop_string_is_found_by_the_token_that_completes_it_however_the_tokens_come(tmp_path, stop, step):
    tokenizer = byte_level_bpe(tmp_path)
    ids = tokenizer.encode(TEXT)
    prompt, continuation = ids[:2], ids[2:]
    keep = fed(watcher(tokenizer, prompt, [stop, "never there"]), continuation, step)
    completes = next(k for k in range(1, len(continuation) + 1)
                     if stop in tokenizer.decode_continuation(prompt, continuation[:k]))
    assert keep == completes


def test_no_stop_string_no_cut(tmp_path):
    tokenizer = byte_level_bpe(tmp_path)
    ids = tokenizer.encode(TEXT)
    assert fed(watcher(tokenizer, ids[:2], ["class ", "xyz"]), ids[2:], 4) is None


class Sink:
    def __init__(self):
        self.tokens, self.finished, self.times = [], False, []

    def _push(self, delta):
        self.tokens += delta.token_ids
        self.times.append(emitted_at())

    def _finished(self, request):
        self.finished = True


def test_the_edge_delivers_up_to_the_stop_and_tells_the_request(tmp_path):
    tokenizer = byte_level_bpe(tmp_path)
    ids = tokenizer.encode(TEXT)
    prompt, continuation = ids[:2], ids[2:]
    edge, sink = Edge(), Sink()
    output = watcher(tokenizer, prompt, ["\n\n"])
    request = output.request
    edge.attach(request, sink, output)
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
    edge.attach(request, sink, OutputProcessor(None, request, [1, 2]))
    request.on_tokens([3, 4])
    assert sink.tokens == [3, 4]  # at once, on this thread
    request.on_finish(request)
    assert sink.finished
    edge.close()


@pytest.mark.parametrize("step", [1, 3])
def test_deltas_add_up_to_the_final_text_and_never_show_what_a_stop_string_cuts(tmp_path, step):
    """Streamed text is held back while it could begin a stop string: the deltas are the final text."""
    tokenizer = byte_level_bpe(tmp_path)
    ids = tokenizer.encode(TEXT)
    prompt, continuation = ids[:2], ids[2:]
    output = watcher(tokenizer, prompt, [":\n    pass"])
    texts = []
    for start in range(0, len(continuation), step):
        delta = output.add(continuation[start : start + step])
        output.request.generated += delta.token_ids
        texts.append(delta.text)
    output.request.stop_at(output.delivered)
    output.request.finish("stop")
    final = output.result()
    assert "".join(texts) == final.text == tokenizer.decode_continuation(prompt, continuation).split(":\n    pass")[0]
    assert final.finish_reason == "stop" and final.token_ids == continuation[: output.delivered]
