"""`Runtime`: load a bundle, validate requests, and serve them on the continuous-batching scheduler.

Requests are served by one engine thread that runs the scheduler (core/scheduler.py), started on
first use: `submit` (thread-safe) returns a handle at once; `generate` is a client that submits a
list of prompts and waits for them. Everything a request needs is checked before it is queued, so a
bad request raises in its caller's thread and never disturbs the ones in flight.
"""

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speccompile.bundle import Bundle, GraphId, open_bundle
from speccompile.core.gamma_policy import GammaPolicy
from speccompile.core.proposers import DEFAULT_PROPOSER, PROPOSERS
from speccompile.core.request import AUTO, Request
from speccompile.core.sampler import SamplingParams
from speccompile.core.scheduler import Scheduler
from speccompile.core.stats import GenerationStats
from speccompile.core.tree import (
    ACCEPTANCE_RULES,
    MAX_TREE_NODES,
    TREE_SIZES,
    TokenTree,
    best_tree,
    grow_tree,
    measured_paths,
)
from speccompile.errors import SpecCompileError
from speccompile.runtime.tokenizer import Tokenizer

MODES = ("speculative", "autoregressive")
log = logging.getLogger("speccompile")


@dataclass
class GenerationResult:
    prompt: str | list[int]
    token_ids: list[int]  # generated tokens only (EOS or a stop token included when generated)
    text: str  # their text, ending before a stop string (as OpenAI's)
    stats: GenerationStats
    finish_reason: str = "length"  # "stop" (EOS, stop token or string), "length", "cancelled"

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
        self.max_seq, self.default_gamma = bundle.max_seq, bundle.default_gamma
        self.max_batch = bundle.max_batch if max_batch is None else max_batch
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or \
                not 1 <= self.max_batch <= bundle.max_batch:
            raise SpecCompileError(f"max_batch must be 1..{bundle.max_batch} (the bundle's), got {max_batch!r}")
        from speccompile.runtime.gamma_profile import find_profile
        from speccompile.runtime.hardware import fingerprint

        self.profile = find_profile(bundle.path, fingerprint(backend))  # measured on this hardware and backend, if any
        self._policies: dict[tuple, GammaPolicy] = {}  # (decoding requests, context point) -> γ policy
        self._calibration: dict | None = None  # step costs measured here when no profile matches
        self.scheduler = Scheduler(self.target, self.draft, self.max_batch, self.max_seq, self.gammas,
                                   self.tokenizer.eos_token_ids, self._policy_for_load, self.profile is not None,
                                   prefill_chunk, fallback_gamma=self.default_gamma)
        self._engine: _EngineThread | None = None
        self._submitting = threading.Lock()  # one engine thread, and graph loads one at a time, whoever submits
        self._loaded: set = set()
        self.tree_sizing: dict | None = None  # Medusa: per tree size, the prediction and measured cost it was chosen by

    @property
    def gammas(self) -> list[int]:
        return self.bundle.gammas

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, prompt, max_new_tokens: int = 64, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
               seed=None, stop: list[str] | None = None, stop_token_ids=(), gamma: int | str | None = None,
               mode: str | None = None, on_tokens=None, proposer: str = DEFAULT_PROPOSER,
               p_min: float | None = None, acceptance: str = "exact") -> "RequestHandle":
        """Queue one request (a string or token ids) and return its handle at once. Thread-safe.

        gamma: a compiled γ (at most that many drafts per iteration), "auto" (the default when a γ
        profile matches this hardware: the policy picks γ each iteration for the current load, down
        to plain decoding where speculation does not pay), or None (auto with a profile, else the
        bundle's default γ). mode "autoregressive" decodes with the target alone; "speculative"
        never lets auto choose plain decoding. temperature 0 is greedy; otherwise tokens are sampled
        exactly from the target's distribution after temperature, top-k (0: off) and top-p (1: off),
        from the request's own random stream (`seed`). stop: strings that end the text (excluded from
        it); stop_token_ids end it like EOS. on_tokens(token_ids) is called from the engine thread as
        tokens are accepted. proposer: who drafts, "draft" (the draft model), "ngram" (prompt lookup
        in the request's own text) or "auto" (per iteration, the one predicted faster): see
        core/proposers.py. p_min: the draft model stops drafting at a token it gives less
        probability than this (confidence thresholding; 0: never; default: the threshold the γ
        profile measured on this hardware, else 0). On a Medusa bundle the heads propose a token
        tree (proposer "medusa", or "auto"); acceptance "typical" (Medusa bundles only) accepts
        plausible tokens the target would not have chosen: faster, approximate, never the default."""
        handle = RequestHandle(self._request(prompt, max_new_tokens, temperature, top_k, top_p, seed, stop,
                                             stop_token_ids, gamma, mode, on_tokens, proposer=proposer, p_min=p_min,
                                             acceptance=acceptance),
                               self, prompt)
        self._queue(handle.request)
        return handle

    def submit_async(self, prompt, on_finish=None, **kwargs) -> "AsyncRequestHandle":
        """`submit` for asyncio code: call it in the event loop; await `.result()`, iterate
        `async for tokens in handle.stream()`. on_finish(request) is called from the engine thread
        when the request ends, however it ends."""
        handle = AsyncRequestHandle(asyncio.get_running_loop(), self, prompt)
        user_sink = kwargs.pop("on_tokens", None)
        handle.request = self._request(prompt, on_tokens=handle._push, **kwargs)
        handle.request.on_finish = handle._finished
        handle.user_sink, handle.user_finish = user_sink, on_finish
        self._queue(handle.request)
        return handle

    def generate(self, prompts, max_new_tokens: int = 64, mode: str | None = None, gamma: int | str | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 on_tokens=None, stop: list[str] | None = None, proposer: str = DEFAULT_PROPOSER,
                 p_min: float | None = None, acceptance: str = "exact") -> list[GenerationResult]:
        """Generate for a list of prompts (strings or token-id lists); one result per prompt, in order.

        Each prompt is one request (see `submit`); all are checked before any is queued. Prompt i
        samples from its own random stream, spawned from `seed` by its index. on_tokens(i, token_ids)
        is called as tokens are accepted, for streaming. Each result's stats are its own request's
        (see core/stats.py)."""
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or (
                prompts and isinstance(prompts[0], int)):
            raise SpecCompileError("prompts must be a list of strings or a list of token-id lists")
        if not prompts:
            raise SpecCompileError("no prompts given")
        seeds = np.random.SeedSequence(seed).spawn(len(prompts))
        requests = [self._request(p, max_new_tokens, temperature, top_k, top_p, s, stop, (), gamma, mode,
                                  (lambda ids, i=i: on_tokens(i, ids)) if on_tokens else None, warn=i == 0,
                                  proposer=proposer, p_min=p_min, acceptance=acceptance)
                    for i, (p, s) in enumerate(zip(prompts, seeds))]
        handles = [RequestHandle(r, self, p) for r, p in zip(requests, prompts)]
        for request in requests:
            self._queue(request, batched=len(requests) > 1)
        return [h.result() for h in handles]

    def close(self) -> None:
        """Stop the engine thread; requests still in flight or waiting end as cancelled."""
        with self._submitting:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def result(self, request: Request, prompt) -> GenerationResult:
        """A finished request's result; `prompt` as the caller gave it."""
        text = self.tokenizer.decode_continuation(request.prompt, request.generated)
        stops = request.stop_check.stops if isinstance(request.stop_check, _StopStrings) else []
        cut = _before_stop(text, stops)
        text = text if cut is None else cut
        return GenerationResult(prompt, list(request.generated), text, request.stats, request.finish_reason)

    # -- the engine thread ------------------------------------------------------------------------
    def _queue(self, request: Request, batched: bool | None = None) -> None:
        """Hand a checked request to the engine thread. batched: whether it will run alongside others
        (default: whether others are in flight now)."""
        with self._submitting:  # threads submitting at once must not start two engines on one scheduler
            self._load_graphs(request, not self.scheduler.idle if batched is None else batched)
            request.submitted = time.perf_counter()  # its latency counts from here: loads are the runtime's
            if self._engine is None:
                self._engine = _EngineThread(self.scheduler, self._before_step)
            self._engine.submit(request)

    def _before_step(self) -> None:
        """Runs on the engine thread between iterations: the quick calibration that a runtime
        without a profile needs, and the sizing of a Medusa bundle's tree, while no request is in
        flight (both drive the models directly)."""
        if self.scheduler.active == 0 and self.bundle.medusa and self.scheduler.tree is None:
            if any(r.proposer == "medusa" for r in self.scheduler.waiting):
                self._size_tree()
        elif self.profile is None and self._calibration is None and self.scheduler.active == 0:
            if any(r.gamma == AUTO and r.proposer != "medusa" for r in self.scheduler.waiting):  # Medusa has no γ
                self._calibrate()

    # -- Medusa trees ----------------------------------------------------------------------------
    def set_tree(self, tree) -> None:
        """The token tree Medusa requests verify: a TokenTree, "chain" (the heads' top-1 candidates,
        as deep as there are heads), a number of nodes (the root included; grown from the heads'
        accuracies) or None (sized at first use by measured cost: `_size_tree`). Only while idle."""
        if not self.bundle.medusa:
            raise SpecCompileError("token trees need a bundle built with --medusa")
        if not self.scheduler.idle:
            raise SpecCompileError("the token tree can only change while no request is in flight")
        heads, accuracy = self.bundle.medusa["num_heads"], self.bundle.medusa["top_k_accuracy"]
        if tree == "chain":
            tree = TokenTree.chain(heads)
        elif isinstance(tree, int) and not isinstance(tree, bool):
            if not 2 <= tree <= MAX_TREE_NODES:
                raise SpecCompileError(f"a token tree has 2..{MAX_TREE_NODES} nodes, not {tree}")
            tree = grow_tree(accuracy, tree - 1, self._measured_paths)
        elif tree is not None and not isinstance(tree, TokenTree):
            raise SpecCompileError(f"tree must be a TokenTree, 'chain', a number of nodes or None, not {tree!r}")
        candidates = self.bundle.medusa["candidates"]
        if tree is not None and (tree.max_depth > heads or tree.top_k() > candidates):
            raise SpecCompileError(f"this tree needs {tree.max_depth} heads and {tree.top_k()} candidates per head; "
                                   f"the bundle has {heads} heads of {candidates} candidates")
        self.scheduler.tree, self.scheduler.tree_nodes = tree, {}

    def _size_tree(self) -> None:
        """Grow trees of every size from the heads' accuracies, time each one's verification here at
        batch 1, and keep the size with the most expected tokens per millisecond (core/tree.best_tree);
        then the prefix of it each batch size verifies. Recorded in the bundle per machine
        (profiles/tree-*.json, like γ profiles), and read from there by the next process."""
        from speccompile.runtime.calibration import measure_tree_costs
        from speccompile.runtime.gamma_profile import find_tree_profile, write_tree_profile
        from speccompile.runtime.hardware import fingerprint

        fp = fingerprint(self.backend)
        recorded = find_tree_profile(self.bundle.path, fp)
        if recorded is not None:
            paths, prefixes, self.tree_sizing = recorded
            self.scheduler.tree, self.scheduler.tree_nodes = TokenTree.from_paths(paths), prefixes
            return
        accuracy = self.bundle.medusa["top_k_accuracy"]
        context = min(64, self.max_seq // 4)
        sizes = [n for n in TREE_SIZES if n + context <= self.max_seq]
        measured = self._measured_paths
        trees = {n: grow_tree(accuracy, n - 1, measured) for n in sizes}
        costs = measure_tree_costs(self.target, trees, 1, context, repeats=5)
        tree, self.tree_sizing = best_tree(accuracy, costs, measured=measured)
        log.info(f"Medusa token tree: {tree.size} nodes, depth {tree.max_depth} (expected accepted "
                 f"{tree.expected_accepted(accuracy, measured):.2f}, verification {costs[tree.size]:.2f} ms here)")
        self.scheduler.tree, self.scheduler.tree_nodes = tree, self._prefix_per_batch(tree, context)
        written = write_tree_profile(self.bundle.path, fp, tree.to_json(), self.scheduler.tree_nodes, self.tree_sizing)
        if written is not None:
            log.info(f"  recorded in {written}")

    def _prefix_per_batch(self, tree: TokenTree, context: int) -> dict[int, int]:
        """Per number of decoding requests, the prefix of the tree that pays best: every row verifies
        its own tree, so a pass grows with batch × nodes, and a larger batch affords fewer nodes each.
        The prefixes are timed at the bundle's max batch; between it and batch 1 the costs are linear."""
        from speccompile.runtime.calibration import measure_tree_costs

        if self.max_batch == 1:
            return {}
        accuracy, measured = self.bundle.medusa["top_k_accuracy"], self._measured_paths
        prefixes = {n: tree.prefix(n) for n in TREE_SIZES if n <= tree.size}
        low = measure_tree_costs(self.target, prefixes, 1, context, repeats=3)
        high = measure_tree_costs(self.target, prefixes, self.max_batch, context, repeats=3)
        chosen = {}
        for batch in range(1, self.max_batch + 1):
            w = (batch - 1) / (self.max_batch - 1)
            rate = {n: (1 + p.expected_accepted(accuracy, measured)) / ((1 - w) * low[n] + w * high[n])
                    for n, p in prefixes.items()}
            chosen[batch] = max(rate, key=rate.get)
        self.tree_sizing = {"batch_1": self.tree_sizing, "prefix_nodes_per_batch": chosen}
        return chosen

    @property
    def _measured_paths(self) -> dict:
        """How often the heads' rank paths were right, as `distill --medusa` measured (core/tree.py)."""
        return measured_paths(self.bundle.medusa.get("path_probability"))

    def _load_graphs(self, request: Request, batched: bool) -> None:
        """Load every graph a request can run before it is queued, so that no iteration times a
        session load: the single-sequence variants, and the batched graphs when it will share the
        engine (if the load grows later, those load on first use)."""
        sample = not request.params.greedy
        key = request.gamma, sample, batched
        if key in self._loaded:
            return
        batches = (1, self.max_batch) if batched else (1,)
        target = [GraphId.step("target", sample=sample)]
        if request.proposer == "medusa":
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

    # -- γ selection ---------------------------------------------------------------------------
    def _policy_for_load(self, decoding: int, context: int) -> GammaPolicy | None:
        """The γ policy for `decoding` requests at once whose mean context is `context`: with a
        profile, one policy per batch size and profiled context (the nearest), with that point's
        costs and acceptance as its prior; without one, the quick calibration's costs at this batch
        size (run `speccompile profile` for γ under load), or None before there is one (the
        scheduler then runs the bundle's default γ). Acceptance is learned from the requests served
        at that load and context."""
        if self.profile is not None:
            point = min(self.profile.context_lengths, key=lambda c: (abs(c - context), c))
            if (decoding, point) not in self._policies:
                timings, acceptance = self.profile.prior(decoding, point)
                self._policies[decoding, point] = GammaPolicy(timings, acceptance)
            return self._policies[decoding, point]
        if self._calibration is None:
            return None
        if (decoding, None) not in self._policies:
            prior = [0.5**k for k in range(1, max(self.gammas) + 1)]  # neutral, worth 2 iterations
            self._policies[decoding, None] = GammaPolicy(self._calibrated_costs(decoding), prior, prior_weight=2.0)
        return self._policies[decoding, None]

    def _calibrate(self) -> None:
        """Time the steps quickly at batch 1 and at the bundle's max batch (costs in between are
        interpolated). It drives the models directly, so only with no request in flight (it would
        overwrite their caches)."""
        from speccompile.runtime.calibration import measure_costs

        assert self.scheduler.active == 0, "calibrating with requests in flight"
        log.warning("no γ profile for this hardware in the bundle (run `speccompile profile`): calibrating quickly")
        context = min(64, self.max_seq // 4)
        self._calibration = {batch: measure_costs(self.target, self.draft, self.gammas, batch, context, repeats=3)
                             for batch in sorted({1, self.max_batch})}

    def _calibrated_costs(self, batch: int) -> dict:
        """Step costs at `batch`, linear between the two calibrated batch sizes."""
        low, high = self._calibration[1], self._calibration[self.max_batch]
        w = 0.0 if self.max_batch == 1 else (batch - 1) / (self.max_batch - 1)
        mix = lambda a, b: (1 - w) * a + w * b  # noqa: E731
        return {"target_step_ms": mix(low["target_step_ms"], high["target_step_ms"]),
                "draft_step_ms": mix(low["draft_step_ms"], high["draft_step_ms"]),
                "verify_ms": {g: mix(low["verify_ms"][g], high["verify_ms"][g]) for g in low["verify_ms"]}}

    # -- validation ---------------------------------------------------------------------------
    def _request(self, prompt, max_new_tokens=64, temperature=0.0, top_k=0, top_p=1.0, seed=None, stop=None,
                 stop_token_ids=(), gamma=None, mode=None, on_tokens=None, warn: bool = True,
                 proposer: str = DEFAULT_PROPOSER, p_min: float | None = None, acceptance: str = "exact") -> Request:
        if proposer not in PROPOSERS:
            raise SpecCompileError(f"proposer must be one of {', '.join(PROPOSERS)}, not {proposer!r}")
        proposer = self._check_medusa(proposer, acceptance, temperature)
        if self.draft is None and proposer not in ("ngram", "medusa"):
            if proposer == "draft":
                raise SpecCompileError("this bundle has no draft model (it was built without --draft): "
                                       "its requests speculate with prompt lookup (proposer 'ngram' or 'auto')")
            proposer = "ngram"
        if p_min is None:
            p_min = self.profile.p_min if self.profile is not None else 0.0
        if isinstance(p_min, bool) or not isinstance(p_min, (int, float)) or not 0.0 <= p_min <= 1.0:
            raise SpecCompileError(f"p_min must be a probability in [0, 1], got {p_min!r}")
        params = SamplingParams(float(temperature), int(top_k), float(top_p))
        if warn:
            for name in params.without_effect():
                log.warning(f"warning: {name} has no effect at temperature 0 (greedy decoding); "
                            "set a temperature to sample")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens <= 0:
            raise SpecCompileError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if proposer == "medusa":
            gamma, allow_plain = self._medusa_gamma(mode, gamma)
        else:
            gamma, allow_plain = self._request_gamma(mode, gamma, warn)
        ids = self._tokens(prompt)
        stop_strings = _stop_strings(stop)
        request = Request(ids, max_new_tokens, params, seed, gamma, allow_plain,
                          frozenset(self._token_ids(stop_token_ids)), on_tokens=on_tokens, proposer=proposer,
                          p_min=float(p_min), lookup_priors=self.profile.lookup_priors if self.profile else None,
                          acceptance_rule=acceptance)
        if stop_strings:
            request.stop_check = _StopStrings(self.tokenizer, ids, stop_strings)
        if not self.scheduler.fits(request):
            cap = self.scheduler.gamma_cap(request)
            raise SpecCompileError(
                f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens + γ={cap} exceeds the bundle's "
                f"max sequence length {self.max_seq} (rebuild with a larger --max-seq, or ask for fewer tokens)")
        return request

    def _check_medusa(self, proposer: str, acceptance: str, temperature) -> str:
        """The proposer a request runs: on a Medusa bundle its heads ("auto" means them); typical
        acceptance and Medusa only there, and greedy only (tree sampling would need a multi-candidate
        rule such as SpecInfer's to stay exact, which speccompile does not implement)."""
        if acceptance not in ACCEPTANCE_RULES:
            raise SpecCompileError(f"acceptance must be one of {', '.join(ACCEPTANCE_RULES)}, not {acceptance!r}")
        if not self.bundle.medusa:
            if proposer == "medusa" or acceptance != "exact":
                raise SpecCompileError(f"{'proposer medusa' if proposer == 'medusa' else 'typical acceptance'} needs "
                                       "a bundle built with --medusa (Medusa heads and token-tree verification)")
            return proposer
        if proposer not in ("auto", "medusa"):
            raise SpecCompileError(f"this bundle speculates with Medusa heads (built with --medusa): proposer "
                                   f"'medusa' or 'auto', not {proposer!r}")
        if temperature:
            raise SpecCompileError("Medusa tree verification is greedy only (temperature 0): sampling from a tree "
                                   "exactly needs a multi-candidate rule; typical acceptance is the approximate one")
        return "medusa"

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
            gamma = AUTO if self.profile is not None else self.default_gamma
        if gamma == AUTO:
            return AUTO, mode is None  # an explicit mode is never overridden
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

    def _token_ids(self, ids) -> list[int]:
        if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
            raise SpecCompileError("token ids must be integers")
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise SpecCompileError(f"token id {bad[0]} is outside the vocabulary (0..{self.target.vocab_size - 1})")
        return [int(t) for t in ids]


class RequestHandle:
    """A queued request: `.result()` waits for it, `.stream()` yields its tokens as they are
    accepted, `.cancel()` ends it (its slot is freed at the engine's next iteration)."""

    def __init__(self, request: Request, runtime: Runtime, prompt):
        self.request, self._runtime, self.prompt = request, runtime, prompt
        self._done = threading.Event()
        self._tokens: queue.Queue | None = None
        self._user_sink = request.on_tokens
        request.on_tokens, request.on_finish = self._push, self._finished

    def result(self, timeout: float | None = None) -> GenerationResult:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request not finished after {timeout} s")
        if self.request.error is not None:
            raise self.request.error
        return self._runtime.result(self.request, self.prompt)

    def stream(self):
        """Lists of newly accepted token ids, until the request ends. Tokens accepted before the first
        call are yielded first. One consumer."""
        if self._tokens is None:
            self._tokens = queue.Queue()
            self._tokens.put(list(self.request.generated))  # what came before (the engine may add more now)
        while True:
            tokens = self._tokens.get()
            if tokens is None:
                break
            if tokens:
                yield tokens
        if self.request.error is not None:
            raise self.request.error

    def cancel(self) -> None:
        self.request.cancelled = True
        self._runtime._engine and self._runtime._engine.wake()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _push(self, tokens: list[int]) -> None:
        if self._user_sink is not None:
            self._user_sink(tokens)
        if self._tokens is not None:
            self._tokens.put(tokens)

    def _finished(self, request: Request) -> None:
        if self._tokens is not None:
            self._tokens.put(None)
        self._done.set()


class AsyncRequestHandle:
    """The asyncio counterpart of RequestHandle: results and tokens are handed to the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, runtime: Runtime, prompt):
        self._loop, self._runtime, self.prompt = loop, runtime, prompt
        self._tokens: asyncio.Queue = asyncio.Queue()
        self._done = loop.create_future()
        self.request: Request | None = None
        self.user_sink = self.user_finish = None

    @property
    def done(self) -> bool:
        return self._done.done()

    async def result(self) -> GenerationResult:
        await asyncio.shield(self._done)
        if self.request.error is not None:
            raise self.request.error
        return self._runtime.result(self.request, self.prompt)

    async def stream(self):
        while True:
            tokens = await self._tokens.get()
            if tokens is None:
                break
            yield tokens
        if self.request.error is not None:
            raise self.request.error

    def cancel(self) -> None:
        self.request.cancelled = True
        self._runtime._engine and self._runtime._engine.wake()

    def _push(self, tokens: list[int]) -> None:  # engine thread
        if self.user_sink is not None:
            self.user_sink(tokens)
        self._loop.call_soon_threadsafe(self._tokens.put_nowait, list(tokens))

    def _finished(self, request: Request) -> None:  # engine thread
        if self.user_finish is not None:
            self.user_finish(request)
        self._loop.call_soon_threadsafe(self._tokens.put_nowait, None)
        self._loop.call_soon_threadsafe(lambda: self._done.done() or self._done.set_result(None))


class _EngineThread:
    """Runs scheduler iterations on one thread while there is work; sleeps otherwise. Submissions
    land in an inbox that the thread moves into the scheduler between iterations, so the scheduler
    itself is only ever touched by this thread."""

    def __init__(self, scheduler: Scheduler, before_step):
        self.scheduler, self._before_step = scheduler, before_step
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
                self._before_step()
                self.scheduler.step()
            except Exception as error:  # a backend failure ends the requests in flight, not the engine
                log.exception("engine iteration failed")
                self.scheduler.fail_all(error)
        self.scheduler.cancel_all()
        while self._inbox:
            self._inbox.popleft().finish("cancelled")


class _StopStrings:
    """A request's stop check: the number of generated tokens to keep once the text after the prompt
    contains a stop string (the token that completes it is kept; the text is cut before it)."""

    def __init__(self, tokenizer: Tokenizer, prompt: list[int], stops: list[str]):
        self.tokenizer, self.prompt, self.stops = tokenizer, prompt, stops
        self.prompt_text = tokenizer.decode(prompt)
        self.checked = 0  # tokens already known not to complete a stop string

    def __call__(self, generated: list[int]) -> int | None:
        if _before_stop(self._text(generated), self.stops) is None:
            self.checked = len(generated)
            return None
        for keep in range(self.checked + 1, len(generated) + 1):  # the first token that completes one
            if _before_stop(self._text(generated[:keep]), self.stops) is not None:
                return keep
        return len(generated)

    def _text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode_continuation(self.prompt, tokens, self.prompt_text)


def _before_stop(text: str, stops: list[str]) -> str | None:
    """The text before the earliest stop string; None when there is none (for `_StopStrings`), and
    the text itself when there are no stop strings at all."""
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


def load(bundle_dir, backend: str = "onnxruntime", threads: int | None = None, shared_threads: bool | None = None,
         one_session: bool | None = None, prefill_chunk: int = 64, max_batch: int | None = None) -> Runtime:
    """one_session (ONNX Runtime): run each model's every call on its one session graph, holding one
    copy of its weights (True), or a session per graph, faster for small models (False). Default:
    per model, one session from 256 MiB of weights up (onnxruntime_engine.ONE_SESSION_MIN_BYTES)."""
    return Runtime(open_bundle(Path(bundle_dir)), backend=backend, threads=threads, shared_threads=shared_threads,
                   one_session=one_session, prefill_chunk=prefill_chunk, max_batch=max_batch)
