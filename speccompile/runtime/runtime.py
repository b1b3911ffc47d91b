"""`Runtime`: load a bundle, validate requests, and serve them on the continuous-batching scheduler.

Requests are served by one engine thread that runs the scheduler (core/scheduler.py), started on
first use: `submit` (thread-safe) returns a handle at once; `generate` is a client that submits a
list of prompts and waits for them. Everything a request needs is checked before it is queued, so a
bad request raises in its caller's thread and never disturbs the ones in flight. Tokens leave the
engine through the edge (edge.py), whose thread matches stop strings. The γ policies and their
calibration live in policies.py, a Medusa bundle's tree sizing in tree_sizing.py; both measure at
load, before any request is served.
"""

import asyncio
import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speccompile.bundle import TOP_LOGPROBS, Bundle, GraphId, open_bundle
from speccompile.core.grammar import Constraint, GrammarEngine
from speccompile.core.processors import Processors, ProcessorState
from speccompile.core.proposers import DEFAULT_PROPOSER, Proposers, TreeShape
from speccompile.core.proposers.draft_model import DraftRunner
from speccompile.core.request import AUTO, SAMPLING_RULES, Request
from speccompile.core.sampling import SamplingParams
from speccompile.core.scheduler import Scheduler
from speccompile.core.stats import GenerationStats
from speccompile.core.tree import ACCEPTANCE_RULES
from speccompile.errors import SpecCompileError
from speccompile.runtime.edge import Edge, StopWatcher
from speccompile.runtime.handles import AsyncRequestHandle, EngineThread, RequestHandle
from speccompile.runtime.policies import LoadPolicies
from speccompile.runtime.tokenizer import Tokenizer
from speccompile.runtime.tree_sizing import TreeSizing

MODES = ("speculative", "autoregressive")
log = logging.getLogger("speccompile")


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


