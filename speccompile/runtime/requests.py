"""From what a request asks (`GenerationParams`, checked on its own when made) to the engine's
`Request`: what depends on the bundle is checked here, in the caller's thread, before anything is
queued (the proposers it has, a γ it verifies at, the vocabulary, the context length, Medusa's rules), and
the defaults the load decides are filled in (γ auto, the γ profile's p_min, the sampling rule).
"""

import dataclasses
import logging

from speccompile.core.params import AcceptanceRule, GenerationParams, Mode
from speccompile.core.processors import ProcessorState
from speccompile.core.request import AUTO, Request
from speccompile.core.sampling import SamplingParams
from speccompile.errors import SpecCompileError

log = logging.getLogger("speccompile")


def make_request(runtime, prompt, params: GenerationParams, on_tokens=None, warn: bool = True,
                 shares_prefill_with: Request | None = None) -> Request:
    """The engine's request for `prompt` (a string or token ids) under `params`, checked against the
    runtime's bundle; SpecCompileError names the first thing that does not fit."""
    runtime.proposers.check(params.proposer)
    sampling = _sampling(params, runtime.target.vocab_size, warn)
    processors = params.processors()
    if processors.min_tokens > runtime.max_seq:  # beyond the context it bans EOS for the whole request either
        # way; the graphs take it as int64
        processors = dataclasses.replace(processors, min_tokens=runtime.max_seq)
    p_min = params.p_min
    if p_min is None:
        p_min = runtime.profile.p_min if runtime.profile is not None else 0.0
    _check_tree_rules(runtime, params)
    proposer = runtime.proposers.make(params.proposer, float(p_min))
    if proposer.tree and (processors.active or params.logprobs is not None or params.prompt_logprobs is not None):
        raise SpecCompileError("Medusa tree verification applies no logits processors (penalties, logit_bias, "
                               "min_p, min_tokens) and reports no log-probabilities: use a chain proposer")
    if proposer.tree:
        gamma, allow_plain = _medusa_gamma(runtime, params)
    else:
        gamma, allow_plain = request_gamma(runtime.gammas, params.mode, params.gamma, warn)
    ids = prompt_ids(runtime, prompt)
    max_new_tokens = params.max_new_tokens
    if max_new_tokens is None:  # as vLLM: what the context has left (here, beside its longest verification)
        max_new_tokens = max(1, runtime.max_seq - len(ids) - (max(runtime.gammas) if gamma == AUTO else gamma))
    request = Request(ids, max_new_tokens, sampling, params.seed, gamma, allow_plain,
                      frozenset(token_ids(runtime, params.stop_token_ids)), on_tokens=on_tokens, proposer=proposer,
                      p_min=float(p_min), sampling_rule=params.default_sampling_rule().value,
                      acceptance_rule=params.acceptance.value, ignore_eos=params.ignore_eos, processors=processors,
                      logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
                      shares_prefill_with=shares_prefill_with, spec=params)
    if processors.active:
        request.processing = ProcessorState.start(processors, ids, runtime.target.vocab_size,
                                                  runtime.tokenizer.eos_token_ids | request.stop_token_ids)
    if params.constraint is not None:
        request.grammar = runtime.grammars().start(params.constraint)
    if not runtime.scheduler.fits(request):
        cap = runtime.scheduler.gamma_cap(request)
        raise SpecCompileError(
            f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens + γ={cap} exceeds the bundle's "
            f"max sequence length {runtime.max_seq} (rebuild with a larger --max-seq, or ask for fewer tokens)")
    return request


def _sampling(params: GenerationParams, vocab_size: int, warn: bool) -> SamplingParams:
    """The sampling controls in the graphs' ranges: a top_k past the vocabulary keeps it all."""
    sampling = SamplingParams(params.temperature, min(params.top_k, vocab_size), params.top_p)
    for name in sampling.without_effect() if warn else ():
        log.warning(f"warning: {name} has no effect at temperature 0 (greedy decoding); set a temperature to sample")
    return sampling


def _check_tree_rules(runtime, params: GenerationParams) -> None:
    """Typical acceptance only on a Medusa bundle, and a Medusa bundle's trees greedy only (tree
    sampling would need a multi-candidate rule such as SpecInfer's to stay exact, which
    speccompile does not implement)."""
    if runtime.tree_sizing is None and params.acceptance != AcceptanceRule.EXACT:
        raise SpecCompileError("typical acceptance needs a bundle built with --medusa (Medusa heads and "
                               "token-tree verification)")
    if runtime.tree_sizing is not None and params.temperature:
        raise SpecCompileError("Medusa tree verification is greedy only (temperature 0): sampling from a tree "
                               "exactly needs a multi-candidate rule; typical acceptance is the approximate one")


def _medusa_gamma(runtime, params: GenerationParams) -> tuple[int | str, bool]:
    """A Medusa request's γ: the whole tree (AUTO, the default: it was sized by measured cost), or
    at most that many tokens accepted per verification (1..heads), or 0 / autoregressive: plain."""
    gamma = params.gamma
    if params.mode == Mode.AUTOREGRESSIVE or gamma == 0:
        return 0, False
    if gamma is None or gamma == AUTO:
        return AUTO, False
    heads = runtime.bundle.medusa["num_heads"]
    if isinstance(gamma, bool) or not isinstance(gamma, int) or not 1 <= gamma <= heads:
        raise SpecCompileError(f"γ={gamma!r}: a Medusa request accepts 1..{heads} tokens per verification "
                               "(its heads), or \"auto\" for the whole tree")
    return gamma, False


def request_gamma(gammas: list[int], mode: Mode | None, gamma, warn: bool = False) -> tuple[int | str, bool]:
    """(γ: one the runtime verifies at, AUTO or 0 for plain decoding; may AUTO choose plain decoding)."""
    if mode == Mode.AUTOREGRESSIVE:
        if gamma is not None and warn:
            log.warning(f"warning: gamma={gamma} has no effect in autoregressive mode (the target decodes alone)")
        return 0, False
    if gamma is None or gamma == AUTO:
        return AUTO, mode is None  # an explicit mode is never overridden
    if gamma == 0 and not isinstance(gamma, bool) and mode is None:  # plain decoding, asked for by γ
        return 0, False
    if isinstance(gamma, bool) or gamma not in gammas:
        raise SpecCompileError(f"γ={gamma} is not one this bundle verifies at "
                               f"({', '.join(map(str, gammas))}, or \"auto\")")
    return int(gamma), False


def prompt_ids(runtime, prompt) -> list[int]:
    if isinstance(prompt, str):
        return runtime.tokenizer.encode(prompt)
    if not isinstance(prompt, (list, tuple)):
        raise SpecCompileError(f"a prompt is a string or a list of token ids, not {type(prompt).__name__}")
    ids = token_ids(runtime, prompt)
    if not ids:
        raise SpecCompileError("empty prompt")
    return ids


def token_ids(runtime, ids) -> list[int]:
    """Token ids as ints, or SpecCompileError naming the first outside the vocabulary."""
    import numpy as np

    if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
        raise SpecCompileError("token ids must be integers")
    vocab = runtime.target.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise SpecCompileError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
    return [int(t) for t in ids]
