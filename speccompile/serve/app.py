"""An OpenAI-compatible HTTP service over one Runtime: every request is a client of its engine.

Routes: POST /v1/completions and POST /v1/chat/completions (OpenAI's shapes, streaming as
server-sent events; chat where the bundle's tokenizer has a chat template, rendered as transformers
renders it), GET /v1/models, GET /health, GET /metrics. Every bad request gets a 4xx with OpenAI's
error body ({"error": {"message", "type", "param", "code"}}) and the server goes on. A client that
goes away mid-stream cancels its request, which frees its slot at the engine's next iteration.

Each response carries the request's speculative statistics under llama.cpp's names
(`timings.draft_n`, `timings.draft_n_accepted`, beside `prompt_n`, `predicted_n`, `prompt_ms`,
`predicted_ms`), and ours under `speculative` (acceptance rate, mean acceptance length, mean γ, the
iterations per draft count, drafts per proposer).
"""

import json
import os
import socket
import threading
import time
import uuid
from typing import Literal

from speccompile.errors import SpecCompileError

# OpenAI's completion parameters this server does not implement: refused by name, not ignored
UNSUPPORTED = ("best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "presence_penalty", "suffix")


def create_app(runtime, model_name: str, api_key: str | None = None, max_waiting: int | None = None,
               gamma: int | str | None = None):
    """The FastAPI application serving `runtime` as model `model_name` (bearer `api_key` if given).
    gamma: every request's γ, a compiled one or "auto" (default: the runtime's own default).
    max_waiting: requests beyond the engine's slots that may wait (default: 4 × its max batch);
    past that, 429 with Retry-After rather than a queue without bound."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field

    class StreamOptions(BaseModel):
        model_config = ConfigDict(extra="forbid")
        include_usage: bool = False

    class Sampling(BaseModel):
        model_config = ConfigDict(extra="forbid")
        model: str | None = None
        temperature: float = Field(1.0, ge=0.0, le=2.0)  # OpenAI's default
        top_p: float = Field(1.0, gt=0.0, le=1.0)
        top_k: int = Field(0, ge=0)  # an extension, as vLLM's and llama.cpp's
        seed: int | None = None
        stop: str | list[str] | None = None
        stream: bool = False
        stream_options: StreamOptions | None = None
        n: Literal[1] = 1
        user: str | None = None

    class CompletionRequest(Sampling):
        prompt: str | list[int]
        max_tokens: int = Field(16, ge=1)

    class Message(BaseModel):
        model_config = ConfigDict(extra="forbid")
        role: Literal["system", "user", "assistant"]
        content: str
        name: str | None = None

    class ChatRequest(Sampling):
        messages: list[Message] = Field(min_length=1)
        max_tokens: int | None = Field(None, ge=1)
        max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens

    app = FastAPI(title="speccompile", docs_url=None, redoc_url=None)
    server_id = f"{socket.gethostname()}:{os.getpid()}"
    chat_template = runtime.tokenizer.chat_template()
    metrics = Metrics(runtime)
    capacity = runtime.max_batch + (4 * runtime.max_batch if max_waiting is None else max_waiting)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        if first["type"] == "extra_forbidden" and param in UNSUPPORTED:
            message = f"{param} is not supported by this server"
        elif first["type"] == "json_invalid":
            message, param = "the request body is not valid JSON", None
        else:
            message = f"{param}: {first['msg']}" if param else first["msg"]
        return openai_error(400, message, param)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization") != f"Bearer {api_key}":
                return openai_error(401, "missing or incorrect API key (send Authorization: Bearer KEY)", None,
                                    "invalid_api_key")
        response = await call_next(request)
        response.headers["x-speccompile-server"] = server_id  # which process answered (replicas differ)
        return response

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        from fastapi.responses import Response

        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "speccompile"}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await serve_request(body, body.prompt, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        if chat_template is None:
            return openai_error(400, "this model has no chat template (its checkpoint's tokenizer has none): "
                                "use /v1/completions", "messages")
        try:
            text = render_chat(chat_template, [m.model_dump(exclude_none=True) for m in body.messages])
        except Exception as e:  # noqa: BLE001 (the template's own error, e.g. raise_exception, for the caller)
            return openai_error(400, f"the chat template refused these messages: {e}", "messages")
        prompt = runtime.tokenizer.encode(text, special_tokens=False)  # the template writes its own
        return await serve_request(body, prompt, body.max_completion_tokens or body.max_tokens or 16, chat=True)

    async def serve_request(body, prompt, max_tokens: int, chat: bool):
        if body.model is not None and body.model != model_name:
            return openai_error(404, f"model {body.model!r} is not served here (this server serves {model_name!r})",
                                "model", "model_not_found")
        if metrics.in_flight >= capacity:
            response = openai_error(429, f"the server has {metrics.in_flight} requests in flight, its limit: "
                                    "retry later", None, "rate_limit_exceeded")
            response.headers["Retry-After"] = "1"
            return response
        metrics.started()  # before the engine can finish it
        try:
            handle = runtime.submit_async(prompt, max_new_tokens=max_tokens, temperature=body.temperature,
                                          top_k=body.top_k, top_p=body.top_p, seed=body.seed, stop=body.stop,
                                          gamma=gamma, on_finish=metrics.finished)
        except SpecCompileError as e:
            metrics.refused()
            return openai_error(400, str(e), None)
        shape = Shape(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), model_name, chat)
        if not body.stream:
            result = await handle.result()
            return shape.body(result, len(handle.request.prompt))
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        events = stream_events(runtime, handle, shape, body.stop, include_usage)
        return StreamingResponse(events, media_type="text/event-stream")

    def openai_error(status: int, message: str, param: str | None, code: str | None = None):
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)

    return app


class Shape:
    """One response's id, creation time, model and kind (text completion or chat), and its bodies in
    OpenAI's shapes."""

    def __init__(self, response_id: str, created: int, model: str, chat: bool):
        self.id, self.created, self.model, self.chat = response_id, created, model, chat
        self.object = "chat.completion" if chat else "text_completion"

    def body(self, result, prompt_tokens: int) -> dict:
        """A whole completion, with the request's speculative statistics."""
        choice = {"index": 0, "finish_reason": finish_reason(result), "logprobs": None}
        choice |= {"message": {"role": "assistant", "content": result.text}} if self.chat else {"text": result.text}
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(result, prompt_tokens), **speculative_stats(result, prompt_tokens)}

    def chunk(self, text: str, reason: str | None, first: bool = False) -> str:
        """One server-sent event of a stream."""
        choice = {"index": 0, "finish_reason": reason, "logprobs": None}
        if self.chat:
            choice["delta"] = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
        else:
            choice["text"] = text
        return self.event({"choices": [choice]})

    def event(self, fields: dict) -> str:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return "data: " + json.dumps({"id": self.id, "object": kind, "created": self.created, "model": self.model,
                                      **fields}) + "\n\n"


