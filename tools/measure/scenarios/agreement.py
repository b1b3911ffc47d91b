"""How far a compiled target's greedy output is from the HF float32 model's: the price of its precision.

    python -m tools.measure agreement [--target CHECKPOINT|FILE.gguf --bundle BUNDLE] [--prompts N|FILE]
        [--max-new-tokens 32]

Speculative output equals autoregressive decoding of the target *as compiled*; a bundle built with
`--target-weights int8` (or float16) is a slightly different model. This measures the difference
instead of assuming it: per prompt, the tokens identical to HF's float32 greedy continuation before
the first divergence, and the log-likelihood gap, the mean negative log-likelihood (under the HF
float32 model, teacher-forced) of the bundle's continuation minus that of HF's own. Without
--bundle and --target: the demo bundle against the demo target's checkpoint. A GGUF target is the
model transformers reads from the file (its blocks dequantized to float32), which is what a bundle
built from that file is compiled from too.
"""

import numpy as np

from speccompile.errors import SpecCompileError
from tools.fetch_real_models import transformers_model
from tools.measure.options import Common, bundle
from tools.measure.prompts import demo_prompts
from tools.measure.record import Column, Measured, Table

COMMON = Common(bundle=True, prompts=8, max_new_tokens=32)
PROMPT_COLUMNS = (Column("prompt"), Column("identical_prefix", "tokens"), Column("tokens"),
                  Column("nll_gap", "nats/token", 4, "NLL gap"))
SUMMARY_COLUMNS = (Column("prompts"), Column("all_identical", label="identical throughout"),
                   Column("mean_identical_prefix", "tokens", 1), Column("mean_nll_gap", "nats/token", 4,
                                                                        "mean NLL gap"))


def add_options(parser) -> None:
    parser.add_argument("--target", help="the HF checkpoint or GGUF file the bundle's target was compiled "
                        "from (default, without --bundle: the demo target)")


def continuation_nll(model, prompt_ids: list[int], continuation: list[int]) -> float:
    import torch

    ids = torch.tensor([prompt_ids + continuation])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    picked = logprobs[torch.arange(len(prompt_ids) - 1, ids.shape[1] - 1), ids[0, len(prompt_ids):]]
    return float(-picked.mean())


def checkpoint(args):
    if args.target:
        return args.target
    if args.bundle is not None:
        raise SpecCompileError("--bundle needs --target: the checkpoint its target was compiled from")
    from speccompile.demo import DEMO_TARGET

    return DEMO_TARGET


def compare(model, runtime, ids: list[int], max_new_tokens: int) -> tuple[int, int, float]:
    """(identical prefix, HF's tokens, NLL gap) for one prompt."""
    import torch

    with torch.no_grad():
        hf = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(ids):]
    hf = hf.tolist()
    ours = runtime.generate([ids], max_new_tokens=max_new_tokens, mode="autoregressive")[0].token_ids
    same = next((k for k, (a, b) in enumerate(zip(hf, ours)) if a != b), min(len(hf), len(ours)))
    return same, len(hf), continuation_nll(model, ids, ours) - continuation_nll(model, ids, hf)


def run(args) -> Measured:
    import torch

    import speccompile

    torch.set_num_threads(2)
    model = transformers_model(checkpoint(args)).eval()
    runtime = speccompile.load(bundle(args), shared_threads=True)
    rows = []
    for i, prompt in enumerate(args.prompts.pick(demo_prompts)):
        same, tokens, gap = compare(model, runtime, runtime.tokenizer.encode(prompt), args.max_new_tokens)
        rows.append({"prompt": i, "identical_prefix": same, "tokens": tokens, "nll_gap": gap})
    runtime.close()
    summary = {"prompts": len(rows), "all_identical": sum(r["identical_prefix"] == r["tokens"] for r in rows),
               "mean_identical_prefix": float(np.mean([r["identical_prefix"] for r in rows])),
               "mean_nll_gap": float(np.mean([r["nll_gap"] for r in rows]))}
    return Measured((Table.of("summary", SUMMARY_COLUMNS, [summary], "over the prompts"),
                     Table.of("prompts", PROMPT_COLUMNS, rows, "per prompt")))
