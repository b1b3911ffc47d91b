"""`distill --eagle3 K`: train an EAGLE-3 head on a frozen target (build side: imports torch; needs transformers).

The head (maths, feature/token pairing and d2t/t2d in speccompile/eagle_head.py) reads the residual
stream entering three of the target's layers (HF's hidden_states[i]) and the target's own token
embedding, which stays the target's: frozen here and not written with the head. Its lm_head starts
from the target's rows of the draft vocabulary, and the draft vocabulary is the `draft_vocab` most
frequent target tokens of the training text (ties: the lower id), as the EAGLE authors choose it.

Training-time test (EAGLE-3, Li et al. 2025): per window x_0 .. x_{T-1}, one no-grad target forward
gives the features a_t and the next-token distributions p_t; the head is then unrolled K times:

    step 0, index t:  fc(a_t) with embed(x_{t+1}), RoPE position t            -> h0_t, predicts p_{t+1}
    step s, index t:  h{s-1}_t (its own output) with embed(x_{t+1+s}), position t + s -> hs_t, predicts p_{t+1+s}

so index t carries one drafting chain: the context x_0 .. x_{t+1}, then s tokens fed back through the
head's own hidden states, exactly as it drafts after a prompt (tests/eagle_reference.py). The tokens fed
back are the text's own (EAGLE's cnets.py shifts input_ids so); on the batches the target continues
greedily (`generated_fraction`) they are the target's greedy tokens, the drafts that get accepted.
Attention at step s, index t, reads the step-0 keys of indices 0..t (the real context, in the head's
KV cache at inference) and the keys of steps 1..s at index t (the chain's own earlier drafts): the
cache the compiled head holds when it drafts. The EAGLE authors' trainer also hides step-0 keys
t-s+1..t at step s; the speculators trainer does not, and neither does the head at inference.

Loss at step s: KL(p || q) over the draft vocabulary, p the target's distribution restricted to it and
renormalised, counted only at positions whose target argmax the draft vocabulary holds (the gradient
of EAGLE-3's soft cross-entropy), weighted 0.8^s as the EAGLE authors weight their steps.
Agreement at step s: the fraction of held-out positions where the head's argmax, as a target id,
is the target's argmax (the whole vocabulary's: a token the draft cannot propose counts as a miss).
"""

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from speccompile.compiler.draft_vocab import count_tokens, select_vocab, write_frequencies
from speccompile.corpus import sample_windows
from speccompile.eagle_head import (
    CONFIG,
    Eagle3Config,
    Eagle3Head,
    Layout,
    config_aux_layer_ids,
    rope_of,
    write_atomically,
    write_eagle3_head,
)
from speccompile.errors import SpecCompileError, read_json_object
from speccompile.progress import Progress
from speccompile.training.distill import (
    LOG,
    _batch,
    _checkpoint,
    _corpus_tokens,
    _lr,
    _resume,
    load_target,
)

STEP_WEIGHT = 0.8  # step s's loss is weighted STEP_WEIGHT ** s (the EAGLE authors' main.py)
MAX_DRAFT_VOCAB = 32000  # the default draft vocabulary: the EAGLE authors' size, or the target's if smaller
logger = logging.getLogger(__name__)


@dataclass
class Eagle3Options:
    ttt_steps: int = 7  # the training-time test's unroll: drafts the head learns to make in a row
    draft_vocab: int | None = None  # default: min(32000, the target's vocabulary)
    aux_layer_ids: tuple[int, ...] | None = None  # default: EAGLE's (2, N // 2, N - 3); shallow targets need three
    intermediate: int | None = None  # the head's MLP width; default: the target's
    steps: int = 300  # these defaults are `speccompile distill`'s, which the CLI passes whichever is trained
    batch: int = 8
    seq_len: int = 128
    lr: float = 2e-3
    seed: int = 0
    generated_fraction: float = 0.25  # share of batches whose second half is the target's greedy text
    checkpoint_every: int = 50
    eval_windows: int = 16  # held-out windows the per-step agreement is measured on at each checkpoint

    def shape(self) -> dict:
        """The options that fix the head's weights (resolved against the target); a resumed run must keep
        them. A draft's or Medusa heads' checkpoint has no "eagle3" entry, so their directories are refused."""
        return {"eagle3": {"draft_vocab": self.draft_vocab, "aux_layer_ids": self.aux_layer_ids,
                           "intermediate": self.intermediate}, "seed": self.seed}


