"""`distill --medusa K`: train K Medusa heads on a frozen target (build side: needs torch and transformers).

Head k reads the target's final, normalised hidden state h at position t and predicts token t + k + 2
through the target's own LM head (format and maths in speccompile/medusa_heads.py). Labels are the
target's own: head k at position t learns the target's full next-token distribution at position
t + k + 1 of the same window, by KL(p_target || q_head). The target is frozen and its hidden states
and logits come from one no-grad forward per batch; only the heads train. W_k and b_k start at zero,
so every head starts as the target's next-token head, one token behind what it has to predict.

The heads share no parameters, and AdamW scales each parameter's step by its own gradient's size,
so Medusa's per-head loss weights (0.8^k) would change little more than the gradient clipping here:
the per-head KLs are summed unweighted.
"""

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from speccompile.corpus import sample_windows
from speccompile.errors import SpecCompileError
from speccompile.medusa_heads import write_medusa_heads
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

RANKS = 10  # top_k_accuracy keeps the hit rate of each of the first RANKS ranks
logger = logging.getLogger(__name__)


@dataclass
class MedusaOptions:
    heads: int = 4
    steps: int = 300  # these defaults are `speccompile distill`'s, which the CLI passes whichever is trained
    batch: int = 8
    seq_len: int = 128
    lr: float = 2e-3
    seed: int = 0
    generated_fraction: float = 0.25  # share of batches whose second half is the target's greedy text
    checkpoint_every: int = 50
    # evaluation: held-out prompts continued greedily by the target, heads scored on the continuation
    eval_windows: int = 16
    eval_prompt: int = 64
    eval_new_tokens: int = 128

    def shape(self) -> dict:
        """The options that fix the heads' weights; a resumed run must keep them (a draft's checkpoint has
        no "medusa" entry, so an output directory of `distill` without --medusa is refused too)."""
        return {"medusa": self.heads, "seed": self.seed}


def train_medusa(target_dir, corpus, out_dir, options: MedusaOptions) -> Path:
    import torch

    target_dir, out_dir, o = Path(target_dir), Path(out_dir), options
    _check_options(o)
    target, tokenizer, model_type = load_target(target_dir)
    vocab, hidden = target.get_output_embeddings().weight.shape
    heads = new_heads(hidden, o.heads)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=o.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = np.random.default_rng(o.seed)
    step = _resume(out_dir, heads, optimizer, rng, o)  # before the corpus: a wrong --out fails in seconds
    train_tokens, eval_tokens = _corpus_tokens(corpus, tokenizer, o.seq_len)
    evaluation = _evaluation_set(target, tokenizer, eval_tokens, o)
    untrained = _evaluate(target, new_heads(hidden, o.heads), evaluation, o)
    logger.info(f"untrained heads (each the target's next-token head): {_accuracy_line(untrained)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    _train(target, heads, tokenizer, optimizer, rng, train_tokens, step, out_dir, o)
    _round_to_float16(heads)  # score the weights that are shipped
    results = _evaluate(target, heads, evaluation, o)
    logger.info(f"medusa heads on the target's greedy continuations: {_accuracy_line(results)}")
    config = {"vocab_size": int(vocab), "target_model_type": model_type, "top_k_accuracy": results["ranks"],
              "path_probability": results["paths"],
              "options": asdict(o), "training": _summary(o, out_dir, time.time() - started, results, untrained)}
    return write_medusa_heads(out_dir, config, [(h.weight.detach().numpy(), h.bias.detach().numpy()) for h in heads])


# ---------------------------------------------------------------------------------------------
# checks and the heads


def _check_options(o: MedusaOptions) -> None:
    flags = {"heads": "medusa", "steps": "steps", "batch": "batch", "seq_len": "seq-len",
             "checkpoint_every": "checkpoint-every", "eval_windows": "eval-windows", "eval_prompt": "eval-prompt",
             "eval_new_tokens": "eval-new-tokens"}
    for name, flag in flags.items():
        if getattr(o, name) < 1:
            raise SpecCompileError(f"--{flag} must be positive, got {getattr(o, name)}")
    if not 0.0 <= o.generated_fraction <= 1.0:
        raise SpecCompileError(f"--generated-fraction must be in [0, 1], got {o.generated_fraction}")
    # the last head, at position t, predicts token t + K + 1: it needs that many tokens after t
    if o.seq_len < o.heads + 2:
        raise SpecCompileError(f"--medusa {o.heads} needs windows of at least {o.heads + 2} tokens, "
                               f"got --seq-len {o.seq_len}")
    if o.eval_new_tokens < o.heads + 1:
        raise SpecCompileError(f"--medusa {o.heads} needs at least {o.heads + 1} generated evaluation tokens, "
                               f"got {o.eval_new_tokens}")


def new_heads(hidden: int, k: int):
    """K heads as nn.Linear(H, H), zero: each starts as the identity on h (h + SiLU(0) = h)."""
    import torch

    heads = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(k))
    for head in heads:
        torch.nn.init.zeros_(head.weight)
        torch.nn.init.zeros_(head.bias)
    return heads


