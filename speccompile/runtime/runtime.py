"""`Runtime`: load a bundle, and serve requests on the continuous-batching scheduler.

Requests are served by one engine thread that runs the scheduler (core/scheduler.py), started on
first use: `submit` (thread-safe) returns a handle at once; `generate` is a client that submits a
list of prompts and waits for them. A request is a `GenerationParams` (core/params.py), checked
against the bundle before it is queued (requests.py), so a bad request raises in its caller's thread
and never disturbs the ones in flight. Its tokens leave the engine through the edge (edge.py) to its
output processor (output.py: text, stop strings, log-probabilities, the result). The γ policies and
their calibration live in policies.py, a Medusa bundle's tree sizing in tree_sizing.py; both measure
at load, before any request is served.
"""

import threading
import time
from pathlib import Path

from speccompile.bundle import Bundle, GraphId, open_bundle
from speccompile.core.grammar import Constraint, GrammarEngine
from speccompile.core.params import GenerationParams, SamplingRule
from speccompile.core.proposers import DEFAULT_PROPOSER, TreeShape
from speccompile.core.request import AUTO, Request
from speccompile.core.scheduler import Scheduler
from speccompile.errors import SpecCompileError
from speccompile.runtime.backends import BACKENDS, make_models, make_proposers, resolve_backend
from speccompile.runtime.calibration import first_runs_matter, warm_up
from speccompile.runtime.edge import Edge
from speccompile.runtime.handles import AsyncRequestHandle, EngineThread, RequestHandle
from speccompile.runtime.output import GenerationResult, OutputProcessor
from speccompile.runtime.policies import LoadPolicies
from speccompile.runtime.requests import make_request, request_gamma, token_ids
from speccompile.runtime.tokenizer import Tokenizer
from speccompile.runtime.tree_sizing import TreeSizing

__all__ = ["BACKENDS", "GenerationParams", "GenerationResult", "Runtime", "load", "resolve_backend"]


