"""An OpenAI-compatible HTTP service over one Runtime: every request is a client of its engine.

Routes: POST /v1/completions and POST /v1/chat/completions (OpenAI's shapes and vLLM's extensions,
serve/protocol.py; streaming as server-sent events; chat where the checkpoint has a chat template or
one is given, rendered as transformers renders it, serve/chat.py), GET /v1/models (with vLLM's
max_model_len and what speculates), vLLM's POST /tokenize and /detokenize and GET /version, GET
/health, GET /metrics (vLLM's series, serve/metrics.py). Every bad request gets a 4xx with OpenAI's
error body ({"error": {"message", "type", "param", "code"}}) and the server goes on. A client that
goes away mid-stream cancels its request, which frees its slot at the engine's next iteration.
The one 5xx: a request whose engine iteration failed gets OpenAI's error body naming the failure (an
error event, streaming); /health turns 503 after failures in a row. Bodies past max_body_bytes get a
413 and idle connections are closed (serve/limits.py).

The routes are plain functions of a body and the `Server` (what they share: the runtime, the model's
name, the defaults a request gets), which FastAPI hands them as a dependency. A body becomes a
`GenerationParams` (core/params.py) and each prompt's samples requests of the runtime; the text a
stream sends is the requests' output processors' deltas (runtime/output.py), serialised.

Each response carries the request's speculative statistics under llama.cpp's names
(`timings.draft_n`, `timings.draft_n_accepted`, beside `prompt_n`, `predicted_n`, `prompt_ms`,
`predicted_ms`), and ours under `speculative` (acceptance rate, mean acceptance length, mean γ, the
iterations per draft count, drafts per proposer).
"""

import asyncio
import hmac
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from importlib.metadata import version
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from speccompile.core.params import GenerationParams
from speccompile.errors import SpecCompileError
from speccompile.serve.chat import render_chat
from speccompile.serve.limits import BodyLimit
from speccompile.serve.metrics import Metrics
from speccompile.serve.protocol import UNSUPPORTED, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from speccompile.serve.responses import Shape, finish_reason, speculative_stats, usage

MAX_BODY_BYTES = 4 << 20  # a request body past this is a 413 (a whole context of token ids is tens of KB)


@dataclass
class Server:
    """What the routes share: the runtime, the name it is served as, what a request gets that does
    not ask (`defaults`), the chat template, metrics, and how many requests may be in flight."""

    runtime: object
    model_name: str
    defaults: GenerationParams
    template: str | None
    metrics: Metrics
    capacity: int
    api_key: str | None = None

    def card(self) -> dict:
        """vLLM's model entry (max_model_len: prompt and completion together), and what speculates."""
        return {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "speccompile",
                "root": self.model_name, "parent": None, "max_model_len": self.runtime.max_seq,
                "speculative": self.runtime.speculative_config()}

    def chat_text(self, messages, **options) -> str:
        if self.template is None:
            raise SpecCompileError("this model has no chat template (its checkpoint's tokenizer has none): use "
                                   "/v1/completions, or start the server with --chat-template FILE")
        messages = [m.model_dump(exclude_none=True) for m in messages]
        return render_chat(self.template, self.runtime.tokenizer.special_tokens(), messages, **options)

    def not_served(self, asked: str | None) -> JSONResponse | None:
        """A 404 when a body names another model than this one."""
        if asked is None or asked == self.model_name:
            return None
        return openai_error(404, f"model {asked!r} is not served here (this server serves {self.model_name!r})",
                            "model", "model_not_found")


