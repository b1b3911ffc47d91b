"""A request's output, in one place: its text decoded incrementally, its stop strings, the
log-probabilities of what it delivered, and its final result.

Each queued request has one `OutputProcessor`. A request whose text must be followed as it comes (it
has stop strings, or a client streams its text) is fed on the runtime's edge thread (edge.py): each
iteration's new tokens are decoded alone (tokenizers' incremental decoder), the stop strings are
looked for in that text with the few characters before it that one could begin in, and the text is
delivered only where no stop string can cut it any more, so a stream's deltas add up to the final
text. The cost per iteration does not grow with the output's length (vLLM's output processor and
incremental detokenizer do the same). A request whose text nobody follows is decoded once, at the end.
"""

from dataclasses import dataclass

from speccompile.core.request import Request
from speccompile.core.stats import GenerationStats


@dataclass
class GenerationResult:
    prompt: str | list[int]
    token_ids: list[int]  # generated tokens only (EOS or a stop token included when generated)
    text: str  # their text, ending before a stop string (as OpenAI's)
    stats: GenerationStats
    finish_reason: str = "length"  # "stop" (EOS, stop token or string), "length", "cancelled"
    # when asked: per generated token, and per prompt token after the first, (log-probability, the
    # top token ids, their log-probabilities)
    logprobs: list | None = None
    prompt_logprobs: list | None = None

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "text": self.text, "token_ids": self.token_ids,
                "finish_reason": self.finish_reason, "stats": self.stats.to_dict()}


@dataclass(frozen=True)
class Delta:
    """What one delivery adds: token ids, their text (None where the text is not followed as it comes)
    and their log-probabilities (None where none were asked for)."""

    token_ids: list[int]
    text: str | None = None
    logprobs: list | None = None


class OutputProcessor:
    def __init__(self, tokenizer, request: Request, prompt, follow_text: bool = False):
        """prompt: as the caller gave it (the result repeats it). follow_text: decode as tokens come
        (always, with stop strings)."""
        self.tokenizer, self.request, self.prompt = tokenizer, request, prompt
        self.stops = request.spec.stop if request.spec is not None else ()
        self.follows_text = follow_text or bool(self.stops)
        self.reach = max((len(s) for s in self.stops), default=1) - 1  # characters a stop string may reach back
        self._stream = None
        self.decoded = ""  # the continuation's text so far (through a stop string, once one is found)
        self.sent = 0  # characters of it delivered
        self.delivered = 0  # tokens delivered
        self.stop_index: int | None = None  # where the text ends: a stop string's start

    @property
    def stopped(self) -> bool:
        return self.stop_index is not None

    def add(self, tokens: list[int]) -> Delta:
        """Newly accepted tokens -> what a consumer gets: the tokens up to the one completing a stop
        string (none after it), the text no stop string can cut any more, their log-probabilities."""
        if self.stopped:
            return Delta([], "" if self.follows_text else None, None)
        text = None
        if self.follows_text:
            tokens = self._decode(tokens)
            end = self.stop_index if self.stopped else max(self.sent, len(self.decoded) - held_back(self.decoded,
                                                                                                    self.stops))
            text, self.sent = self.decoded[self.sent : end], end
        logprobs = None
        if self.request.logprobs is not None:
            logprobs = self.request.token_logprobs[self.delivered : self.delivered + len(tokens)]
        self.delivered += len(tokens)
        return Delta(list(tokens), text, logprobs)

    def _decode(self, tokens: list[int]) -> list[int]:
        """Decode `tokens` one by one until one completes a stop string; the tokens kept."""
        if self._stream is None:
            self._stream = self.tokenizer.stream(self.request.prompt)
        for i, token in enumerate(tokens):
            start = max(0, len(self.decoded) - self.reach)
            piece = self._stream.add([token])
            if not piece:
                continue
            self.decoded += piece
            found = [at for at in (self.decoded.find(stop, start) for stop in self.stops) if at >= 0]
            if found:
                self.stop_index = min(found)
                return list(tokens[: i + 1])
        return list(tokens)

    def result(self) -> GenerationResult:
        """The finished request's result. A stop string found after the engine had already ended the
        request still cuts it (tokens and text)."""
        request = self.request
        tokens, reason = list(request.generated), request.finish_reason
        if request.stop_keep is not None and request.error is None:
            tokens, reason = tokens[: request.stop_keep], "stop"
        if self.stopped:
            text = self.decoded[: self.stop_index]
        else:
            text = self.tokenizer.decode_continuation(request.prompt, tokens)
        request.stats.new_tokens = len(tokens)
        logprobs = request.token_logprobs[: len(tokens)] if request.logprobs is not None else None
        prompt_logprobs = request.prompt_scores if request.prompt_logprobs is not None else None
        return GenerationResult(self.prompt, tokens, text, request.stats, reason, logprobs, prompt_logprobs)


def safe_prefix(text: str, stops) -> str:
    """The longest prefix of `text` that a stop string can no longer cut: before the first stop string
    in it, and short of any tail that could be the start of one (what OutputProcessor delivers)."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    text = text[:cut]
    return text[: len(text) - held_back(text, stops)]


def held_back(text: str, stops) -> int:
    """Characters at the end of `text` that could be the start of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
