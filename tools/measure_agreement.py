"""How far a compiled target's greedy output is from the HF float32 model's: the price of its precision.

    python tools/measure_agreement.py --target CHECKPOINT --bundle BUNDLE [--prompts FILE] [--max-new-tokens 32]

Speculative output equals autoregressive decoding of the target *as compiled*; a bundle built with
`--target-weights int8` (or float16) is a slightly different model. This measures the difference
instead of assuming it: per prompt, the tokens identical to HF's float32 greedy continuation before
the first divergence, and the log-likelihood gap, the mean negative log-likelihood (under the HF
float32 model, teacher-forced) of the bundle's continuation minus that of HF's own.
"""

import argparse
import json

import numpy as np


def continuation_nll(model, prompt_ids: list[int], continuation: list[int]) -> float:
    import torch

    ids = torch.tensor([prompt_ids + continuation])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    picked = logprobs[torch.arange(len(prompt_ids) - 1, ids.shape[1] - 1), ids[0, len(prompt_ids):]]
    return float(-picked.mean())


def main() -> None:
    import torch
    import transformers

    import speccompile
    from speccompile.cli import read_prompts  # the demo's prompts when --prompts is not given

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--prompts", default=None)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    runtime = speccompile.load(args.bundle, shared_threads=True)
    rows = []
    for prompt in read_prompts(args.prompts):
        ids = runtime.tokenizer.encode(prompt)
        with torch.no_grad():
            hf = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False)[0, len(ids):]
        hf = hf.tolist()
        ours = runtime.generate([ids], max_new_tokens=args.max_new_tokens, mode="autoregressive")[0].token_ids
        same = next((k for k, (a, b) in enumerate(zip(hf, ours)) if a != b), min(len(hf), len(ours)))
        gap = continuation_nll(model, ids, ours) - continuation_nll(model, ids, hf)
        rows.append({"identical_prefix": same, "tokens": len(hf), "nll_gap": round(gap, 4)})
        print(json.dumps(rows[-1]), flush=True)
    summary = {"prompts": len(rows), "all_identical": sum(r["identical_prefix"] == r["tokens"] for r in rows),
               "mean_identical_prefix": float(np.mean([r["identical_prefix"] for r in rows])),
               "mean_nll_gap": float(np.mean([r["nll_gap"] for r in rows]))}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