class Runtime:
    def __init__(self, bundle: Bundle, backend: str = "onnxruntime", threads: int | None = None,
                 shared_threads: bool | None = None, one_session: bool | None = None, prefill_chunk: int = 64,
                 max_batch: int | None = None):
        """The options are speccompile.load's (backend: "onnxruntime" or "tensorrt", resolved)."""
        self.bundle, self.backend = bundle, backend
        self.target, self.draft, self.eagle = make_models(bundle, backend, threads, shared_threads, one_session)
        self.tokenizer = Tokenizer(bundle.path / bundle.manifest.tokenizer.dir, bundle.manifest.tokenizer.to_json())
        self._grammars: GrammarEngine | None = None
        self._grammar_lock = threading.Lock()
        self.max_seq, self.default_gamma = bundle.max_seq, bundle.default_gamma
        self.gammas = self.target.verifiable_gammas(bundle.gammas)  # the compiled γ, or more (OrtModel's)
        self.max_batch = bundle.max_batch if max_batch is None else max_batch
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or \
                not 1 <= self.max_batch <= bundle.max_batch:
            raise SpecCompileError(f"max_batch must be 1..{bundle.max_batch} (the bundle's), got {max_batch!r}")
        from speccompile.runtime.gamma_profile import find_profile
        from speccompile.runtime.hardware import fingerprint

        self.fingerprint = fingerprint(backend)
        self.profile = find_profile(bundle.path, self.fingerprint)  # measured on this hardware and backend, if any
        self.policies = LoadPolicies(self.profile, self.gammas, self.max_batch, self.max_seq, self.eagle is not None,
                                     compiled=bundle.gammas)
        shape = TreeShape() if bundle.medusa else None
        self.tree_sizing = TreeSizing(bundle, self.target, backend, self.max_batch, shape) if shape else None
        self.proposers = make_proposers(self.draft, self.eagle, self.max_seq, shape,
                                        self.profile.lookup_priors if self.profile is not None else None)
        self.scheduler = Scheduler(self.target, self.draft, self.max_batch, self.max_seq, self.gammas,
                                   self.tokenizer.eos_token_ids, self.policies.policy_for,
                                   prefill_chunk, fallback_gamma=self.default_gamma, proposers=self.proposers)
        self._engine: EngineThread | None = None
        self._edge: Edge | None = None
        self._submitting = threading.Lock()  # one engine thread, and graph loads one at a time, whoever submits
        self._loaded: set = set()
        # What must be measured before serving is measured here, never inside a user's first request
        self.scheduler.start()  # every slot's caches, where the measurements below run too
        if self.tree_sizing is not None:  # a tree has no γ: its size, recorded for this machine or measured
            self.tree_sizing.size()
        else:
            timed = self.policies.needs_calibration and self.policies.calibrate(
                self.target, self.draft, bundle.path, self.fingerprint, self.eagle, self.tokenizer)
            self.warm_up(engines=not timed, runs=first_runs_matter(self.target))  # timing ran every graph

    def warm_up(self, batched: bool = False, engines: bool = True, runs: bool = True) -> None:
        """Load the graphs a default request runs (greedy, γ auto) and run each once (engines), at
        batch 1 and, if batched, at the bundle's max batch too; then serve one short request (a batch
        of them, if batched) and forget it: the first user's request pays neither for opening
        sessions nor for the loop's first runs (demo pair: without the request, its TTFT was 1.3-2x
        a later one's; with it, 1.0-1.2x). load() warms batch 1, running it only where first runs matter
        (runs: calibration.first_runs_matter); a server warms the batched graphs too. Only while idle."""
        if not self.scheduler.idle:
            raise SpecCompileError("a runtime can only warm up while no request is in flight")
        if self.tree_sizing is not None:  # a Medusa bundle: its sizing ran the tree verification
            return
        request = Request([0], 1, gamma=AUTO, proposer=DEFAULT_PROPOSER)
        self.scheduler.proposer(request)
        self._load_graphs(request, batched)
        for batch in (sorted({1, self.max_batch}) if batched else (1,)) if engines and runs else ():
            warm_up(self.target, self.draft, self.gammas, batch, context=min(64, self.max_seq // 4))  # a chunk
        if runs:
            prompt = [token % self.target.vocab_size for token in range(1, 1 + min(8, self.max_seq // 4))]
            self.generate([prompt] * (self.max_batch if batched else 1), max_new_tokens=2, ignore_eos=True)
            self.forget()

    def forget(self) -> None:
        """Back to a fresh load's knowledge (measured priors stay): outputs, policies, the head's
        acceptance and trees. Only while idle; `bench` does it before each measured run."""
        if not self.scheduler.idle:
            raise SpecCompileError("a runtime can only forget while no request is in flight")
        self.proposers.forget()
        self.policies.forget()
        self.scheduler.forget()

    UNHEALTHY_AFTER = 3  # failed iterations in a row after which the runtime reports itself unhealthy

    def health(self) -> dict:
        """{"healthy": bool, "failures_in_a_row": n, "last_error": text or None}: unhealthy after
        UNHEALTHY_AFTER iterations in a row raised (a backend that keeps failing: an orchestrator
        should restart the process); one iteration that succeeds makes it healthy again."""
        engine = self._engine
        failures = engine.failures_in_a_row if engine is not None else 0
        error = engine.last_error if engine is not None and failures else None
        return {"healthy": failures < self.UNHEALTHY_AFTER, "failures_in_a_row": failures,
                "last_error": None if error is None else f"{type(error).__name__}: {error}"}

    def speculative_config(self) -> dict:
        """What speculates here, for a client to see: the γ it verifies at, the default (γ auto, priors from
        a γ profile of this hardware or the calibration at load), the proposers, the sampling rules."""
        return {"gammas": self.gammas, "default_gamma": "auto", "gamma_profile": self.profile is not None,
                "proposers": self.proposers.available(), "default_proposer": DEFAULT_PROPOSER,
                "draft_model": self.draft is not None, "eagle_head": self.eagle is not None,
                "medusa_heads": self.bundle.medusa["num_heads"] if self.bundle.medusa else 0,
                "sampling_rules": [rule.value for rule in SamplingRule], "backend": self.backend}

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, prompt, params: GenerationParams | None = None, *, on_tokens=None, same_prompt_as=None,
               stream_text: bool = False, **options) -> RequestHandle:
        """Queue one request (a string or token ids) and return its handle at once. Thread-safe.

        params: what it asks (core/params.GenerationParams: sampling, stops, processors, logprobs,
        structured output, speculation), or its fields as keywords (replacing those of `params`).
        Everything is checked before the request is queued: SpecCompileError names what does not fit.
        on_tokens(token_ids) is called as tokens are accepted, from the engine thread (from the
        runtime's edge thread for a request with stop strings). same_prompt_as: the handle of an
        earlier request of the same prompt (another of n samples): this one copies its cached prompt
        instead of prefilling it again. stream_text: its text is decoded as it comes, for
        `handle.deltas()` (output.Delta: the text no stop string can cut any more)."""
        params = GenerationParams.of(params, **options)
        request = make_request(self, prompt, params, on_tokens, shares_prefill_with=_request_of(same_prompt_as))
        handle = RequestHandle(request, self, OutputProcessor(self.tokenizer, request, prompt, stream_text))
        self._queue(handle)
        return handle

    def submit_async(self, prompt, params: GenerationParams | None = None, *, on_tokens=None, on_finish=None,
                     same_prompt_as=None, stream_text: bool = False, **options) -> AsyncRequestHandle:
        """`submit` for asyncio code, in the event loop: await `.result()`, `async for` over `.stream()`
        or `.deltas()`. on_finish(request) is called when the request ends, however it ends."""
        params = GenerationParams.of(params, **options)
        request = make_request(self, prompt, params, shares_prefill_with=_request_of(same_prompt_as))
        output = OutputProcessor(self.tokenizer, request, prompt, follow_text=stream_text)
        import asyncio  # here, not at the top: only async callers pay for importing it (handles.py)
        handle = AsyncRequestHandle(asyncio.get_running_loop(), self, output, on_tokens, on_finish)
        self._queue(handle)
        return handle

    def generate(self, prompts, params: GenerationParams | None = None, *, on_tokens=None,
                 **options) -> list[GenerationResult]:
        """Generate for a list of prompts (strings or token-id lists); params.n results per prompt (n
        samples of it), in order: `submit_batch`'s requests' results. on_tokens(i, token_ids) is
        called as request i's tokens are accepted. Each result's stats are its own request's."""
        return [handle.result() for handle in self.submit_batch(prompts, params, on_tokens=on_tokens, **options)]

    def submit_batch(self, prompts, params: GenerationParams | None = None, *, on_tokens=None,
                     stream_text: bool = False, **options) -> list[RequestHandle]:
        """Queue params.n requests per prompt, all checked before any is queued, and return their
        handles in order. Request i is seeded seed + i (GenerationParams.for_sample), so
        generate([p], seed=s) is submit(p, seed=s); a prompt's later samples copy its first's prefill."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or (
                prompts and isinstance(prompts[0], int)):
            raise SpecCompileError("prompts must be a list of strings or a list of token-id lists")
        if not prompts:
            raise SpecCompileError("no prompts given")
        params = GenerationParams.of(params, **options)
        prompts = [p for p in prompts for _ in range(params.n)]
        requests = []
        for i, prompt in enumerate(prompts):
            first = requests[i - i % params.n] if i % params.n else None
            sink = (lambda ids, i=i: on_tokens(i, ids)) if on_tokens else None
            requests.append(make_request(self, prompt, params.for_sample(i), sink, warn=i == 0,
                                         shares_prefill_with=first))
        handles = [RequestHandle(r, self, OutputProcessor(self.tokenizer, r, p, stream_text))
                   for r, p in zip(requests, prompts)]
        for handle in handles:
            self._queue(handle, batched=len(requests) > 1)
        return handles

    def close(self) -> None:
        """Stop the engine thread; requests still in flight or waiting end as cancelled."""
        with self._submitting:
            engine, self._engine = self._engine, None
            edge, self._edge = self._edge, None
        if engine is not None:
            engine.close()
        if edge is not None:
            edge.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the engine thread ------------------------------------------------------------------------
    def _queue(self, handle, batched: bool | None = None) -> None:
        """Hand a checked request to the engine thread, its tokens routed through the edge to its handle.
        batched: whether it will run alongside others (default: whether others are in flight now)."""
        request = handle.request
        with self._submitting:  # threads submitting at once must not start two engines on one scheduler
            self._load_graphs(request, not self.scheduler.idle if batched is None else batched)
            if self._edge is None:
                self._edge = Edge()
            self._edge.attach(request, handle, handle.output)
            request.submitted = time.perf_counter()  # its latency counts from here: loads are the runtime's
            if self._engine is None:
                self._engine = EngineThread(self.scheduler)
            self._engine.submit(request)

    # -- Medusa trees ----------------------------------------------------------------------------
    def set_tree(self, tree) -> None:
        """The token tree Medusa requests verify: a TokenTree, "chain" (the heads' top-1 candidates,
        as deep as there are heads), a number of nodes (the root included; grown from the heads'
        accuracies) or None (sized by measured cost now: tree_sizing.py, as load() does). Only while idle."""
        if self.tree_sizing is None:
            raise SpecCompileError("token trees need a bundle built with --medusa")
        if not self.scheduler.idle:
            raise SpecCompileError("the token tree can only change while no request is in flight")
        self.tree_sizing.set(tree)

    def _load_graphs(self, request: Request, batched: bool) -> None:
        """Load every graph a request can run before it is queued (no iteration times a session load): the
        single-sequence variants, and the batched ones when it will share the engine (later, on first use)."""
        sample = not request.params.greedy
        key = request.gamma, sample, batched, request.prompt_logprobs is not None
        if key in self._loaded:
            return
        batches = (1, self.max_batch) if batched else (1,)
        target = [GraphId.step("target", sample=sample)] + ([GraphId.score()] if request.prompt_logprobs is not None
                                                            else [])
        if request.proposer.tree:
            target += [GraphId.tree_verification(typical=False)]
            target += [GraphId.tree_verification(typical=True)] if request.acceptance_rule == "typical" else []
        elif request.gamma != 0:
            gammas = self.gammas if request.gamma == AUTO else [request.gamma]
            target += [GraphId.verification(g, sample=sample) for g in gammas]
            for batch in batches if self.draft is not None else ():
                self.draft.load_graphs([GraphId.step("draft", sample=sample), GraphId.step("draft", sample=False)],
                                       batch)
            for batch in batches if sample and self.eagle is not None and self.bundle.eagle_samples else ():
                self.eagle.load_graphs([GraphId.eagle_catch_up(sample=True), GraphId.eagle_step(sample=True)], batch)
        for batch in batches:
            self.target.load_graphs(target + [GraphId.step("target", sample=False)], batch)
        self._loaded.add(key)

    def compile_constraint(self, **constraint) -> None:
        """Compile a constraint (json_schema=, regex=, ...: as `submit` takes them) into the grammar
        cache, so that a request asking for it starts at once; SpecCompileError if it does not compile."""
        made = Constraint.of(**constraint)
        if made is not None:  # e.g. json_object=False: none asked for
            self.grammars().start(made)

    def grammars(self) -> GrammarEngine:
        """The grammar engine of this bundle's tokenizer (core/grammar.py), made on first use (~50 ms)."""
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = GrammarEngine(self.tokenizer.directory / "tokenizer.json", self.target.vocab_size,
                                               self.tokenizer.eos_token_ids)
            return self._grammars

    def check_gamma(self, gamma: int | str | None) -> None:
        """Raise SpecCompileError unless requests may ask for this γ (None: the default)."""
        request_gamma(self.gammas, None, gamma)

    def check_token_ids(self, ids) -> list[int]:
        """Token ids as ints, or SpecCompileError naming the first outside the vocabulary."""
        return token_ids(self, ids)


def _request_of(handle) -> Request | None:
    return handle.request if handle is not None else None


def load(bundle_dir, backend: str = "auto", threads: int | None = None, shared_threads: bool | None = None,
         one_session: bool | None = None, prefill_chunk: int = 64, max_batch: int | None = None) -> Runtime:
    """bundle_dir: the bundle's directory, or the Bundle opened from it. backend: "onnxruntime",
    "tensorrt" (the bundle's engines; needs TensorRT here), or "auto" (the default: the engines where
    the bundle has them and TensorRT is installed, else ONNX Runtime, saying so in one line when the
    engines go unused). one_session (ONNX Runtime): run each model's every call on its one session
    graph, holding one copy of its weights (True), or a session per graph, faster for small models
    (False). Default: one session from a target of 256 MiB of weights up, its draft with it
    (onnxruntime_engine.runs_one_session)."""
    bundle = bundle_dir if isinstance(bundle_dir, Bundle) else open_bundle(Path(bundle_dir))
    return Runtime(bundle, backend=resolve_backend(bundle, backend), threads=threads, shared_threads=shared_threads,
                   one_session=one_session, prefill_chunk=prefill_chunk, max_batch=max_batch)
