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

from speccompile.errors import SpecCompileError
from speccompile.serve.chat import render_chat
from speccompile.serve.limits import BodyLimit
from speccompile.serve.metrics import Metrics
from speccompile.serve.protocol import UNSUPPORTED, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from speccompile.serve.responses import Shape, finish_reason, speculative_stats, usage

MAX_BODY_BYTES = 4 << 20  # a request body past this is a 413 (a whole context of token ids is tens of KB)


def create_app(runtime, model_name: str, api_key: str | None = None, max_waiting: int | None = None,
               gamma: int | str | None = None, proposer: str | None = None, p_min: float | None = None,
               chat_template: str | None = None, max_body_bytes: int = MAX_BODY_BYTES):
    """The FastAPI application serving `runtime` as model `model_name` (bearer `api_key` if given).
    gamma, proposer, p_min: what a request gets that does not ask (default: the runtime's defaults);
    gamma is a compiled γ or "auto". chat_template: the template to render chats with, instead of
    the checkpoint's. max_waiting: requests beyond the engine's slots that may wait (default: 4 ×
    its max batch); past that, 429 with Retry-After rather than a queue without bound."""
    from importlib.metadata import version

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(title="speccompile", docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimit, limit=max_body_bytes)
    server_id = f"{socket.gethostname()}:{os.getpid()}"
    template = chat_template or runtime.tokenizer.chat_template()
    special_tokens = runtime.tokenizer.special_tokens()
    metrics = Metrics(runtime, model_name)
    capacity = runtime.max_batch + (4 * runtime.max_batch if max_waiting is None else max_waiting)
    defaults = {"gamma": gamma, "proposer": proposer, "p_min": p_min}

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

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        """FastAPI's own refusals (a body it cannot parse, an unknown route) in OpenAI's error shape."""
        detail = error.detail if isinstance(error.detail, str) else "the request was refused"
        message = "the request body is not valid JSON" if "parsing the body" in detail else detail
        return openai_error(error.status_code, message, None)

    @app.middleware("http")
    async def authorize(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {api_key}".encode()):  # in constant time
                return openai_error(401, "missing or incorrect API key (send Authorization: Bearer KEY)", None,
                                    "invalid_api_key")
        response = await call_next(request)
        response.headers["x-speccompile-server"] = server_id  # which process answered (replicas differ)
        return response

    @app.get("/health")
    async def health():
        """200 while the engine serves; 503 after several failed iterations in a row (restart me)."""
        state = runtime.health()
        if state["healthy"]:
            return {"status": "ok"}
        return JSONResponse({"status": "unhealthy", "failures_in_a_row": state["failures_in_a_row"],
                             "last_error": state["last_error"]}, 503)

    @app.get("/version")
    async def server_version():
        return {"version": version("speccompile")}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id}")
    async def model(model_id: str):
        if model_id != model_name:
            return not_served(model_id)
        return model_card()

    def model_card() -> dict:
        """vLLM's model entry (max_model_len: prompt and completion together), and what speculates."""
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "speccompile",
                "root": model_name, "parent": None, "max_model_len": runtime.max_seq,
                "speculative": runtime.speculative_config()}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if body.model is not None and body.model != model_name:
            return not_served(body.model)
        if (body.prompt is None) == (body.messages is None):
            return openai_error(400, "give either prompt or messages", "prompt")
        try:
            if body.messages is not None:
                text = chat_text(body.messages, {"add_generation_prompt": body.add_generation_prompt})
                ids = runtime.tokenizer.encode(text, special_tokens=False)
            else:
                ids = runtime.tokenizer.encode(body.prompt, special_tokens=body.add_special_tokens)
        except SpecCompileError as e:
            return openai_error(400, str(e), "messages" if body.messages is not None else "prompt")
        answer = {"count": len(ids), "max_model_len": runtime.max_seq, "tokens": ids}
        return answer | ({"token_strs": runtime.tokenizer.token_texts(ids)} if body.return_token_strs else {})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        if body.model is not None and body.model != model_name:
            return not_served(body.model)
        try:
            ids = runtime.check_token_ids(body.tokens)
        except SpecCompileError as e:
            return openai_error(400, str(e), "tokens")
        return {"prompt": runtime.tokenizer.decode(ids)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        return await serve_request(body, body.prompts(), body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest):
        options = {"add_generation_prompt": body.add_generation_prompt, "tools": body.tools,
                   "continue_final_message": body.continue_final_message, "extra": body.chat_template_kwargs}
        try:
            text = chat_text(body.messages, options)
            prompt = runtime.tokenizer.encode(text, special_tokens=False)  # the template writes its own
        except SpecCompileError as e:  # a template that fails, or a rendered text no tokenizer takes
            return openai_error(400, str(e), "messages")
        return await serve_request(body, [prompt], body.max_completion_tokens or body.max_tokens, chat=True)

    def chat_text(messages, options: dict) -> str:
        if template is None:
            raise SpecCompileError("this model has no chat template (its checkpoint's tokenizer has none): use "
                                   "/v1/completions, or start the server with --chat-template FILE")
        return render_chat(template, special_tokens, [m.model_dump(exclude_none=True) for m in messages], **options)

    async def serve_request(body, prompts: list, max_tokens: int | None, chat: bool):
        if body.model is not None and body.model != model_name:
            return not_served(body.model)
        count = len(prompts) * body.n
        if metrics.in_flight + count > capacity:
            response = openai_error(429, f"the server has {metrics.in_flight} requests in flight, its limit: "
                                    "retry later", None, "rate_limit_exceeded")
            response.headers["Retry-After"] = "1"
            return response
        try:  # compiled off the event loop (a large grammar takes seconds); requests then find it cached
            await asyncio.to_thread(runtime.compile_constraint, **body.constraint())
        except SpecCompileError as e:
            return openai_error(400, str(e), None)
        handles = []
        try:
            for prompt in prompts:
                for sample in range(body.n):
                    metrics.started()  # before the engine can finish it
                    first = handles[-sample] if sample else None  # the prompt's first sample: its prefill is copied
                    try:
                        handles.append(runtime.submit_async(prompt, on_finish=metrics.finished, same_prompt_as=first,
                                                            **request_options(body, max_tokens, sample)))
                    except SpecCompileError:
                        metrics.refused()
                        raise
        except SpecCompileError as e:
            for handle in handles:
                handle.cancel()
            return openai_error(400, str(e), None)
        shape = Shape(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time()), model_name, chat,
                      runtime.tokenizer, body.n, echo=not chat and body.echo, echo_only=max_tokens == 0,
                      logprobs=reported_logprobs(body, chat))
        if not body.stream:
            try:
                results = await asyncio.gather(*(h.result() for h in handles))
            except Exception as e:  # noqa: BLE001 (the engine's failure, named for the caller: the one 5xx)
                return openai_error(500, engine_failure(e), None, "engine_error")
            return shape.body(results, handles)
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        events = stream_events(runtime, handles, shape, body.stop, include_usage,
                               options is not None and options.continuous_usage_stats)
        return StreamingResponse(events, media_type="text/event-stream")

    def request_options(body, max_tokens: int | None, sample: int) -> dict:
        """The runtime's arguments for sample `sample` of a prompt: seeds seed, seed + 1, ... (as vLLM's n)."""
        gamma_asked = body.num_speculative_tokens if body.num_speculative_tokens is not None else defaults["gamma"]
        options = {"max_new_tokens": max_tokens or (1 if max_tokens == 0 else None),  # echo alone: one, unsent
                   "temperature": body.temperature, "top_k": body.top_k,
                   "top_p": body.top_p, "seed": None if body.seed is None else body.seed + sample, "stop": body.stop,
                   "stop_token_ids": body.stop_token_ids or (), "ignore_eos": body.ignore_eos, "gamma": gamma_asked,
                   "p_min": body.p_min if body.p_min is not None else defaults["p_min"],
                   "sampling_rule": body.sampling_rule, "presence_penalty": body.presence_penalty,
                   "frequency_penalty": body.frequency_penalty, "repetition_penalty": body.repetition_penalty,
                   "logit_bias": body.logit_bias, "min_p": body.min_p, "min_tokens": body.min_tokens,
                   "logprobs": reported_logprobs(body, isinstance(body, ChatRequest)),
                   "prompt_logprobs": scored_prompt(body), **body.constraint()}
        proposer_asked = body.proposer or defaults["proposer"]
        return options | ({"proposer": proposer_asked} if proposer_asked else {})

    def reported_logprobs(body, chat: bool) -> int | None:
        """How many top tokens each generated token's log-probability comes with (None: none asked)."""
        if chat:
            return (body.top_logprobs or 0) if body.logprobs else None
        return body.logprobs

    def scored_prompt(body) -> int | None:
        """Completions: the prompt's log-probabilities are scored for echo with logprobs, or vLLM's prompt_logprobs."""
        if isinstance(body, ChatRequest):
            return None
        if body.prompt_logprobs is not None:
            return body.prompt_logprobs
        return body.logprobs if body.echo else None

    def not_served(asked: str):
        return openai_error(404, f"model {asked!r} is not served here (this server serves {model_name!r})", "model",
                            "model_not_found")

    def openai_error(status: int, message: str, param: str | None, code: str | None = None):
        kind = "invalid_request_error" if status < 500 else "server_error"
        return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)

    return app


