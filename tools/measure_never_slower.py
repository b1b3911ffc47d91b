"""Never slower than plain decoding: `bench`'s default (γ auto, proposer auto, no profile, every
measured run cold) against plain decoding on pairs whose draft rarely or never agrees, and on the
demo pair whose draft does. One JSON object per pair on stdout (and in --out).

    python tools/measure_never_slower.py [--out FILE] [--repeats 3] [--tokens 64] [--pairs demo,poor,tiny,smollm2]
    python tools/measure_never_slower.py --first-requests [--pairs demo]

Pairs (bundles built once into the speccompile cache):
  demo     the embedded demo pair (its distilled draft agrees often)
  poor     the demo target with a draft of the demo draft's shape left at its random initialisation
           (it agrees about as often as chance): what a deliberately poor draft costs
  tiny     a tiny random Llama target and an unrelated tiny draft (tools/make_tiny_pair.py)
  smollm2  SmolLM2-135M-Instruct from its GGUF (tools/fetch_real_models.py) and its first 4 of 30
           layers as the draft, chat prompts rendered with its template, 96 tokens
Each row: plain and default tokens/s (medians over repeats, runs interleaved), their ratio, the
share of iterations that decoded plainly, and what the draft model and lookups drafted. With
`--proposer draft` on a pair whose draft never pays, the ratio's distance from 1 is what deciding and
probing cost after the fallback, and `by_proposer` counts the probes.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import speccompile  # noqa: E402
from speccompile.demo import DEMO_DRAFT, DEMO_PROMPTS, DEMO_TARGET, cache_dir, demo_bundle  # noqa: E402
from speccompile.runtime.bench import bench  # noqa: E402

CHAT = ["What is the capital of France? Answer in two sentences.", "Write a short poem about the sea.",
        "Explain what a hash table is to a beginner.", "Give me three tips for learning to cook.",
        "Write a Python function that reverses a string.", "Why is the sky blue?"]


def poor_pair() -> tuple[Path, list[str]]:
    """The demo target with a random-initialised draft of the demo draft's shape."""
    import torch
    import transformers

    draft = cache_dir() / "never-slower" / "random-demo-draft"
    if not (draft / "config.json").is_file():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(DEMO_DRAFT))
        model.save_pretrained(draft)
        for kept in [*DEMO_DRAFT.glob("tokenizer*"), DEMO_DRAFT / "token_frequencies.json"]:  # all but the weights
            shutil.copy(kept, draft / kept.name)
    return demo_bundle(DEMO_TARGET, draft), json.loads(DEMO_PROMPTS.read_text())


def tiny_pair() -> tuple[Path, list[str]]:
    from speccompile.compiler.build import build_bundle
    from tests.tiny_models import make_checkpoint, make_tokenizer

    root = cache_dir() / "never-slower" / "tiny-llama"
    if not (root / "bundle" / "manifest.json").is_file():
        tokenizer = make_tokenizer()
        make_checkpoint(root / "target", "llama", seed=0, tokenizer=tokenizer)
        make_checkpoint(root / "draft", "llama", seed=1, size="draft", tokenizer=tokenizer)
        build_bundle(root / "target", root / "draft", root / "bundle", gammas=[4], max_seq=256, max_batch=4)
    return root / "bundle", ["def parse(x):", "import os\nimport sys", "class Node:", "for i in range(10):"]


def smollm2_pair() -> tuple[Path, list[str]]:
    import torch
    import transformers
    from fetch_real_models import SMOLLM2_135M, models_dir

    from speccompile.compiler.build import build_bundle

    gguf = models_dir() / SMOLLM2_135M.file
    if not gguf.is_file():
        raise SystemExit(f"{gguf} is missing: run python tools/fetch_real_models.py")
    root = cache_dir() / "never-slower" / "smollm2"
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not (root / "bundle" / "manifest.json").is_file():
        read = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model = transformers.AutoModelForCausalLM.from_config(read.config)
        model.load_state_dict(read.state_dict())
        model.generation_config = read.generation_config
        for name, layers in (("target", None), ("draft", 4)):
            if layers:
                model.model.layers = model.model.layers[:layers]
                model.config.num_hidden_layers = layers
            model.save_pretrained(root / name)
            tokenizer.save_pretrained(root / name)
        build_bundle(root / "target", root / "draft", root / "bundle", gammas=[4], max_seq=1024, max_batch=8)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in CHAT]
    return root / "bundle", prompts


