"""`Runtime`: load a bundle, validate a request, run the speculative (or baseline) loop."""

import sys
from dataclasses import dataclass
from pathlib import Path

from speccompile.bundle import Bundle, GraphId, open_bundle
from speccompile.core.gamma_policy import GammaPolicy
from speccompile.core.sampler import Sampler, SamplingParams
from speccompile.core.speculative import autoregressive_generate, speculative_generate
from speccompile.core.stats import GenerationStats
from speccompile.errors import SpecCompileError
from speccompile.runtime.tokenizer import Tokenizer

MODES = ("speculative", "autoregressive")


@dataclass
class GenerationResult:
    prompt: str | list[int]
    token_ids: list[int]  # generated tokens only (EOS included when generated)
    text: str
    stats: GenerationStats

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "text": self.text, "token_ids": self.token_ids, "stats": self.stats.to_dict()}


class Runtime:
    def __init__(self, bundle: Bundle, backend: str = "onnxruntime", threads: int | None = None,
                 shared_threads: bool = False, one_session: bool | None = None):
        """shared_threads (ONNX Runtime): run both models on one process-wide thread pool, which is
        much faster for the speculative loop but binds every other ONNX Runtime session in the
        process (see onnxruntime_engine.shared_thread_pool). The CLI always asks for it; so should
        an application that creates no ONNX Runtime sessions of its own. A process that has the pool
        uses it either way."""
        self.bundle, self.backend = bundle, backend
        self.log = lambda line: print(line, file=sys.stderr)
        if backend == "onnxruntime":
            from speccompile.runtime.onnxruntime_engine import OrtModel, shared_thread_pool

            shared = shared_thread_pool(threads, create=shared_threads)
            # On pools of their own, a small draft runs faster on one thread: its ops are too short
            # to amortise a pool that competes with the target's for the cores.
            self.target = OrtModel(bundle, "target", threads=threads, shared_pool=shared, one_session=one_session)
            self.draft = OrtModel(bundle, "draft", threads=1 if threads is None else threads, shared_pool=shared,
                                  one_session=one_session)
        elif backend == "tensorrt":
            from speccompile.runtime.tensorrt_engine import TrtModel

            self.target, self.draft = (TrtModel(bundle, role) for role in ("target", "draft"))
        else:
            raise SpecCompileError(f"unknown backend {backend!r} (available: onnxruntime, tensorrt)")
        self.tokenizer = Tokenizer(bundle.path / bundle.manifest["tokenizer"]["dir"], bundle.manifest["tokenizer"])
        self.max_seq, self.max_batch = bundle.manifest["max_seq"], bundle.manifest["max_batch"]
        self.default_gamma = bundle.manifest["default_gamma"]
        from speccompile.runtime.hardware import fingerprint
        from speccompile.runtime.profile import find_profile

        self.profile = find_profile(bundle.path, fingerprint(backend))  # measured on this hardware and backend, if any
        self._policies: dict[int, GammaPolicy] = {}  # batch size -> online policy when no profile matches

    @property
    def gammas(self) -> list[int]:
        return self.bundle.gammas

    def generate(self, prompts, max_new_tokens: int = 64, mode: str | None = None, gamma: int | str | None = None,
                 temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int | None = None,
                 on_tokens=None) -> list[GenerationResult]:
        """Generate for a batch of prompts (strings or token-id lists); one result per prompt.

        gamma: a compiled γ, or "auto" (the default when a γ profile matches this hardware): γ is
        picked from the profile for this batch size and moved between compiled values as the running
        acceptance estimate changes. Without a profile, step costs are calibrated quickly once and
        acceptance is learned across this runtime's requests (the first one speculates, to have
        something to learn from). mode: "speculative" or "autoregressive" run as asked; None (the
        default) speculates too, except that gamma "auto" decodes plainly where it predicts that
        speculation does not pay (γ* = 0), and the stats say so (`auto_chose_plain`). An explicit
        mode or γ is never overridden. temperature 0 is greedy (top-k and top-p, which cannot change a
        greedy choice, are then warned about); otherwise tokens are sampled from the target's
        distribution after temperature, top-k (0: off) and top-p (1: off), exactly, in both modes.
        Each sequence draws from its own random stream spawned from `seed`. on_tokens(row, token_ids)
        is called as tokens are accepted, for streaming.

        Each result's stats are its own sequence's (see core/stats.py): in a batch, a sequence's
        times run until its last token, so one that stops early at EOS reports its own latency.
        """
        if isinstance(prompts, (str, bytes)) or (prompts and isinstance(prompts[0], int)):
            raise SpecCompileError("prompts must be a list of strings or a list of token-id lists")
        params = SamplingParams(float(temperature), int(top_k), float(top_p))
        for name in params.without_effect():
            self.log(f"warning: {name} has no effect at temperature 0 (greedy decoding); set a temperature to sample")
        gamma = self._check_request(prompts, max_new_tokens, mode, gamma)
        token_prompts = [self._tokens(p) for p in prompts]
        longest_gamma = max(self.gammas) if gamma == "auto" else gamma
        self._check_lengths(token_prompts, max_new_tokens, longest_gamma)
        eos = self.tokenizer.eos_token_ids
        sampler = None if params.greedy else Sampler(params, len(prompts), seed)
        if gamma == "auto":
            # costs at the context this request spends most of its time at: the prompt plus half its output
            gamma = self._gamma_policy(len(prompts), max(map(len, token_prompts)) + max_new_tokens // 2)
            if mode is None and self._plain_pays(gamma):
                mode, gamma = "autoregressive", "auto"
        mode = mode or "speculative"
        self._load_graphs(mode, gamma, params.greedy, len(prompts))
        if mode == "speculative":
            tokens, stats = speculative_generate(self.target, self.draft, token_prompts, gamma, max_new_tokens, eos, on_tokens, sampler)
        else:
            tokens, stats = autoregressive_generate(self.target, token_prompts, max_new_tokens, eos, on_tokens, sampler)
            for s in stats:
                s.gamma = gamma  # "auto" when the policy chose plain decoding, else 0
        texts = [self.tokenizer.decode_continuation(ids, t) for ids, t in zip(token_prompts, tokens)]
        return [GenerationResult(p, t, text, s) for p, t, text, s in zip(prompts, tokens, texts, stats)]

    def _load_graphs(self, mode: str, gamma, greedy: bool, batch: int) -> None:
        """Load every graph this request can run before its clock starts (they load lazily otherwise)."""
        target = [GraphId.step("target", sample=not greedy)]
        if mode == "speculative":
            gammas = self.gammas if isinstance(gamma, GammaPolicy) else [gamma]
            target += [GraphId.verification(g, sample=not greedy) for g in gammas]
            self.draft.load_graphs([GraphId.step("draft", sample=not greedy)], batch)
        self.target.load_graphs(target, batch)

    # -- γ selection ---------------------------------------------------------------------------
    def _plain_pays(self, policy: GammaPolicy) -> bool:
        """γ* = 0: speculation does not pay here. Without a profile that verdict needs observed
        acceptance, so the first request speculates (see _gamma_policy)."""
        return policy.choose() == 0 and (self.profile is not None or policy.iterations > 0)

    def _gamma_policy(self, batch: int, context: int) -> GammaPolicy:
        from speccompile.runtime.profile import measure_costs, timings_for_batch

        if self.profile is not None:
            return GammaPolicy(timings_for_batch(self.profile, batch, context), self.profile["acceptance_by_position"])
        # No profile: step costs from a quick calibration, acceptance learned from this runtime's own
        # requests. The policy is kept per batch size, so what one request observed steers the next.
        if batch not in self._policies:
            if not self._policies:
                self.log("no γ profile for this hardware in the bundle (run `speccompile profile`): calibrating quickly")
            costs = measure_costs(self, batch, context=min(64, self.max_seq // 4), repeats=3)
            prior = [0.5**k for k in range(1, max(self.gammas) + 1)]  # neutral, worth 2 iterations
            self._policies[batch] = GammaPolicy(costs, prior, prior_weight=2.0)
        return self._policies[batch]

    # -- validation ---------------------------------------------------------------------------
    def _check_request(self, prompts, max_new_tokens, mode, gamma) -> int | str:
        """The γ to run: a compiled γ, "auto", or 0 for plain decoding (which needs none)."""
        if mode is not None and mode not in MODES:
            raise SpecCompileError(f"mode must be one of {', '.join(MODES)}, not {mode!r}")
        if not prompts:
            raise SpecCompileError("no prompts given")
        if len(prompts) > self.max_batch:
            raise SpecCompileError(f"batch of {len(prompts)} prompts exceeds the bundle's max batch {self.max_batch} (rebuild with --max-batch)")
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise SpecCompileError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if mode == "autoregressive":
            if gamma is not None:
                self.log(f"warning: gamma={gamma} has no effect in autoregressive mode (the target decodes alone)")
            return 0
        if gamma is None:
            gamma = "auto" if self.profile is not None else self.default_gamma
        if gamma == "auto":
            return gamma
        if gamma not in self.gammas:
            raise SpecCompileError(f"γ={gamma} was not compiled into this bundle (compiled: {', '.join(map(str, self.gammas))})")
        return gamma

    def _tokens(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        ids = [int(t) for t in prompt]
        if not ids:
            raise SpecCompileError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise SpecCompileError(f"token id {bad[0]} is outside the vocabulary (0..{self.target.vocab_size - 1})")
        return ids

    def _check_lengths(self, token_prompts, max_new_tokens, gamma) -> None:
        longest = max(len(p) for p in token_prompts)
        if longest + max_new_tokens + gamma > self.max_seq:
            raise SpecCompileError(
                f"prompt of {longest} tokens + {max_new_tokens} new tokens + γ={gamma} exceeds the bundle's "
                f"max sequence length {self.max_seq} (rebuild with a larger --max-seq, or ask for fewer tokens)"
            )


def load(bundle_dir, backend: str = "onnxruntime", threads: int | None = None, shared_threads: bool = False,
         one_session: bool | None = None) -> Runtime:
    """one_session (ONNX Runtime): run each model's every call on its one session graph, holding one
    copy of its weights (True), or a session per graph, faster for small models (False). Default:
    per model, one session from 256 MiB of weights up (onnxruntime_engine.ONE_SESSION_MIN_BYTES)."""
    return Runtime(open_bundle(Path(bundle_dir)), backend=backend, threads=threads, shared_threads=shared_threads,
                   one_session=one_session)