async def stream_events(runtime, handles: list, shape: Shape, stop, include_usage: bool,
                        continuous_usage: bool = False):
    """Server-sent events: each choice's text deltas as its tokens are accepted (held back while they
    could begin a stop string, so that its deltas add up to its final text) with those tokens'
    log-probabilities when asked, its last chunk with the finish reason; usage if asked (in every
    chunk too, with continuous_usage), then [DONE]. With echo the prompt comes first. A client that
    disconnects cancels every request."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    events: asyncio.Queue = asyncio.Queue()

    def so_far(handle, delivered: int) -> dict | None:
        if not continuous_usage:
            return None
        prompt = len(handle.request.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": delivered, "total_tokens": prompt + delivered}

    async def one_choice(index: int, handle):
        decoder, decoded, sent, first, delivered = None, "", "", True, 0
        if shape.echo:
            await events.put(shape.chunk(index, shape.prompt_text(handle), None, first))
            first = False
        async for token_ids in handle.stream():
            if shape.echo_only:
                continue
            decoder = decoder or runtime.tokenizer.stream(handle.request.prompt)
            decoded += decoder.add(token_ids)
            entries = handle.request.token_logprobs[delivered : delivered + len(token_ids)]
            logprobs = shape.delta_logprobs(list(token_ids), entries)
            delivered += len(token_ids)
            safe = _safe_prefix(decoded, stops)
            if len(safe) > len(sent) or (first and shape.chat) or logprobs:
                await events.put(shape.chunk(index, safe[len(sent):], None, first, logprobs,
                                             so_far(handle, delivered)))
                sent, first = safe, False
        result = await handle.result()
        rest = "" if shape.echo_only else result.text[len(sent):]
        final = 0 if shape.echo_only else len(result.token_ids)
        await events.put(shape.chunk(index, rest, finish_reason(result), first, None, so_far(handle, final)))
        return result

    tasks = [asyncio.ensure_future(one_choice(i, h)) for i, h in enumerate(handles)]
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
        try:
            results = done.result()
        except Exception as e:  # noqa: BLE001 (the engine failed: an error event ends the stream, as OpenAI's)
            error = {"message": engine_failure(e), "type": "server_error", "param": None, "code": "engine_error"}
            yield "data: " + json.dumps({"error": error}) + "\n\n"
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            prompt_tokens = [len(h.request.prompt) for h in handles]
            stats = speculative_stats(results[0], prompt_tokens[0]) if len(results) == 1 else {}
            yield shape.event({"choices": [], "usage": usage(results, prompt_tokens, shape.n, shape.echo_only),
                               **stats})
        yield "data: [DONE]\n\n"
    finally:
        for pending in [getter, done, *tasks]:  # the gathering first: its cancellation reaches the choices
            if pending is not None and not pending.done():
                pending.cancel()
        for handle in handles:
            if not handle.done:
                handle.cancel()


def engine_failure(error: Exception) -> str:
    return f"the engine failed during this request ({type(error).__name__}: {error}); later requests are served"


def _safe_prefix(text: str, stops: list[str]) -> str:
    """The longest prefix of `text` that a stop string can no longer cut: before the first stop string
    in it, and short of any tail that could be the start of one."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    text = text[:cut]
    hold = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - hold]