def head_logits(target, head, hidden):
    """lm_head(h + SiLU(h W^T + b)): one head's logits on the target's normalised hidden states."""
    import torch.nn.functional as F

    return target.get_output_embeddings()(hidden + F.silu(head(hidden)))


def target_hidden(target, ids):
    """The target's final, normalised hidden state: what its LM head multiplies."""
    return target.base_model(ids).last_hidden_state


def _round_to_float16(heads) -> None:
    import torch

    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(p.half().float())


# ---------------------------------------------------------------------------------------------
# training


def _train(target, heads, tokenizer, optimizer, rng, tokens, step, out_dir: Path, o: MedusaOptions) -> None:
    import torch

    started, first_step, log_file = time.time(), step, open(out_dir / LOG, "a", buffering=1)
    progress = Progress(o.steps, logger)
    while step < o.steps:
        # greedy continuations only: greedy decoding is where heads' guesses are checked token by token
        batch = _batch(target, tokenizer, tokens, rng, o, step, sampled=False)
        with torch.no_grad():
            hidden = target_hidden(target, batch)
            p, entropy = _teacher(target.get_output_embeddings()(hidden))
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, o)
        kls = []
        for k, head in enumerate(heads):  # one backward per head: only one head's logits are alive at a time
            # head k at position t predicts token t + k + 2, which the target predicts at position t + k + 1
            q_logits = head_logits(target, head, hidden[:, : o.seq_len - k - 1])
            loss = _head_kl(p[:, k + 1 :], entropy[:, k + 1 :], q_logits)
            loss.backward()
            kls.append(round(loss.item(), 4))
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        log_file.write(json.dumps({"step": step, "kl": kls, "elapsed_s": round(time.time() - started, 1)}) + "\n")
        if step % max(1, o.steps // 20) == 0 or step == o.steps:
            rate = (step - first_step) * o.batch * o.seq_len / (time.time() - started)
            progress.step(f"kl {' '.join(f'{kl:.3f}' for kl in kls)}, {rate:.0f} tok/s", done=step)
        if step % o.checkpoint_every == 0 or step == o.steps:
            _checkpoint(out_dir, heads, optimizer, rng, step, o)
    log_file.close()


def _teacher(logits):
    """The target's next-token distributions p and their entropies, once per batch for all heads."""
    import torch.nn.functional as F

    log_p = F.log_softmax(logits.float(), -1)
    p = log_p.exp()
    return p, -(p * log_p).sum(-1)


def _head_kl(p, entropy, q_logits):
    """KL(p || q) averaged over positions, as cross-entropy with p as soft labels minus p's entropy:
    distill's `_kl` recomputes p for every head and is about a sixth of a training step slower here."""
    import torch.nn.functional as F

    return F.cross_entropy(q_logits.flatten(0, -2), p.flatten(0, -2)) - entropy.mean()


def _summary(o: MedusaOptions, out_dir: Path, wall_s: float, trained: dict, untrained: dict) -> dict:
    """medusa_config.json's training record: KL on the last steps and on the held-out greedy text, and the
    accuracies before and after (wall_s counts this run's steps only, when it resumed from a checkpoint)."""
    return {"wall_s": round(wall_s, 1), "tokens": o.steps * o.batch * o.seq_len,
            "kl_final": _final_kl(out_dir / LOG, max(1, o.steps // 10)), "heldout_kl": trained["kl"],
            "top1": trained["top1"], "top5": trained["top5"], "untrained_heldout_kl": untrained["kl"],
            "untrained_top1": untrained["top1"], "untrained_top5": untrained["top5"]}


def _final_kl(log_path: Path, last: int) -> list[float]:
    """Each head's KL averaged over the last `last` steps of the log (one batch is a noisy estimate)."""
    entries = [json.loads(line)["kl"] for line in log_path.read_text().splitlines()][-last:]
    return [round(float(kl), 4) for kl in np.mean(entries, axis=0)]


# ---------------------------------------------------------------------------------------------
# evaluation on the target's own greedy text


def _evaluation_set(target, tokenizer, tokens, o: MedusaOptions) -> dict:
    """Held-out prompts continued greedily by the target, with its hidden states and logits on them."""
    import torch

    prompts = torch.from_numpy(sample_windows(tokens, o.eval_windows, o.eval_prompt, np.random.default_rng(0)))
    with torch.no_grad():
        ids = target.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=o.eval_new_tokens,
                              min_new_tokens=o.eval_new_tokens, do_sample=False,
                              pad_token_id=tokenizer.pad_token_id or 0)
        hidden = target_hidden(target, ids)
        p, entropy = _teacher(target.get_output_embeddings()(hidden))
    return {"hidden": hidden, "p": p, "entropy": entropy}


def _evaluate(target, heads, evaluation: dict, o: MedusaOptions) -> dict:
    """Per head: how often its rank-c token (c = 0..RANKS-1) is the target's greedy token, cumulative
    top-1/top-5, and the KL to the target, at every position whose predicted token was generated.

    Labels are the target's argmax in the teacher-forced forward over its own continuation: the greedy
    token at each position (the generated token itself, except where min_new_tokens masked EOS)."""
    import torch

    hidden, p, entropy = evaluation["hidden"], evaluation["p"], evaluation["entropy"]
    prompt, length = o.eval_prompt, hidden.shape[1]
    ranks, kls = [], []
    with torch.no_grad():
        for k, head in enumerate(heads):
            # positions t = prompt - 1 .. length - k - 3, predicting generated tokens prompt + k + 1 .. length - 1
            teacher = slice(prompt + k, length - 1)
            predicted = head_logits(target, head, hidden[:, prompt - 1 : length - k - 2])
            top = predicted.topk(min(RANKS, predicted.shape[-1]), dim=-1).indices
            hits = (top == p[:, teacher].argmax(-1, keepdim=True)).float().flatten(0, 1).mean(0)
            ranks.append([round(x, 4) for x in hits.tolist()])
            kls.append(round(_head_kl(p[:, teacher], entropy[:, teacher], predicted).item(), 4))
    return {"ranks": ranks, "kl": kls, "top1": [r[0] for r in ranks],
            "top5": [round(sum(r[:5]), 4) for r in ranks], "paths": _path_probabilities(target, heads, evaluation, o)}


PATH_MIN = 1e-3  # rank paths rarer than this are left out (a tree grows them from the heads' rank accuracy)


def _path_probabilities(target, heads, evaluation: dict, o: MedusaOptions) -> list:
    """[[path, probability]]: how often the heads' ranks of the target's greedy tokens start with each
    path (c_1, .., c_d), at the positions where every head has a label. A token tree's node of that
    path is accepted exactly then, so these are its acceptance probabilities as measured, with the
    heads' errors as correlated as they are (easy stretches of text are easy for every head), where
    the product of per-head accuracies assumes them independent and underestimates deep paths."""
    import torch

    hidden, p = evaluation["hidden"], evaluation["p"]
    prompt, length, k_heads = o.eval_prompt, hidden.shape[1], len(heads)
    positions = slice(prompt - 1, length - k_heads - 1)  # hidden at t predicts, with head k, token t + k + 2
    ranks = []
    with torch.no_grad():
        for k, head in enumerate(heads):
            predicted = head_logits(target, head, hidden[:, positions])
            top = predicted.topk(min(RANKS, predicted.shape[-1]), dim=-1).indices  # [B, T, R]
            label = p[:, positions.start + k + 1 : positions.stop + k + 1].argmax(-1, keepdim=True)
            hit = top == label
            ranks.append(torch.where(hit.any(-1), hit.float().argmax(-1), -1).flatten())  # rank of the label, or -1
    table = torch.stack(ranks, dim=1).tolist()  # [positions, K]
    counts: dict[tuple, int] = {}
    for row in table:
        for depth in range(1, k_heads + 1):
            if row[depth - 1] < 0:
                break
            counts[tuple(row[:depth])] = counts.get(tuple(row[:depth]), 0) + 1
    frequent = {path: n / len(table) for path, n in counts.items() if n / len(table) >= PATH_MIN}
    return [[list(path), round(prob, 5)] for path, prob in sorted(frequent.items(), key=lambda kv: (len(kv[0]), kv[0]))]


def _accuracy_line(results: dict) -> str:
    top1, top5 = (" ".join(f"{x:.3f}" for x in results[key]) for key in ("top1", "top5"))
    return f"top-1 {top1}; top-5 {top5} (heads 0..{len(results['top1']) - 1})"
