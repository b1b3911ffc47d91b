"""`distill`: train a small draft of the target's family and tokenizer to match the target's
next-token distribution (build side: needs torch and transformers).

Loss: KL(p_target || q_draft) at every position of a window, where p and q are the full next-token
distributions. Matching the whole distribution (not just the argmax) makes the draft useful for
sampling too, and gives a denser signal than next-token cross-entropy. A fraction of the windows
are continued by the target itself, so the draft also learns the text it will face at decode time.
"""

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from speccompile.compiler.architectures import ARCHITECTURES
from speccompile.compiler.draft_vocab import count_tokens, write_frequencies
from speccompile.corpus import corpus_tokens, sample_windows
from speccompile.errors import SpecCompileError
from speccompile.progress import Progress

STATE = "distill_state.pt"
LOG = "distill_log.jsonl"
logger = logging.getLogger(__name__)


@dataclass
class DistillOptions:
    layers: int = 2
    hidden: int = 128
    heads: int | None = None  # default: hidden // 64 (at least 1)
    intermediate: int | None = None  # default: 3 * hidden (gated MLP) or 4 * hidden (GPT-2)
    steps: int = 300
    batch: int = 8
    seq_len: int = 128
    lr: float = 2e-3
    seed: int = 0
    generated_fraction: float = 0.25
    checkpoint_every: int = 50
    eval_windows: int = 16
    init: str | None = None  # an existing draft checkpoint to start from (its size overrides layers/hidden/...)

    def shape(self) -> dict:
        """The options that fix the draft's weights; a resumed run must keep them."""
        return {k: getattr(self, k) for k in ("layers", "hidden", "heads", "intermediate", "seed", "init")}


def distill(target_dir, corpus, out_dir, options: DistillOptions) -> Path:
    import torch

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    _check_options(options)
    target, tokenizer, model_type = load_target(target_dir)
    train_tokens, eval_tokens = _corpus_tokens(corpus, tokenizer, options.seq_len)
    draft = _new_draft(target, model_type, options)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=options.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(options.seed)
    step = _resume(out_dir, draft, optimizer, rng, options)
    if step == 0:
        logger.info(f"initial draft: agreement with target {_agreement(target, draft, eval_tokens, options):.3f}")
    out_dir.mkdir(parents=True, exist_ok=True)
    _train(target, draft, tokenizer, optimizer, rng, train_tokens, step, out_dir, options)
    agreement = _agreement(target, draft, eval_tokens, options)
    logger.info(f"distilled draft: agreement with target {agreement:.3f} (top-1, teacher-forced, held-out windows)")
    _save(out_dir, draft, tokenizer, options, {"agreement": agreement})
    # what `speccompile build --draft-vocab K` ranks tokens by: the text this draft was trained on
    write_frequencies(out_dir, count_tokens(train_tokens, target.config.vocab_size), str(corpus))
    return out_dir


# ---------------------------------------------------------------------------------------------
# checks and set-up