PAIRS = {"demo": lambda: (demo_bundle(), json.loads(DEMO_PROMPTS.read_text())), "poor": poor_pair,
         "tiny": tiny_pair, "smollm2": smollm2_pair}


def measure(name: str, repeats: int, tokens: int, proposer: str) -> dict:
    bundle, prompts = PAIRS[name]()
    runtime = speccompile.load(bundle)
    tokens = 96 if name == "smollm2" else tokens
    summary, details = bench(runtime, prompts[:6], max_new_tokens=tokens, repeats=repeats, proposer=proposer)
    runtime.close()
    iterations = max(1, details["iterations"])
    return {"pair": name, "proposer": proposer, "plain_tokens_per_s": round(summary["ar_tokens_per_s"], 1),
            "default_tokens_per_s": round(summary["spec_tokens_per_s"], 1), "speedup": round(summary["speedup"], 3),
            "plain_iteration_share": round(details["plain_iterations"] / iterations, 3),
            "acceptance_rate": round(summary["acceptance_rate"], 3), "by_proposer": summary["by_proposer"],
            "gammas_used": summary["gammas_used"], "prompts": len(prompts[:6]), "max_new_tokens": tokens,
            "repeats": repeats}


def first_requests(name: str, rounds: int = 3) -> dict:
    """What a fresh load costs its first requests: load() (with its calibration, timed apart), then
    the same request of 16 tokens twice and the same batch of 8 twice, each call's wall time as its
    caller saw it and its time to first token (the batch's slowest); medians over `rounds` fresh
    runtimes."""
    import statistics
    import time

    from speccompile.runtime.policies import LoadPolicies

    bundle, prompts = PAIRS[name]()
    calibrating = []
    real = LoadPolicies.calibrate

    def timed(self, *args):
        began = time.perf_counter()
        real(self, *args)
        calibrating.append(time.perf_counter() - began)

    LoadPolicies.calibrate = timed
    rows = []
    for _ in range(rounds):
        began = time.perf_counter()
        runtime = speccompile.load(bundle)
        row = {"load_s": time.perf_counter() - began}
        for label, batch in (("first", prompts[:1]), ("second", prompts[:1]), ("first_batch8", prompts[:8]),
                             ("second_batch8", prompts[:8])):
            began = time.perf_counter()
            results = runtime.generate(batch, max_new_tokens=16)
            row[f"{label}_s"] = time.perf_counter() - began
            row[f"{label}_ttft_ms"] = max(r.stats.ttft_ms for r in results)
        runtime.close()
        rows.append(row)
    LoadPolicies.calibrate = real
    median = {key: round(statistics.median(r[key] for r in rows), 4) for key in rows[0]}
    return {"pair": name, "rounds": rounds, "calibration_s": round(statistics.median(calibrating), 3)
            if calibrating else 0.0, **median}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--pairs", default="demo,poor,tiny,smollm2")
    parser.add_argument("--proposer", default="auto",
                        help="who drafts (draft: the draft model alone, so that on a poor draft what remains after "
                        "the fallback is the probes' cost)")
    parser.add_argument("--first-requests", action="store_true",
                        help="instead: load() and the first requests' wall times against later ones'")
    args = parser.parse_args()
    if args.first_requests:
        for name in args.pairs.split(","):
            print(json.dumps(first_requests(name)), flush=True)
        return
    rows = []
    for name in args.pairs.split(","):
        rows.append(measure(name, args.repeats, args.tokens, args.proposer))
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
