"""Train the embedded demo pair's tokenizer and target (the draft comes from `speccompile distill`).

    python tools/train_demo.py tokenizer WORK      # byte-level BPE on the stdlib train split
    python tools/train_demo.py target WORK         # Llama-family target; resumes from WORK/target_ckpt
    python tools/train_demo.py export WORK DEST [--model DIR]  # fp16 safetensors + tokenizer into DEST

Everything is seeded and recorded in WORK/recipe.json; the loss curve goes to WORK/target_log.jsonl.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

RECIPE = {
    "seed": 1234,
    "heldout_fraction": 0.05,
    "vocab_size": 8192,
    "special_tokens": ["<|endoftext|>", "<|pad|>"],
    "target": {
        "hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 4,
        "intermediate_size": 1408, "max_position_embeddings": 1024, "rope_theta": 10000.0,
    },
    "train": {"seq_len": 256, "batch": 16, "steps": 900, "lr": 1.5e-3, "min_lr": 1.5e-4, "warmup": 100,
              "weight_decay": 0.1, "grad_clip": 1.0, "eval_every": 100, "eval_windows": 64, "threads": 2},
}


# ---------------------------------------------------------------------------------------------
# tokenizer


def train_tokenizer(work: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from speccompile.corpus import read_texts, stdlib_split, tokenize_files

    train_files, heldout_files = stdlib_split(RECIPE["heldout_fraction"])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=RECIPE["vocab_size"], special_tokens=RECIPE["special_tokens"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(read_texts(train_files), trainer)
    eos, pad = RECIPE["special_tokens"]
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=eos, eos_token=eos, pad_token=pad, unk_token=None)
    hf.save_pretrained(work / "tokenizer")
    encode = lambda texts: [e.ids for e in tok.encode_batch(texts)]  # noqa: E731
    for name, files in (("train", train_files), ("heldout", heldout_files)):
        ids = tokenize_files(files, encode, tok.token_to_id(eos))
        np.save(work / f"{name}_tokens.npy", ids.astype(np.uint16))
        print(f"{name}: {len(files)} files, {len(ids):,} tokens")
    split = {"train": len(train_files), "heldout": [str(f) for f in heldout_files]}
    (work / "split.json").write_text(json.dumps(split, indent=1))


# ---------------------------------------------------------------------------------------------
# target


def target_config(work: Path):
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(work / "tokenizer")
    eos = tok.convert_tokens_to_ids(RECIPE["special_tokens"][0])
    t = RECIPE["target"]
    return transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=t["hidden_size"], num_hidden_layers=t["num_hidden_layers"],
        num_attention_heads=t["num_attention_heads"], num_key_value_heads=t["num_key_value_heads"],
        intermediate_size=t["intermediate_size"], max_position_embeddings=t["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": t["rope_theta"]}, tie_word_embeddings=True,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=tok.pad_token_id,
    )


def learning_rate(step: int, cfg: dict) -> float:
    if step < cfg["warmup"]:
        return cfg["lr"] * (step + 1) / cfg["warmup"]
    progress = (step - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"])
    return cfg["min_lr"] + 0.5 * (cfg["lr"] - cfg["min_lr"]) * (1 + math.cos(math.pi * min(1.0, progress)))


def evaluate(model, heldout: np.ndarray, cfg: dict) -> float:
    import torch

    rng = np.random.default_rng(0)  # the same windows every time
    from speccompile.corpus import sample_windows

    windows = torch.from_numpy(sample_windows(heldout, cfg["eval_windows"], cfg["seq_len"], rng))
    model.eval()
    with torch.no_grad():
        losses = [model(w[None], labels=w[None]).loss.item() for w in windows]
    model.train()
    return float(np.mean(losses))


def train_target(work: Path, steps: int | None) -> None:
    import torch
    import transformers

    from speccompile.corpus import sample_windows

    cfg = dict(RECIPE["train"], steps=steps or RECIPE["train"]["steps"])
    torch.set_num_threads(cfg["threads"])
    train, heldout = (np.load(work / f"{n}_tokens.npy").astype(np.int64) for n in ("train", "heldout"))
    ckpt = work / "target_ckpt.pt"
    torch.manual_seed(RECIPE["seed"])
    model = transformers.AutoModelForCausalLM.from_config(target_config(work))
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg["lr"], betas=(0.9, 0.95))
    step, rng_state = 0, None
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, rng_state = state["step"], state["rng"]
        print(f"resumed at step {step}")
    rng = np.random.default_rng(RECIPE["seed"])
    if rng_state is not None:
        rng.bit_generator.state = rng_state
    print(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {len(train):,} train tokens")
    log = open(work / "target_log.jsonl", "a")
    model.train()
    started = time.time()
    while step < cfg["steps"]:
        batch = torch.from_numpy(sample_windows(train, cfg["batch"], cfg["seq_len"], rng))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, cfg)
        loss = model(batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        record = {"step": step, "loss": round(loss.item(), 4), "lr": group["lr"],
                  "elapsed_s": round(time.time() - started, 1)}
        if step % cfg["eval_every"] == 0 or step == cfg["steps"]:
            record["heldout_loss"] = round(evaluate(model, heldout, cfg), 4)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                        "rng": rng.bit_generator.state}, ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").replace(ckpt)  # atomic: an interrupted save never loses the last checkpoint
            model.save_pretrained(work / "target")
        log.write(json.dumps(record) + "\n")
        log.flush()
        if step % 10 == 0:
            print(record, flush=True)


# ---------------------------------------------------------------------------------------------
# export


def export(work: Path, dest: Path, model_dir: Path | None = None) -> None:
    """Ship a checkpoint (default: the trained target) as fp16 safetensors with the demo tokenizer."""
    import shutil

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir or work / "target", dtype=torch.float16)
    shutil.rmtree(dest, ignore_errors=True)
    model.save_pretrained(dest)
    transformers.AutoTokenizer.from_pretrained(work / "tokenizer").save_pretrained(dest)
    # a distilled draft's (build --draft-vocab)
    frequencies = Path(model_dir or work / "target") / "token_frequencies.json"
    if frequencies.is_file():
        shutil.copy(frequencies, dest)
    print(f"exported {dest}")


def main():
    parser = argparse.ArgumentParser(description="Train the demo tokenizer and target.")
    parser.add_argument("what", choices=["tokenizer", "target", "export"])
    parser.add_argument("work", type=Path)
    parser.add_argument("dest", type=Path, nargs="?")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--model", type=Path, default=None, help="export: the checkpoint to ship (default WORK/target)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.what != "export":
        (args.work / "recipe.json").write_text(json.dumps({**RECIPE, "python": sys.version}, indent=1))
    if args.what == "tokenizer":
        train_tokenizer(args.work)
    elif args.what == "target":
        train_target(args.work, args.steps)
    else:
        export(args.work, args.dest, args.model)


if __name__ == "__main__":
    main()