class Runtime:
    def __init__(self, bundle: Bundle, backend: str = "onnxruntime", threads: int | None = None,
                 shared_threads: bool | None = None, one_session: bool | None = None, prefill_chunk: int = 64,
                 max_batch: int | None = None):
        """max_batch: requests decoding at once, at most the bundle's (default: the bundle's).
        shared_threads (ONNX Runtime): run both models on one process-wide thread pool, which binds
        every other ONNX Runtime session in the process (see onnxruntime_engine.shared_thread_pool).
        The default, pools per session whose threads are released at the end of every run
        (onnxruntime_engine.session_options), is as fast on the demo pair and binds nothing. A
        process that has the pool uses it either way. prefill_chunk: prompt tokens prefilled per
        iteration while other requests decode (see core/scheduler.py)."""
        self.bundle, self.backend = bundle, backend
        if backend == "onnxruntime":
            from speccompile.runtime.onnxruntime_engine import OrtModel, shared_thread_pool

            shared = shared_thread_pool(threads, create=bool(shared_threads))
            # Both models on every core: a pool releases its threads when its run ends, so the draft's
            # no longer competes with the target's (a real-size draft ran at half speed on one thread:
            # the 1.1B pair's 2-layer draft, 7.0-8.0 ms a step against 4.7 on two).
            self.target = OrtModel(bundle, "target", threads=threads, shared_pool=shared, one_session=one_session)
            self.draft = OrtModel(bundle, "draft", threads=threads, shared_pool=shared,
                                  one_session=one_session) if bundle.has_draft else None
        elif backend == "tensorrt":
            from speccompile.runtime.tensorrt_engine import TrtModel

            self.target = TrtModel(bundle, "target")
            self.draft = TrtModel(bundle, "draft") if bundle.has_draft else None
        else:
            raise SpecCompileError(f"unknown backend {backend!r} (available: onnxruntime, tensorrt)")
        self.tokenizer = Tokenizer(bundle.path / bundle.manifest["tokenizer"]["dir"], bundle.manifest["tokenizer"])
        self._grammars: GrammarEngine | None = None
        self._grammar_lock = threading.Lock()
        self.max_seq, self.default_gamma = bundle.max_seq, bundle.default_gamma
        self.max_batch = bundle.max_batch if max_batch is None else max_batch
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or \
                not 1 <= self.max_batch <= bundle.max_batch:
            raise SpecCompileError(f"max_batch must be 1..{bundle.max_batch} (the bundle's), got {max_batch!r}")
        from speccompile.runtime.gamma_profile import find_profile
        from speccompile.runtime.hardware import fingerprint

        self.fingerprint = fingerprint(backend)
        self.profile = find_profile(bundle.path, self.fingerprint)  # measured on this hardware and backend, if any
        self.policies = LoadPolicies(self.profile, self.gammas, self.max_batch, self.max_seq)
        shape = TreeShape() if bundle.medusa else None
        self.tree_sizing = TreeSizing(bundle, self.target, backend, self.max_batch, shape) if shape else None
        self.proposers = Proposers(DraftRunner(self.draft, self.max_seq) if self.draft is not None else None, shape,
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
            timed = self.policies.needs_calibration and self.policies.calibrate(self.target, self.draft, bundle.path,
                                                                                self.fingerprint)
            self.warm_up(engines=not timed)  # timing the steps ran every graph already

    @property
    def gammas(self) -> list[int]:
        return self.bundle.gammas

    def warm_up(self, batched: bool = False, engines: bool = True) -> None:
        """Load the graphs a default request runs (greedy, γ auto) and run each once (engines), at
        batch 1 and, if batched, at the bundle's max batch too; then serve one short request (a batch
        of them, if batched) and forget it: the first user's request pays neither for opening
        sessions nor for the loop's first runs (demo pair: without the request, its TTFT was 1.3-2x
        a later one's; with it, 1.0-1.2x). load() warms batch 1; a server warms the batched graphs
        too. Only while idle."""
        if not self.scheduler.idle:
            raise SpecCompileError("a runtime can only warm up while no request is in flight")
        if self.tree_sizing is not None:  # a Medusa bundle: its sizing ran the tree verification
            return
        from speccompile.runtime.calibration import warm_up

        request = Request([0], 1, gamma=AUTO, proposer=DEFAULT_PROPOSER)
        self.scheduler.proposer(request)
        self._load_graphs(request, batched)
        for batch in (sorted({1, self.max_batch}) if batched else (1,)) if engines else ():
            warm_up(self.target, self.draft, self.gammas, batch, context=min(64, self.max_seq // 4))  # a chunk
        prompt = [token % self.target.vocab_size for token in range(1, 1 + min(8, self.max_seq // 4))]
        self.generate([prompt] * (self.max_batch if batched else 1), max_new_tokens=2, ignore_eos=True)
        self.forget()

    def forget(self) -> None:
        """Back to what a fresh load knows: finished requests' outputs (suffix decoding's cache)
        and what the γ policies learned are forgotten; measured priors (profile, calibration) stay.
        Only while idle. What `bench` does before each measured run, so that none learns from another."""
        if not self.scheduler.idle:
            raise SpecCompileError("a runtime can only forget while no request is in flight")
        self.proposers.forget_outputs()
        self.policies.forget()

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
        """What speculates here, for a client to see: the compiled γ, the default (γ auto, priors from
        a γ profile of this hardware or from the calibration at load), the proposers a
        request may ask for, the draft model's and Medusa heads' presence, the sampling rules."""
        return {"gammas": self.gammas, "default_gamma": "auto", "gamma_profile": self.profile is not None,
                "proposers": self.proposers.available(),
                "default_proposer": DEFAULT_PROPOSER, "draft_model": self.draft is not None,
                "medusa_heads": self.bundle.medusa["num_heads"] if self.bundle.medusa else 0,
                "sampling_rules": list(SAMPLING_RULES), "backend": self.backend}

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed=None, stop: list[str] | None = None, stop_token_ids=(), gamma: int | str | None = None,
               mode: str | None = None, on_tokens=None, proposer: str = DEFAULT_PROPOSER,
               p_min: float | None = None, acceptance: str = "exact",
               sampling_rule: str | None = None, ignore_eos: bool = False, same_prompt_as=None,
               **controls) -> "RequestHandle":
        """Queue one request (a string or token ids) and return its handle at once. Thread-safe.

        gamma: a compiled γ (at most that many drafts per iteration), 0 (plain decoding), or "auto"
        (None, the default: the policy picks γ each iteration for the current load, and each row's
        offer runs only where it beats a plain step: core/gamma_policy.py). mode "autoregressive"
        decodes with the target alone; "speculative" never lets auto choose plain decoding.
        temperature 0 is greedy; otherwise tokens are sampled exactly from the target's
        distribution after temperature, top-k (0: off) and top-p (1: off),
        from the request's own random stream (`seed`). sampling_rule "coupled" (the default with a
        seed) makes a seeded request's tokens the same whatever γ, proposer or company, equal to the
        target's own seeded sampling; "rejection" (the default without one) is Leviathan et al.'s
        rule, whose acceptance is higher (core/acceptance.py, core/request.py).
        stop: strings that end the text (excluded from it); stop_token_ids end it like EOS;
        ignore_eos: generate past the model's EOS token (to max_new_tokens or a stop).
        controls, the OpenAI and vLLM parameters (core/processors.py): presence_penalty,
        frequency_penalty, repetition_penalty, logit_bias ({token id: bias}), min_p, min_tokens
        change the target's distribution, and the draft's alike, so the output stays exactly the
        processed target's; logprobs=K reports each generated token's log-probability under the
        distribution it was drawn from and the K (<= 20) most likely tokens' (result.logprobs);
        prompt_logprobs=K each prompt token's after the first (result.prompt_logprobs, echo).
        Log-probabilities come from the target's own pass: the same with speculation or without.
        Structured output (core/grammar.py), at most one of: json_schema (a dict or its JSON text),
        json_object=True (any JSON object), regex, choice (a list of strings), grammar (Lark, or
        llama.cpp's GBNF): the text is generated under the constraint, the draft's proposals and the
        target's every scored position alike, so speculation stays on and the output is exactly the
        target's constrained distribution; a constraint that does not compile raises SpecCompileError.
        same_prompt_as: the handle of an earlier request of the same prompt (another of n samples):
        this one copies its cached prompt instead of prefilling it again.
        on_tokens(token_ids) is called as tokens are accepted, from the engine thread (from the
        runtime's edge thread for a request with stop strings).
        proposer: who drafts, one of core/proposers' kinds: "draft" (the draft model), "ngram"
        (prompt lookup in the request's own text), "suffix" (suffix decoding over its text and
        earlier outputs) or "auto" (per iteration, the one predicted fastest). p_min: the draft model
        stops drafting at a token it gives less probability than this (confidence thresholding; 0:
        never; default: the threshold the γ profile measured on this hardware, else 0). On a Medusa
        bundle the heads propose a token tree ("medusa", or "auto"); acceptance "typical" (Medusa
        bundles only) accepts plausible tokens the target would not have chosen: faster,
        approximate, never the default."""
        request = self._request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, stop_token_ids, gamma,
                                mode, on_tokens, proposer=proposer, p_min=p_min, acceptance=acceptance,
                                sampling_rule=sampling_rule, ignore_eos=ignore_eos,
                                shares_prefill_with=same_prompt_as.request if same_prompt_as else None, **controls)
        handle = RequestHandle(request, self, prompt, _stop_strings(stop))
        self._queue(handle)
        return handle

    def submit_async(self, prompt, on_finish=None, **kwargs) -> "AsyncRequestHandle":
        """`submit` for asyncio code: call it in the event loop; await `.result()`, iterate
        `async for tokens in handle.stream()`. on_finish(request) is called when the request ends,
        however it ends (from the thread its tokens came from)."""
        handle = AsyncRequestHandle(asyncio.get_running_loop(), self, prompt, _stop_strings(kwargs.get("stop")))
        handle.user_sink, handle.user_finish = kwargs.pop("on_tokens", None), on_finish
        same_prompt_as = kwargs.pop("same_prompt_as", None)
        handle.request = self._request(prompt, shares_prefill_with=same_prompt_as.request if same_prompt_as else None,
                                       **kwargs)
        self._queue(handle)
        return handle

    def generate(self, prompts, max_new_tokens: int = 64, mode: str | None = None, gamma: int | str | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 on_tokens=None, stop: list[str] | None = None, proposer: str = DEFAULT_PROPOSER,
                 p_min: float | None = None, acceptance: str = "exact", sampling_rule: str | None = None,
                 stop_token_ids=(), ignore_eos: bool = False, n: int = 1, **controls) -> list[GenerationResult]:
        """Generate for a list of prompts (strings or token-id lists); n results per prompt (n samples
        of it, the first of them prefills the prompt and the others copy its cache), in order.

        Each sample is one request (see `submit`); all are checked before any is queued. Sample i
        draws from its own random stream, spawned from `seed` by its index. on_tokens(i, token_ids)
        is called as tokens are accepted, for streaming. Each result's stats are its own request's
        (see core/stats.py)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or (
                prompts and isinstance(prompts[0], int)):
            raise SpecCompileError("prompts must be a list of strings or a list of token-id lists")
        if not prompts:
            raise SpecCompileError("no prompts given")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SpecCompileError(f"n must be a positive integer, got {n!r}")
        prompts = [p for p in prompts for _ in range(n)]
        seeds = np.random.SeedSequence(_seed(seed)).spawn(len(prompts))
        sampling_rule = sampling_rule or default_sampling_rule(seed)  # by the caller's seed, not the spawned ones
        requests = []
        for i, (p, s) in enumerate(zip(prompts, seeds)):
            requests.append(self._request(p, max_new_tokens, temperature, top_k, top_p, s, stop, stop_token_ids, gamma,
                                          mode, (lambda ids, i=i: on_tokens(i, ids)) if on_tokens else None,
                                          warn=i == 0, proposer=proposer, p_min=p_min, acceptance=acceptance,
                                          sampling_rule=sampling_rule, ignore_eos=ignore_eos,
                                          shares_prefill_with=requests[i - i % n] if i % n else None, **controls))
        handles = [RequestHandle(r, self, p, _stop_strings(stop)) for r, p in zip(requests, prompts)]
        for handle in handles:
            self._queue(handle, batched=len(requests) > 1)
        return [h.result() for h in handles]

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

    def result(self, request: Request, prompt, stops: list[str] = ()) -> GenerationResult:
        """A finished request's result; `prompt` as the caller gave it. A stop string found at the
        edge after the engine had already ended the request still cuts it (tokens and text)."""
        tokens, reason = list(request.generated), request.finish_reason
        if request.stop_keep is not None and request.error is None:
            tokens, reason = tokens[: request.stop_keep], "stop"
        text = self.tokenizer.decode_continuation(request.prompt, tokens)
        cut = _before_stop(text, list(stops))
        request.stats.new_tokens = len(tokens)
        logprobs = request.token_logprobs[: len(tokens)] if request.logprobs is not None else None
        prompt_logprobs = request.prompt_scores if request.prompt_logprobs is not None else None
        return GenerationResult(prompt, tokens, text if cut is None else cut, request.stats, reason, logprobs,
                                prompt_logprobs)

    # -- the engine thread ------------------------------------------------------------------------
    def _queue(self, handle, batched: bool | None = None) -> None:
        """Hand a checked request to the engine thread, its tokens routed through the edge to its
        handle. batched: whether it will run alongside others (default: whether others are in
        flight now)."""
        request = handle.request
        with self._submitting:  # threads submitting at once must not start two engines on one scheduler
            self._load_graphs(request, not self.scheduler.idle if batched is None else batched)
            if self._edge is None:
                self._edge = Edge()
            watcher = StopWatcher(self.tokenizer, request.prompt, handle.stops) if handle.stops else None
            self._edge.attach(request, handle, watcher)
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
        """Load every graph a request can run before it is queued, so that no iteration times a
        session load: the single-sequence variants, and the batched graphs when it will share the
        engine (if the load grows later, those load on first use)."""
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
        for batch in batches:
            self.target.load_graphs(target + [GraphId.step("target", sample=False)], batch)
        self._loaded.add(key)

    # -- validation ---------------------------------------------------------------------------
    def _request(self, prompt, max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=None,
                 stop_token_ids=(), gamma=None, mode=None, on_tokens=None, warn: bool = True,
                 proposer: str = DEFAULT_PROPOSER, p_min: float | None = None, acceptance: str = "exact",
                 sampling_rule: str | None = None, ignore_eos: bool = False, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repetition_penalty: float = 1.0, logit_bias: dict | None = None,
                 min_p: float = 0.0, min_tokens: int = 0, logprobs: int | None = None,
                 prompt_logprobs: int | None = None, shares_prefill_with: Request | None = None,
                 json_schema=None, grammar=None, regex=None, choice=None, json_object: bool = False) -> Request:
        self.proposers.check(proposer)
        constraint = grammar if isinstance(grammar, Constraint) else Constraint.of(json_schema, grammar, regex, choice,
                                                                                   json_object)
        seed = _seed(seed)
        processors = Processors(presence_penalty, frequency_penalty, repetition_penalty,
                                tuple(sorted(_logit_bias(logit_bias).items())), min_tokens, min_p)
        # beyond the context, min_tokens bans EOS for the whole request either way: the graphs take int64
        processors = dataclasses.replace(processors, min_tokens=min(processors.min_tokens, self.max_seq))
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= TOP_LOGPROBS):
                raise SpecCompileError(f"{name} must be an integer in [0, {TOP_LOGPROBS}], got {value!r}")
        sampling_rule = sampling_rule or default_sampling_rule(seed)
        self._check_tree_rules(acceptance, temperature)
        if sampling_rule not in SAMPLING_RULES:
            raise SpecCompileError(f"sampling_rule must be one of {', '.join(SAMPLING_RULES)}, not {sampling_rule!r}")
        if p_min is None:
            p_min = self.profile.p_min if self.profile is not None else 0.0
        if isinstance(p_min, bool) or not isinstance(p_min, (int, float)) or not 0.0 <= p_min <= 1.0:
            raise SpecCompileError(f"p_min must be a probability in [0, 1], got {p_min!r}")
        params = self._sampling(temperature, top_k, top_p)
        if warn:
            for name in params.without_effect():
                log.warning(f"warning: {name} has no effect at temperature 0 (greedy decoding); "
                            "set a temperature to sample")
        made = self.proposers.make(proposer, float(p_min))
        if made.tree and (processors.active or logprobs is not None or prompt_logprobs is not None):
            raise SpecCompileError("Medusa tree verification applies no logits processors (penalties, logit_bias, "
                                   "min_p, min_tokens) and reports no log-probabilities: use a chain proposer")
        if made.tree:
            gamma, allow_plain = self._medusa_gamma(mode, gamma)
        else:
            gamma, allow_plain = self._request_gamma(mode, gamma, warn)
        ids = self._tokens(prompt)
        if max_new_tokens is None:  # as vLLM: what the context has left (here, beside its longest verification)
            max_new_tokens = max(1, self.max_seq - len(ids) - (max(self.gammas) if gamma == AUTO else gamma))
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
            raise SpecCompileError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        _stop_strings(stop)
        request = Request(ids, max_new_tokens, params, seed, gamma, allow_plain,
                          frozenset(self._token_ids(stop_token_ids)), on_tokens=on_tokens, proposer=made,
                          p_min=float(p_min), sampling_rule=sampling_rule, acceptance_rule=acceptance,
                          ignore_eos=bool(ignore_eos), processors=processors, logprobs=logprobs,
                          prompt_logprobs=prompt_logprobs, shares_prefill_with=shares_prefill_with)
        if processors.active:
            request.processing = ProcessorState.start(processors, ids, self.target.vocab_size,
                                                      self.tokenizer.eos_token_ids | request.stop_token_ids)
        if constraint is not None:
            request.grammar = self.grammars().start(constraint)
        if not self.scheduler.fits(request):
            cap = self.scheduler.gamma_cap(request)
            raise SpecCompileError(
                f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens + γ={cap} exceeds the bundle's "
                f"max sequence length {self.max_seq} (rebuild with a larger --max-seq, or ask for fewer tokens)")
        return request

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

    def _sampling(self, temperature, top_k, top_p) -> SamplingParams:
        """The sampling controls, checked, in the graphs' ranges: a temperature below 1e-5 is greedy
        (as vLLM's: float32 would round it to 0 anyway), a top_k past the vocabulary keeps it all."""
        for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
            if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
                raise SpecCompileError(f"{name} must be a number, got {value!r}")
        if isinstance(top_k, float) and not top_k.is_integer():
            raise SpecCompileError(f"top_k must be an integer, got {top_k!r}")
        temperature = 0.0 if 0 < temperature < 1e-5 else float(temperature)
        return SamplingParams(temperature, int(min(top_k, self.target.vocab_size)), float(top_p))

    def _check_tree_rules(self, acceptance: str, temperature) -> None:
        """Typical acceptance only on a Medusa bundle, and a Medusa bundle's trees greedy only (tree
        sampling would need a multi-candidate rule such as SpecInfer's to stay exact, which
        speccompile does not implement)."""
        if acceptance not in ACCEPTANCE_RULES:
            raise SpecCompileError(f"acceptance must be one of {', '.join(ACCEPTANCE_RULES)}, not {acceptance!r}")
        if self.tree_sizing is None and acceptance != "exact":
            raise SpecCompileError("typical acceptance needs a bundle built with --medusa (Medusa heads and "
                                   "token-tree verification)")
        if self.tree_sizing is not None and temperature:
            raise SpecCompileError("Medusa tree verification is greedy only (temperature 0): sampling from a tree "
                                   "exactly needs a multi-candidate rule; typical acceptance is the approximate one")

    def _medusa_gamma(self, mode, gamma) -> tuple[int | str, bool]:
        """A Medusa request's γ: the whole tree (AUTO, the default: it was sized by measured cost), or
        at most that many tokens accepted per verification (1..heads), or 0 / autoregressive: plain."""
        if mode == "autoregressive" or gamma == 0:
            return 0, False
        if gamma is None or gamma == AUTO:
            return AUTO, False
        heads = self.bundle.medusa["num_heads"]
        if isinstance(gamma, bool) or not isinstance(gamma, int) or not 1 <= gamma <= heads:
            raise SpecCompileError(f"γ={gamma!r}: a Medusa request accepts 1..{heads} tokens per verification "
                                   "(its heads), or \"auto\" for the whole tree")
        return gamma, False

    def check_gamma(self, gamma: int | str | None) -> None:
        """Raise SpecCompileError unless requests may ask for this γ (None: the default)."""
        self._request_gamma(None, gamma, warn=False)

    def _request_gamma(self, mode, gamma, warn: bool) -> tuple[int | str, bool]:
        """(γ: a compiled γ, AUTO or 0 for plain decoding; may AUTO choose plain decoding)."""
        if mode is not None and mode not in MODES:
            raise SpecCompileError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if mode == "autoregressive":
            if gamma is not None and warn:
                log.warning(f"warning: gamma={gamma} has no effect in autoregressive mode (the target decodes alone)")
            return 0, False
        if gamma is None:
            gamma = AUTO
        if gamma == AUTO:
            return AUTO, mode is None  # an explicit mode is never overridden
        if gamma == 0 and not isinstance(gamma, bool) and mode is None:  # plain decoding, asked for by γ
            return 0, False
        if isinstance(gamma, bool) or gamma not in self.gammas:
            raise SpecCompileError(f"γ={gamma} was not compiled into this bundle "
                                   f"(compiled: {', '.join(map(str, self.gammas))}, or \"auto\")")
        return int(gamma), False

    def _tokens(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise SpecCompileError(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}")
        ids = self._token_ids(prompt)
        if not ids:
            raise SpecCompileError("empty prompt")
        return ids

    def check_token_ids(self, ids) -> list[int]:
        """Token ids as ints, or SpecCompileError naming the first outside the vocabulary."""
        return self._token_ids(ids)

    def _token_ids(self, ids) -> list[int]:
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
            raise SpecCompileError("token ids must be integers")
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise SpecCompileError(f"token id {bad[0]} is outside the vocabulary (0..{self.target.vocab_size - 1})")
        return [int(t) for t in ids]


def _seed(seed):
    """A seed as the random streams take it: any integer (a negative one, as vLLM's seeds may be, is
    taken modulo 2**64), a SeedSequence, or None."""
    if seed is None or isinstance(seed, np.random.SeedSequence):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise SpecCompileError(f"seed must be an integer, got {seed!r}")
    return int(seed) % 2**64


def _logit_bias(bias) -> dict[int, float]:
    """OpenAI's logit_bias: token ids (JSON gives them as strings) to a bias."""
    if bias is None:
        return {}
    if not isinstance(bias, dict):
        raise SpecCompileError("logit_bias must map token ids to biases")
    try:
        return {int(token): float(value) for token, value in bias.items()}
    except (TypeError, ValueError):
        raise SpecCompileError("logit_bias must map token ids to numbers") from None


def default_sampling_rule(seed) -> str:
    """A seeded request is verified by the coupled rule, whose tokens its seed fixes whatever the load;
    an unseeded one by rejection sampling, which keeps more drafts (on the demo pair at temperature
    1.0, acceptance 0.64 against 0.56: tools/measure_sampling_rules.py)."""
    return "coupled" if seed is not None else "rejection"


def _before_stop(text: str, stops: list[str]) -> str | None:
    """The text before the earliest stop string; None when there is none, and the text itself when
    there are no stop strings at all."""
    if not stops:
        return text
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(found)] if found else None


def _stop_strings(stop) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if not all(isinstance(s, str) and s for s in stops):
        raise SpecCompileError("stop must be a non-empty string or a list of non-empty strings")
    return stops


BACKENDS = ("auto", "onnxruntime", "tensorrt")


def load(bundle_dir, backend: str = "auto", threads: int | None = None, shared_threads: bool | None = None,
         one_session: bool | None = None, prefill_chunk: int = 64, max_batch: int | None = None) -> Runtime:
    """backend: "onnxruntime", "tensorrt" (the bundle's engines; needs TensorRT here), or "auto" (the
    default: the engines where the bundle has them and TensorRT is installed, else ONNX Runtime, saying
    so in one line when the engines go unused). one_session (ONNX Runtime): run each model's every
    call on its one session graph, holding one copy of its weights (True), or a session per graph,
    faster for small models (False). Default: per model, one session from 256 MiB of weights up
    (onnxruntime_engine.ONE_SESSION_MIN_BYTES)."""
    bundle = open_bundle(Path(bundle_dir))
    return Runtime(bundle, backend=resolve_backend(bundle, backend), threads=threads, shared_threads=shared_threads,
                   one_session=one_session, prefill_chunk=prefill_chunk, max_batch=max_batch)


def resolve_backend(bundle: Bundle, backend: str) -> str:
    if backend not in BACKENDS:
        raise SpecCompileError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend != "auto":
        return backend
    if "engines" not in bundle.manifest:
        return "onnxruntime"
    from speccompile.tensorrt_setup import require_tensorrt

    try:
        require_tensorrt()
    except SpecCompileError as missing:
        log.warning(f"{bundle.path} has TensorRT engines, which cannot run here ({missing}): running its ONNX "
                    "graphs on ONNX Runtime")
        return "onnxruntime"
    return "tensorrt"