def render_chat(template_and_tokens: tuple[str, dict], messages: list[dict]) -> str:
    """The chat template rendered as transformers renders it (a sandboxed Jinja environment that
    trims blocks, with raise_exception), with the generation prompt."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise ValueError(message)

    template, tokens = template_and_tokens
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(template).render(messages=messages, add_generation_prompt=True, **tokens)


def finish_reason(result) -> str:
    return "stop" if result.finish_reason == "stop" else "length"


def usage(result, prompt_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": len(result.token_ids),
            "total_tokens": prompt_tokens + len(result.token_ids)}


def speculative_stats(result, prompt_tokens: int) -> dict:
    s = result.stats
    timings = {"prompt_n": prompt_tokens, "prompt_ms": s.prefill_ms,
               "predicted_n": len(result.token_ids), "predicted_ms": s.total_ms - s.prefill_ms,
               "draft_n": s.draft_tokens, "draft_n_accepted": s.accepted_tokens}
    stats = s.to_dict()
    speculative = {key: stats[key] for key in ("mode", "acceptance_rate", "mean_acceptance_length", "mean_gamma",
                                               "gammas_used", "by_proposer")}
    return {"timings": timings, "speculative": speculative}


async def stream_events(runtime, handle, shape: Shape, stop, include_usage: bool):
    """Server-sent events: text deltas as tokens are accepted (held back while they could begin a stop
    string, so that the deltas add up to the final text), the last chunk with the finish reason,
    usage if asked, then [DONE]. A client that disconnects cancels the request."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    decoder, decoded, sent, first = None, "", "", True
    try:
        async for token_ids in handle.stream():
            decoder = decoder or runtime.tokenizer.stream(handle.request.prompt)
            decoded += decoder.add(token_ids)
            safe = _safe_prefix(decoded, stops)
            if len(safe) > len(sent) or (first and shape.chat):
                yield shape.chunk(safe[len(sent):], None, first)
                sent, first = safe, False
        result = await handle.result()
        yield shape.chunk(result.text[len(sent):], finish_reason(result), first)
        if include_usage:
            prompt_tokens = len(handle.request.prompt)
            yield shape.event({"choices": [], "usage": usage(result, prompt_tokens),
                               **speculative_stats(result, prompt_tokens)})
        yield "data: [DONE]\n\n"
    finally:
        if not handle.done:
            handle.cancel()