def create_app(runtime, model_name: str, api_key: str | None = None, max_waiting: int | None = None,
               gamma: int | str | None = None, proposer: str | None = None, p_min: float | None = None,
               chat_template: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI application serving `runtime` as model `model_name` (bearer `api_key` if given).
    gamma, proposer, p_min: what a request gets that does not ask (default: the runtime's defaults);
    gamma is a γ the bundle verifies at or "auto". chat_template: the template to render chats with,
    instead of the checkpoint's. max_waiting: requests beyond the engine's slots that may wait (default: 4 ×
    its max batch); past that, 429 with Retry-After rather than a queue without bound."""
    defaults = GenerationParams.of(gamma=gamma, p_min=p_min, **({"proposer": proposer} if proposer else {}))
    capacity = runtime.max_batch + (4 * runtime.max_batch if max_waiting is None else max_waiting)
    app = FastAPI(title="speccompile", docs_url=None, redoc_url=None)
    app.state.server = Server(runtime, model_name, defaults, chat_template or runtime.tokenizer.chat_template(),
                              Metrics(runtime, model_name), capacity, api_key)
    app.state.server_id = f"{socket.gethostname()}:{os.getpid()}"
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.middleware("http")(authorize)
    app.add_exception_handler(RequestValidationError, invalid_body)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.include_router(router)
    return app


def server_of(request: Request) -> Server:
    return request.app.state.server


Served = Annotated[Server, Depends(server_of)]
router = APIRouter()


# -- errors and authorization ------------------------------------------------------------------------
def openai_error(status: int, message: str, param: str | None, code: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    param = ".".join(str(p) for p in first["loc"] if p != "body") or None
    if first["type"] == "extra_forbidden" and param in UNSUPPORTED:
        message = f"{param} is not supported by this server"
    elif first["type"] == "json_invalid":
        message, param = "the request body is not valid JSON", None
    else:
        message = f"{param}: {first['msg']}" if param else first["msg"]
    return openai_error(400, message, param)


async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    """FastAPI's own refusals (a body it cannot parse, an unknown route) in OpenAI's error shape."""
    detail = error.detail if isinstance(error.detail, str) else "the request was refused"
    message = "the request body is not valid JSON" if "parsing the body" in detail else detail
    return openai_error(error.status_code, message, None)


async def authorize(request: Request, call_next):
    api_key = request.app.state.server.api_key
    if api_key is not None and request.url.path.startswith("/v1/"):
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, f"Bearer {api_key}".encode()):  # in constant time
            return openai_error(401, "missing or incorrect API key (send Authorization: Bearer KEY)", None,
                                "invalid_api_key")
    response = await call_next(request)
    response.headers["x-speccompile-server"] = request.app.state.server_id  # which process answered
    return response


def engine_failure(error: Exception) -> str:
    return f"the engine failed during this request ({type(error).__name__}: {error}); later requests are served"


# -- the service's state -----------------------------------------------------------------------------
@router.get("/health")
async def health(server: Served):
    """200 while the engine serves; 503 after several failed iterations in a row (restart me)."""
    state = server.runtime.health()
    if state["healthy"]:
        return {"status": "ok"}
    return JSONResponse({"status": "unhealthy", "failures_in_a_row": state["failures_in_a_row"],
                         "last_error": state["last_error"]}, 503)


@router.get("/version")
async def server_version():
    return {"version": version("speccompile")}


@router.get("/metrics")
async def prometheus(server: Served):
    return Response(server.metrics.exposition(), media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(server: Served):
    return {"object": "list", "data": [server.card()]}


@router.get("/v1/models/{model_id}")
async def model(model_id: str, server: Served):
    return server.not_served(model_id) or server.card()


# -- tokens ------------------------------------------------------------------------------------------
@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, server: Served):
    if (refused := server.not_served(body.model)) is not None:
        return refused
    if (body.prompt is None) == (body.messages is None):
        return openai_error(400, "give either prompt or messages", "prompt")
    tokenizer = server.runtime.tokenizer
    try:
        if body.messages is not None:
            text = server.chat_text(body.messages, add_generation_prompt=body.add_generation_prompt)
            ids = tokenizer.encode(text, special_tokens=False)
        else:
            ids = tokenizer.encode(body.prompt, special_tokens=body.add_special_tokens)
    except SpecCompileError as e:
        return openai_error(400, str(e), "messages" if body.messages is not None else "prompt")
    answer = {"count": len(ids), "max_model_len": server.runtime.max_seq, "tokens": ids}
    return answer | ({"token_strs": tokenizer.token_texts(ids)} if body.return_token_strs else {})


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, server: Served):
    if (refused := server.not_served(body.model)) is not None:
        return refused
    try:
        ids = server.runtime.check_token_ids(body.tokens)
    except SpecCompileError as e:
        return openai_error(400, str(e), "tokens")
    return {"prompt": server.runtime.tokenizer.decode(ids)}


# -- generation --------------------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(body: CompletionRequest, server: Served):
    return await generate(server, body, body.prompts(), chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, server: Served):
    try:
        text = server.chat_text(body.messages, add_generation_prompt=body.add_generation_prompt, tools=body.tools,
                                continue_final_message=body.continue_final_message, extra=body.chat_template_kwargs)
        prompt = server.runtime.tokenizer.encode(text, special_tokens=False)  # the template writes its own
    except SpecCompileError as e:  # a template that fails, or a rendered text no tokenizer takes
        return openai_error(400, str(e), "messages")
    return await generate(server, body, [prompt], chat=True)


async def generate(server: Server, body, prompts: list, chat: bool):
    """Every prompt's n samples as requests of the runtime; the whole response, or its stream."""
    if (refused := server.not_served(body.model)) is not None:
        return refused
    if server.metrics.in_flight + len(prompts) * body.n > server.capacity:
        response = openai_error(429, f"the server has {server.metrics.in_flight} requests in flight, its limit: "
                                "retry later", None, "rate_limit_exceeded")
        response.headers["Retry-After"] = "1"
        return response
    try:
        params = body.params(server.defaults, chat)
        if params.constraint is not None:  # compiled off the event loop (a large grammar takes seconds)
            await asyncio.to_thread(server.runtime.grammars().start, params.constraint)
        handles = submit(server, prompts, params, body.stream)
    except SpecCompileError as e:
        return openai_error(400, str(e), None)
    shape = Shape(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), server.model_name, chat,
                  server.runtime.tokenizer, params.n, echo=not chat and body.echo,
                  echo_only=not chat and body.max_tokens == 0, logprobs=params.logprobs)
    if body.stream:
        options = body.stream_options
        events = stream_events(handles, shape, options is not None and options.include_usage,
                               options is not None and options.continuous_usage_stats)
        return StreamingResponse(events, media_type="text/event-stream")
    try:
        results = await asyncio.gather(*(h.result() for h in handles))
    except Exception as e:  # noqa: BLE001 (the engine's failure, named for the caller: the one 5xx)
        return openai_error(500, engine_failure(e), None, "engine_error")
    return shape.body(results, handles)


def submit(server: Server, prompts: list, params: GenerationParams, stream: bool) -> list:
    """A request per prompt and sample: request i of the body seeded seed + i (GenerationParams.for_sample);
    a prompt's later samples copy its first's prefill. All or none: a refused one cancels the others."""
    handles = []
    try:
        for i in range(len(prompts) * params.n):
            server.metrics.started()  # before the engine can finish it
            first = handles[i - i % params.n] if i % params.n else None
            try:
                handles.append(server.runtime.submit_async(prompts[i // params.n], params.for_sample(i),
                                                           on_finish=server.metrics.finished, same_prompt_as=first,
                                                           stream_text=stream))
            except SpecCompileError:
                server.metrics.refused()
                raise
    except SpecCompileError:
        for handle in handles:
            handle.cancel()
        raise
    return handles


async def stream_events(handles: list, shape: Shape, include_usage: bool, continuous_usage: bool = False):
    """Server-sent events: each choice's deltas as its output processor makes them (its text held back
    while it could begin a stop string, so that the deltas add up to the final text, with those
    tokens' log-probabilities when asked), its last chunk with the finish reason; usage if asked (in
    every chunk too, with continuous_usage), then [DONE]. With echo the prompt comes first. A client
    that disconnects cancels every request."""
    events: asyncio.Queue = asyncio.Queue()
    tasks = [asyncio.ensure_future(stream_choice(i, h, shape, events, continuous_usage)) for i, h in enumerate(handles)]
    done = asyncio.ensure_future(asyncio.gather(*tasks))
    done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: a client gone is no error
    getter = None
    try:
        while not (done.done() and events.empty()):
            getter = asyncio.ensure_future(events.get())
            await asyncio.wait([getter, done], return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield getter.result()
            else:
                getter.cancel()
        async for event in closing_events(done, handles, shape, include_usage):
            yield event
    finally:
        for pending in [getter, done, *tasks]:  # the gathering first: its cancellation reaches the choices
            if pending is not None and not pending.done():
                pending.cancel()
        for handle in handles:
            if not handle.done:
                handle.cancel()


async def stream_choice(index: int, handle, shape: Shape, events: asyncio.Queue, continuous_usage: bool):
    """One choice's chunks, onto `events`; its result."""
    def so_far(delivered: int) -> dict | None:
        if not continuous_usage:
            return None
        prompt = len(handle.request.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": delivered, "total_tokens": prompt + delivered}

    sent, first, delivered = 0, True, 0
    if shape.echo:
        await events.put(shape.chunk(index, shape.prompt_text(handle), None, first))
        first = False
    async for delta in handle.deltas():
        if shape.echo_only:
            continue
        logprobs = shape.delta_logprobs(delta.token_ids, delta.logprobs or [])
        delivered += len(delta.token_ids)
        if delta.text or (first and shape.chat) or logprobs:
            await events.put(shape.chunk(index, delta.text, None, first, logprobs, so_far(delivered)))
            sent, first = sent + len(delta.text), False
    result = await handle.result()
    rest = "" if shape.echo_only else result.text[sent:]
    final = 0 if shape.echo_only else len(result.token_ids)
    await events.put(shape.chunk(index, rest, finish_reason(result), first, None, so_far(final)))
    return result


async def closing_events(done: asyncio.Future, handles: list, shape: Shape, include_usage: bool):
    """After every choice: an error event if the engine failed (as OpenAI's), usage if asked, [DONE]."""
    try:
        results = done.result()
    except Exception as e:  # noqa: BLE001 (the engine failed: an error event ends the stream)
        error = {"message": engine_failure(e), "type": "server_error", "param": None, "code": "engine_error"}
        yield "data: " + json.dumps({"error": error}) + "\n\n"
        yield "data: [DONE]\n\n"
        return
    if include_usage:
        prompt_tokens = [len(h.request.prompt) for h in handles]
        stats = speculative_stats(results[0], prompt_tokens[0]) if len(results) == 1 else {}
        yield shape.event({"choices": [], "usage": usage(results, prompt_tokens, shape.n, shape.echo_only), **stats})
    yield "data: [DONE]\n\n"