def _check_options(o: DistillOptions) -> None:
    for name in ("layers", "hidden", "steps", "batch", "seq_len", "checkpoint_every"):
        if getattr(o, name) < 1:
            raise SpecCompileError(f"--{name.replace('_', '-')} must be positive, got {getattr(o, name)}")
    if not 0.0 <= o.generated_fraction <= 1.0:
        raise SpecCompileError(f"--generated-fraction must be in [0, 1], got {o.generated_fraction}")
    heads = o.heads or max(1, o.hidden // 64)
    if o.hidden % heads:
        raise SpecCompileError(f"--hidden {o.hidden} is not divisible by {heads} heads")


def load_target(target_dir: Path) -> tuple:
    """(the frozen float32 target in eval mode, its tokenizer, its model_type): what every trainer
    here (a draft, Medusa heads, an EAGLE-3 head) learns from; refused in one line unless supported."""
    import torch
    import transformers

    model_type = _check_target(target_dir)
    logger.info(f"loading target {target_dir} ({model_type})")
    target = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    target.requires_grad_(False)
    return target, transformers.AutoTokenizer.from_pretrained(target_dir), model_type


def _check_target(target_dir: Path) -> str:
    config_file = target_dir / "config.json"
    if not config_file.is_file():
        raise SpecCompileError(f"{target_dir}: no config.json (expected a Hugging Face checkpoint directory)")
    model_type = json.loads(config_file.read_text()).get("model_type")
    if model_type not in ARCHITECTURES:
        raise SpecCompileError(f"{target_dir}: unsupported model_type {model_type!r} "
                               f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return model_type


def _corpus_tokens(corpus, tokenizer, seq_len: int):
    """Train and evaluation token arrays; evaluation is the corpus' last 5% (or held-out stdlib files)."""
    encode = lambda texts: tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    train, heldout = corpus_tokens(corpus, encode, separator)
    if len(train) <= seq_len or len(heldout) <= seq_len:
        raise SpecCompileError(f"corpus {corpus} has {len(train) + len(heldout)} tokens: too little text for windows "
                               f"of {seq_len} (lower --seq-len)")
    logger.info(f"corpus: {len(train):,} train tokens, {len(heldout):,} held-out tokens")
    return train.astype(np.int64), heldout.astype(np.int64)


def draft_config(target_config, model_type: str, o: DistillOptions):
    """The target's config with the size fields replaced (names come from the architecture table)."""
    fields = ARCHITECTURES[model_type].fields
    heads = o.heads or max(1, o.hidden // 64)
    gated = ARCHITECTURES[model_type].block == "llama"
    sizes = {
        "hidden_size": o.hidden, "num_layers": o.layers, "num_heads": heads, "num_kv_heads": heads,
        "head_dim": o.hidden // heads, "intermediate_size": o.intermediate or (3 if gated else 4) * o.hidden,
    }
    config = target_config.__class__.from_dict(target_config.to_dict())
    for ours, value in sizes.items():
        if ours in fields:
            setattr(config, fields[ours], value)
    types = getattr(config, "layer_types", None)
    if types:  # one per layer (Gemma 3's sliding and global ones): the target's pattern, cut or repeated
        config.layer_types = [types[i % len(types)] for i in range(o.layers)]
    return config


def _new_draft(target, model_type: str, o: DistillOptions):
    import torch
    import transformers

    torch.manual_seed(o.seed)
    if o.init:
        draft = transformers.AutoModelForCausalLM.from_pretrained(o.init, dtype=torch.float32)
        if draft.config.model_type != model_type or draft.config.vocab_size != target.config.vocab_size:
            raise SpecCompileError(f"--init {o.init}: a {draft.config.model_type} with {draft.config.vocab_size} "
                                   f"tokens cannot draft for this {model_type} target")
    else:
        draft = transformers.AutoModelForCausalLM.from_config(draft_config(target.config, model_type, o))
    n_draft, n_target = (sum(p.numel() for p in m.parameters()) for m in (draft, target))
    if n_draft >= n_target:
        raise SpecCompileError(f"draft of {n_draft / 1e6:.2f}M parameters is not smaller than the "
                               f"{n_target / 1e6:.2f}M-parameter target")
    return draft.train()


def _resume(out_dir: Path, draft, optimizer, rng, o: DistillOptions) -> int:
    import torch

    state_file = out_dir / STATE
    if not state_file.exists():
        if out_dir.exists() and any(out_dir.iterdir()):
            raise SpecCompileError(f"{out_dir} is not empty and holds no distillation checkpoint; choose a new --out")
        return 0
    state = torch.load(state_file, weights_only=False)
    if state["shape"] != o.shape():
        raise SpecCompileError(f"{out_dir} holds a checkpoint made with {state['shape']}, not {o.shape()}: "
                               "use the same options or a new --out")
    draft.load_state_dict(state["draft"])
    optimizer.load_state_dict(state["optimizer"])
    rng.bit_generator.state = state["rng"]
    _truncate_log(out_dir / LOG, state["step"])
    logger.info(f"resuming from the checkpoint at step {state['step']} in {out_dir}")
    return state["step"]


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines of steps after the checkpoint: an interrupted run redoes them."""
    if path.exists():
        lines = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in lines))


# ---------------------------------------------------------------------------------------------
# training


def _kl(target_logits, draft_logits):
    import torch.nn.functional as F

    vocab = min(target_logits.shape[-1], draft_logits.shape[-1])
    p_log = F.log_softmax(target_logits[..., :vocab].float(), -1).flatten(0, -2)
    q_log = F.log_softmax(draft_logits[..., :vocab].float(), -1).flatten(0, -2)
    # sum_v p (log p - log q), mean over positions
    return F.kl_div(q_log, p_log, log_target=True, reduction="batchmean")


def _batch(target, tokenizer, tokens, rng, o: DistillOptions, step: int, sampled: bool = True):
    """Corpus windows; every k-th batch has its second half generated by the target instead
    (alternately greedy and sampled; always greedy without `sampled`)."""
    import torch

    windows = torch.from_numpy(sample_windows(tokens, o.batch, o.seq_len, rng))
    every = round(1 / o.generated_fraction) if o.generated_fraction > 0 else 0
    if not every or step % every:
        return windows
    half = o.seq_len // 2
    prefix = windows[:, :half]
    sample = sampled and step // every % 2 == 1  # alternate greedy and sampled continuations
    with torch.no_grad():
        out = target.generate(prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=o.seq_len - half,
                              min_new_tokens=o.seq_len - half, do_sample=sample, top_k=0 if sample else None,
                              pad_token_id=tokenizer.pad_token_id or 0)
    return out[:, : o.seq_len]


def _lr(step: int, o: DistillOptions) -> float:
    warmup = max(1, min(50, o.steps // 10))
    if step < warmup:
        return o.lr * (step + 1) / warmup
    return 0.1 * o.lr + 0.45 * o.lr * (1 + math.cos(math.pi * (step - warmup) / max(1, o.steps - warmup)))


def _train(target, draft, tokenizer, optimizer, rng, tokens, step, out_dir: Path, o: DistillOptions) -> None:
    import torch

    started, first_step, log_file = time.time(), step, open(out_dir / LOG, "a", buffering=1)
    progress = Progress(o.steps, logger)
    while step < o.steps:
        batch = _batch(target, tokenizer, tokens, rng, o, step)
        with torch.no_grad():
            target_logits = target(batch).logits
        loss = _kl(target_logits, draft(batch).logits)
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, o)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        entry = {"step": step, "kl": round(loss.item(), 4), "elapsed_s": round(time.time() - started, 1)}
        log_file.write(json.dumps(entry) + "\n")
        if step % max(1, o.steps // 20) == 0 or step == o.steps:
            rate = (step - first_step) * o.batch * o.seq_len / (time.time() - started)
            progress.step(f"kl {loss.item():.4f}, {rate:.0f} tok/s", done=step)
        if step % o.checkpoint_every == 0 or step == o.steps:
            _checkpoint(out_dir, draft, optimizer, rng, step, o)
    log_file.close()


def _checkpoint(out_dir: Path, draft, optimizer, rng, step: int, o: DistillOptions) -> None:
    """Write the resumable state atomically: an interruption never leaves a torn checkpoint."""
    import torch

    tmp = out_dir / (STATE + ".tmp")
    torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng.bit_generator.state,
                "step": step, "shape": o.shape()}, tmp)
    tmp.replace(out_dir / STATE)


def _agreement(target, draft, tokens, o: DistillOptions) -> float:
    """Fraction of held-out positions where draft and target argmax agree (teacher-forced)."""
    import torch

    windows = torch.from_numpy(sample_windows(tokens, o.eval_windows, o.seq_len, np.random.default_rng(0)))
    was_training = draft.training
    draft.eval()
    with torch.no_grad():
        agree = (target(windows).logits.argmax(-1) == draft(windows).logits.argmax(-1)).float().mean().item()
    draft.train(was_training)
    return agree


def _save(out_dir: Path, draft, tokenizer, o: DistillOptions, results: dict) -> None:
    draft.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    report = {"options": asdict(o), "draft": draft_shape(draft), **results}
    (out_dir / "distill.json").write_text(json.dumps(report, indent=1))


def draft_shape(draft) -> dict:
    """The trained draft's size as it is (with --init, the size options were not used)."""
    fields = ARCHITECTURES[draft.config.model_type].fields
    sizes = ("num_layers", "hidden_size", "num_heads", "intermediate_size")
    shape = {ours: getattr(draft.config, fields[ours]) for ours in sizes if ours in fields}
    return {**shape, "parameters": sum(p.numel() for p in draft.parameters())}