def _safe_prefix(text: str, stops: list[str]) -> str:
    """The longest prefix of `text` that a stop string can no longer cut: before the first stop string
    in it, and short of any tail that could be the start of one."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    text = text[:cut]
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold]


class Metrics:
    """Prometheus metrics of the service, on a registry of its own: speculative counters with the
    meaning of vLLM's, latency histograms, and the engine's load and current γ."""

    def __init__(self, runtime):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self._count = threading.Lock()  # the event loop counts requests in, the engine thread out
        self.in_flight = 0  # submitted and not finished

        def counter(name, text, labels=()):
            return Counter(f"speccompile:{name}", text, labels, registry=self.registry)

        self.drafts = counter("spec_decode_num_drafts", "Verifications that checked at least one draft token")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position", ["position"])
        self.requests = counter("request_success", "Requests finished", ["finished_reason"])
        self.generated = counter("generation_tokens", "Tokens generated")
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
        self.latency = Histogram("speccompile:e2e_request_latency_seconds", "Request latency from submission",
                                 buckets=buckets, registry=self.registry)
        self.ttft = Histogram("speccompile:time_to_first_token_seconds", "Time to the first token",
                              buckets=buckets, registry=self.registry)
        self.itl = Histogram("speccompile:inter_token_latency_seconds", "Mean time between a request's tokens",
                             buckets=buckets, registry=self.registry)
        scheduler = runtime.scheduler
        Gauge("speccompile:num_requests_running", "Requests decoding or being prefilled",
              registry=self.registry).set_function(lambda: scheduler.active)
        Gauge("speccompile:num_requests_waiting", "Requests waiting for a slot",
              registry=self.registry).set_function(lambda: max(0, self.in_flight - scheduler.active))
        Gauge("speccompile:spec_decode_gamma", "γ of the last decoding iteration (0: a plain step)",
              registry=self.registry).set_function(lambda: scheduler.last_gamma)

    def started(self) -> None:
        with self._count:
            self.in_flight += 1

    def refused(self) -> None:
        with self._count:
            self.in_flight -= 1

    def finished(self, request) -> None:
        """A request ended (on the engine thread): count what it did."""
        with self._count:
            self.in_flight -= 1
        s = request.stats
        self.drafts.inc(sum(n for g, n in s.gammas_used.items() if g))
        self.draft_tokens.inc(s.draft_tokens)
        self.accepted.inc(s.accepted_tokens)
        for position, kept in enumerate(s.accepted_at, start=1):
            self.accepted_per_pos.labels(str(position)).inc(kept)
        self.requests.labels(request.finish_reason or "error").inc()
        self.generated.inc(len(request.generated))
        self.latency.observe(s.total_ms / 1e3)
        if request.generated:
            self.ttft.observe(s.ttft_ms / 1e3)
        if len(request.generated) > 1:
            self.itl.observe((s.total_ms - s.ttft_ms) / 1e3 / (len(request.generated) - 1))

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