def train_eagle3(target_dir, corpus, out_dir, options: Eagle3Options) -> Path:

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    _check_options(options)
    target, tokenizer, _ = load_target(target_dir)
    config = head_config(target, target_dir, options)
    o = _resolved(options, config)
    torch.manual_seed(o.seed)
    head = HeadModel(config, target.get_input_embeddings().weight.detach())
    optimizer = torch.optim.AdamW(head.parameters(), lr=o.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(o.seed)
    step = _resume(out_dir, head, optimizer, rng, o)  # before the corpus: a wrong --out fails in seconds
    train_tokens, eval_tokens = _corpus_tokens(corpus, tokenizer, o.seq_len)
    if step == 0:
        _start_vocabulary(head, target, count_tokens(train_tokens, config.vocab_size))
    evaluation = _evaluation_set(target, eval_tokens, o)
    if step == 0:
        logger.info(f"initial head: {_agreement_line(_agreement(head, evaluation, o))}")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    _train(target, head, tokenizer, optimizer, rng, train_tokens, step, evaluation, out_dir, o)
    agreement = _agreement(head, evaluation, o)
    logger.info(f"trained head on held-out windows: {_agreement_line(agreement)}")
    training = {"steps": o.steps, "corpus_tokens": len(train_tokens), "wall_s": round(time.time() - started, 1),
                "draft_vocab_coverage": _coverage(head, train_tokens), "agreement": agreement,
                "options": asdict(o)}
    written = _write(out_dir, head.to_head(), training)
    # what `speccompile build --eagle-vocab K` ranks the head's tokens by: the text it was trained on
    write_frequencies(out_dir, count_tokens(train_tokens, config.vocab_size), str(corpus))
    return written


# ---------------------------------------------------------------------------------------------
# checks and set-up


def _check_options(o: Eagle3Options) -> None:
    flags = {"ttt_steps": "eagle3", "steps": "steps", "batch": "batch", "seq_len": "seq-len",
             "checkpoint_every": "checkpoint-every", "eval_windows": "eval-windows"}
    optional = {"draft_vocab": "draft-vocab", "intermediate": "intermediate"}
    for name, flag in {**flags, **optional}.items():
        if getattr(o, name) is not None and getattr(o, name) < 1:
            raise SpecCompileError(f"--{flag} must be positive, got {getattr(o, name)}")
    if not 0.0 <= o.generated_fraction <= 1.0:
        raise SpecCompileError(f"--generated-fraction must be in [0, 1], got {o.generated_fraction}")
    # the last step, at index t, predicts the target's distribution at t + K: the window needs K + 1 tokens
    if o.seq_len < o.ttt_steps + 1:
        raise SpecCompileError(f"--eagle3 {o.ttt_steps} needs windows of at least {o.ttt_steps + 1} tokens, "
                               f"got --seq-len {o.seq_len}")
    ids = o.aux_layer_ids
    if ids is not None and (len(ids) != 3 or len(set(ids)) != 3 or min(ids) < 0):
        raise SpecCompileError(f"--aux-layers must be three distinct layer ids >= 0, got {list(ids)}")


def head_config(target, target_dir: Path, o: Eagle3Options) -> Eagle3Config:
    """The head's shape: the target's width, attention heads and MLP width (or --intermediate), over
    its vocabulary. RoPE is plain at the target's theta: a long-context target's scaling is not the
    head's, which is trained and written without one."""
    c = target.config
    hidden, heads = c.hidden_size, c.num_attention_heads
    vocab = target.get_input_embeddings().weight.shape[0]
    draft_vocab = o.draft_vocab or min(MAX_DRAFT_VOCAB, vocab)
    if draft_vocab > vocab:
        raise SpecCompileError(f"--draft-vocab {draft_vocab} exceeds the target's vocabulary of {vocab} tokens")
    config = Eagle3Config(
        hidden_size=hidden, num_attention_heads=heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or heads,
        head_dim=getattr(c, "head_dim", None) or hidden // heads,
        intermediate_size=o.intermediate or getattr(c, "intermediate_size", None) or 4 * hidden,
        rms_norm_eps=getattr(c, "rms_norm_eps", None) or 1e-6,
        rope_theta=rope_of(target_dir / CONFIG, read_json_object(target_dir / CONFIG))[0], rope_scaling=None,
        draft_vocab_size=draft_vocab, vocab_size=vocab, target_hidden_size=hidden,
        aux_layer_ids=tuple(sorted(o.aux_layer_ids)) if o.aux_layer_ids else None, norm_before_residual=False)
    return replace(config, aux_layer_ids=_aux_ids(config, c.num_hidden_layers))


def _aux_ids(config: Eagle3Config, num_layers: int) -> tuple[int, ...]:
    """The layers the head reads: the given ones or EAGLE's default, checked against the target's depth
    by eagle_head's own rule (which reads nothing of a head but its config)."""
    try:
        return config_aux_layer_ids(config, num_layers)
    except SpecCompileError:
        if config.aux_layer_ids is not None:
            raise
        raise SpecCompileError(f"EAGLE's default aux layers (2, N // 2, N - 3) are not three distinct layers of "
                               f"this {num_layers}-layer target: name three with --aux-layers") from None


def _resolved(o: Eagle3Options, config: Eagle3Config) -> Eagle3Options:
    """The options with their defaults made the target's values: what a resumed run compares and what
    the written head records."""
    return replace(o, draft_vocab=config.draft_vocab_size, aux_layer_ids=config.aux_layer_ids,
                   intermediate=config.intermediate_size)


def draft_vocabulary(counts: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(d2t, t2d) of the `size` most frequent token ids (ties: the lower id), draft ids in target-id order."""
    vocab = len(counts)
    used = np.arange(vocab) if size >= vocab else select_vocab(counts, size, vocab, always=[])
    t2d = np.zeros(vocab, bool)
    t2d[used] = True
    return (used - np.arange(len(used))).astype(np.int64), t2d


def _start_vocabulary(head, target, counts: np.ndarray) -> None:
    """A new run's draft vocabulary, and lm_head's rows copied from the target's for it (a resumed run
    keeps the checkpoint's)."""
    d2t, t2d = draft_vocabulary(counts, head.config.draft_vocab_size)
    with torch.no_grad():
        head.d2t.copy_(torch.from_numpy(d2t))
        head.t2d.copy_(torch.from_numpy(t2d))
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[head.draft_targets()])
    share = counts[t2d].sum() / max(1, counts.sum())
    logger.info(f"draft vocabulary: the {len(d2t)} most frequent tokens, {share:.1%} of the corpus")


def _coverage(head, tokens: np.ndarray) -> float:
    return round(float(head.t2d.numpy()[tokens].mean()), 4)


# ---------------------------------------------------------------------------------------------
# the head as torch trains it


class HeadModel(nn.Module):
    """An EAGLE-3 head's weights under eagle_head's canonical names, unrolled over windows as it drafts.
    `embed` is the target's token embedding, borrowed: not a parameter and not in the state dict."""
    def __init__(self, config: Eagle3Config, embed: torch.Tensor):
        super().__init__()
        c, h = config, config.hidden_size
        self.config = config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        shapes = {"fc": (3 * c.target_hidden_size, h), "q_proj": (2 * h, q), "k_proj": (2 * h, kv),
                  "v_proj": (2 * h, kv), "o_proj": (q, h), "gate_proj": (h, c.intermediate_size),
                  "up_proj": (h, c.intermediate_size), "down_proj": (c.intermediate_size, h),
                  "lm_head": (h, c.draft_vocab_size)}
        for name, (inputs, outputs) in shapes.items():
            setattr(self, name, nn.Linear(inputs, outputs, bias=False))
        for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm"):
            setattr(self, name, nn.Parameter(torch.ones(h)))
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.register_buffer("embed", embed, persistent=False)

    def draft_targets(self) -> torch.Tensor:
        """The target id of every draft id."""
        return torch.arange(len(self.d2t)) + self.d2t

    def unroll(self, features: torch.Tensor, ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Draft-vocabulary logits of `steps` training-time-test steps over windows ids [B, T] with the
        target's features [B, T, 3·Ht]: step s gives [B, T - 1 - s, V_draft], index t predicting the
        target's distribution at position t + 1 + s (module docstring)."""
        length = ids.shape[1]
        hidden, cache, logits = self.fc(features[:, : length - 1]), [], []
        for s in range(steps):
            n = length - 1 - s
            hidden = self._layer(hidden[:, :n], ids[:, 1 + s : 1 + s + n], torch.arange(n) + s, cache)
            logits.append(self.lm_head(self._rms(hidden, self.norm)))
        return logits

    def _layer(self, hidden, tokens, positions, cache: list) -> torch.Tensor:
        """One step of the layer over n indices: hidden [B, n, H], tokens [B, n] at RoPE `positions`;
        appends the step's keys and values to `cache`. Returns the layer's output [B, n, H]."""
        c = self.config
        fed = self._rms(hidden, self.hidden_norm)
        residual = fed if c.norm_before_residual else hidden
        x = torch.cat([self._rms(self.embed[tokens], self.input_layernorm), fed], dim=-1)
        q = self._rope(self._heads(self.q_proj(x), c.num_attention_heads), positions)
        cache.append((self._rope(self._heads(self.k_proj(x), c.num_key_value_heads), positions),
                      self._heads(self.v_proj(x), c.num_key_value_heads)))
        attended = residual + self.o_proj(self._attention(q, cache).transpose(1, 2).flatten(2))
        y = self._rms(attended, self.post_attention_layernorm)
        return attended + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))

    def _attention(self, q, cache: list) -> torch.Tensor:
        """q [B, heads, n, d] of step s = len(cache) - 1. Index t attends to the step-0 keys of indices
        0..t (the context) and to each later step's key at its own index t (its chain's drafts)."""
        n, group = q.shape[2], self.config.num_attention_heads // self.config.num_key_value_heads
        cache = [(k[:, :, :n].repeat_interleave(group, 1), v[:, :, :n].repeat_interleave(group, 1)) for k, v in cache]
        (k0, v0), later = cache[0], cache[1:]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = [(q @ k0.transpose(-1, -2)).masked_fill(~causal, float("-inf"))]
        scores += [(q * k).sum(-1, keepdim=True) for k, _ in later]
        weights = torch.softmax(torch.cat(scores, dim=-1) / math.sqrt(q.shape[-1]), dim=-1)
        out = weights[..., :n] @ v0
        for i, (_, v) in enumerate(later):
            out = out + weights[..., n + i : n + i + 1] * v
        return out

    def _heads(self, x, heads: int) -> torch.Tensor:
        """[B, n, heads·d] -> [B, heads, n, d]."""
        return x.unflatten(-1, (heads, self.config.head_dim)).transpose(1, 2)

    def _rope(self, x, positions) -> torch.Tensor:
        """HF Llama's rotary embedding: dimension i pairs with i + d / 2."""
        d = x.shape[-1]
        inv_freq = 1.0 / self.config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        angles = positions.double()[:, None] * inv_freq[None, :]
        angles = torch.cat([angles, angles], dim=-1).to(x.dtype)
        return x * angles.cos() + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1) * angles.sin()

    def _rms(self, x, weight) -> torch.Tensor:
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)

    def to_head(self) -> Eagle3Head:
        """The weights as eagle_head's record (float32; without the borrowed embedding)."""
        arrays = {}
        for f in fields(Eagle3Head):
            if f.name not in ("config", "embed_tokens"):
                value = getattr(self, f.name)
                value = (value.weight if isinstance(value, nn.Linear) else value).detach().cpu().numpy()
                arrays[f.name] = value if f.name in ("d2t", "t2d") else value.astype(np.float32)
        return Eagle3Head(config=self.config, **arrays)

    @classmethod
    def from_head(cls, head: Eagle3Head, embed: torch.Tensor) -> "HeadModel":
        """A record's weights as a module (a written head read back with load_eagle3_head, say)."""
        model = cls(head.config, embed)
        with torch.no_grad():
            for name, value in model.state_dict().items():
                value.copy_(torch.from_numpy(np.asarray(getattr(head, name.removesuffix(".weight")))))
        return model


def target_features(target, ids, aux_ids: tuple[int, ...]):
    """(features [B, T, 3·Ht], logits [B, T, V]) of the target over ids: the residual stream entering
    each aux layer (HF's hidden_states[i]) side by side, in ascending layer order."""
    out = target(ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in aux_ids], dim=-1), out.logits


# ---------------------------------------------------------------------------------------------
# training


def _train(target, head, tokenizer, optimizer, rng, tokens, step, evaluation, out_dir: Path, o: Eagle3Options):
    started, first_step, log_file = time.time(), step, open(out_dir / LOG, "a", buffering=1)
    progress = Progress(o.steps, logger)
    while step < o.steps:
        # greedy continuations only: greedy drafts are what the target's greedy tokens check
        batch = _batch(target, tokenizer, tokens, rng, o, step, sampled=False)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, o)
        loss, kls = _loss(target, head, batch, o)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        entry = {"step": step, "loss": round(loss.item(), 4), "kl": [round(kl.item(), 4) for kl in kls],
                 "elapsed_s": round(time.time() - started, 1)}
        checkpoint = step % o.checkpoint_every == 0 or step == o.steps
        if checkpoint:
            entry["agreement"] = _agreement(head, evaluation, o)
        log_file.write(json.dumps(entry) + "\n")
        if step % max(1, o.steps // 20) == 0 or checkpoint:
            rate = (step - first_step) * o.batch * o.seq_len / (time.time() - started)
            more = f", held-out {_agreement_line(entry['agreement'])}" if checkpoint else ""
            progress.step(f"loss {loss.item():.4f}, {rate:.0f} tok/s{more}", done=step)
        if checkpoint:
            _checkpoint(out_dir, head, optimizer, rng, step, o)
    log_file.close()


def _loss(target, head, batch, o: Eagle3Options):
    """(the weighted loss, each step's KL) of the head unrolled over a batch of windows."""
    with torch.no_grad():
        features, logits = target_features(target, batch, o.aux_layer_ids)
        teacher = _teacher(head, logits)
    kls = [_step_kl(teacher, s, step_logits) for s, step_logits in enumerate(head.unroll(features, batch, o.ttt_steps))]
    return sum(STEP_WEIGHT ** s * kl for s, kl in enumerate(kls)), kls


def _teacher(head, logits) -> dict:
    """What every step's loss and agreement read of the target's logits [B, T, V]: log p over the draft
    vocabulary (renormalised), the target's argmax over the whole vocabulary, and whether the draft
    vocabulary holds it."""
    argmax = logits.argmax(-1)
    return {"log_p": F.log_softmax(logits[..., head.draft_targets()].float(), -1), "argmax": argmax,
            "in_vocab": head.t2d[argmax]}


def _step_kl(teacher: dict, s: int, step_logits):
    """Step s's KL(p || q) over the draft vocabulary at the positions it predicts (1 + s ..), averaged over
    all of them, those whose target argmax the draft vocabulary lacks counting zero (as EAGLE-3 counts them)."""
    log_p, in_vocab = teacher["log_p"][:, 1 + s :], teacher["in_vocab"][:, 1 + s :]
    kl = (log_p.exp() * (log_p - F.log_softmax(step_logits.float(), -1))).sum(-1)
    return (kl * in_vocab).mean()


# ---------------------------------------------------------------------------------------------
# evaluation on held-out windows


def _evaluation_set(target, tokens, o: Eagle3Options) -> dict:
    windows = torch.from_numpy(sample_windows(tokens, o.eval_windows, o.seq_len, np.random.default_rng(0)))
    with torch.no_grad():
        features, logits = target_features(target, windows, o.aux_layer_ids)
    return {"ids": windows, "features": features, "argmax": logits.argmax(-1)}


def _agreement(head, evaluation: dict, o: Eagle3Options) -> list[float]:
    """Per step, the fraction of held-out positions where the head's argmax (as a target id) is the target's."""
    with torch.no_grad():
        steps = head.unroll(evaluation["features"], evaluation["ids"], o.ttt_steps)
        targets = head.draft_targets()
        return [round((targets[logits.argmax(-1)] == evaluation["argmax"][:, 1 + s :]).float().mean().item(), 4)
                for s, logits in enumerate(steps)]


def _agreement_line(agreement: list[float]) -> str:
    return f"agreement with the target {' '.join(f'{a:.3f}' for a in agreement)} (steps 0..{len(agreement) - 1})"


# ---------------------------------------------------------------------------------------------
# writing


def _write(out_dir: Path, head: Eagle3Head, training: dict) -> Path:
    """The head in the EAGLE authors' layout, its config.json recording how it was trained."""
    write_eagle3_head(out_dir, head, Layout.EAGLE)
    config = read_json_object(out_dir / CONFIG)
    write_atomically(out_dir / CONFIG, json.dumps({**config, "training": training}, indent=1).encode())
    return out_dir
