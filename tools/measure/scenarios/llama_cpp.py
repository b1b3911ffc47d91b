"""Ours beside llama.cpp on the same GGUF files: plain and speculative decoding of targets and their
drafts at each precision, interleaved in one run.

    python -m tools.make_random_checkpoint --shape tinyllama-1.1b --residual-scale 0.0001 --out /tmp/tl
    python -m tools.make_random_checkpoint --draft-of /tmp/tl --layers 2 --out /tmp/tl-draft
    python -m tools.measure llama_cpp --target /tmp/tl --draft /tmp/tl-draft --llama-cpp DIR \\
        [--work DIR] [--precisions F32 Q8_0 Q4_0 Q4_K_M] [--gamma 4] [--max-new-tokens 64] [--repeats 3]

`--target` and `--draft` take several checkpoints, paired in order (e.g. the 1.1B pair at
`--residual-scale 0.001` and at 0.0001: a draft that agrees less and more often); each row names its
target's directory.

`--llama-cpp`: a llama.cpp source tree built with CMake into its build/ (llama-completion,
llama-speculative-simple and llama-quantize), e.g. the llama-cpp-python 0.3.36 sdist's vendor/llama.cpp:

    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
    cmake --build build -j2 --target llama-completion llama-speculative-simple llama-quantize

The files, made once into `--work`/<target's name> (default /tmp/llama_cpp_side_by_side): the tree's own
convert_hf_to_gguf.py writes target and draft as F32 GGUF; `llama-quantize --pure` makes each
quantized type (every tensor but the norms), and `llama-quantize` alone the Q4_K_M mix (Q4_K, with
Q6_K where llama.cpp puts more bits); `speccompile build` makes one bundle from each pair of GGUF
files (F32 as float32; the quantized files' blocks kept as they are, so both engines multiply the
same integers by the same scales; the draft at the target's precision), with `--gamma γ`.

Each repeat runs, per precision: our bundle in a fresh process (`bench`, plain decoding and the draft
model at γ over the prompts, interleaved); llama.cpp's plain decoding (llama-completion) and its
speculative decoding (llama-speculative-simple, `--spec-type draft-simple` with its draft model at
`--spec-draft-n-max γ --spec-draft-n-min 0 --spec-draft-p-min 0`: a fixed γ, as ours), one process per prompt. Greedy, 2
threads, every request `--max-new-tokens` long (end-of-sequence ignored), the same held-out prompts
(three functions of held-out standard-library files, their first four lines). Rates are new tokens
over whole requests, prefill included, in both engines (llama.cpp: its prompt-eval plus eval time;
its speculative run's encode plus decode time). Each cell: the median over repeats.

A second table splits plain decoding into its two phases, per prompt and engine: the prompt's
prefill (ours: the request's prefill time; llama.cpp: its prompt eval time) and the time per new
token after the first (ours: the rest of the request over its tokens after the first; llama.cpp:
its eval time over its runs). Ours runs in a fresh process of its own each repeat, the prompts one by
one after one short warm-up request.
"""

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from speccompile.errors import SpecCompileError
from tools.fetch_real_models import convert_to_gguf
from tools.measure.harness import in_fresh_process, interleaved
from tools.measure.options import Common, positive
from tools.measure.record import Column, Measured, Spread, Table
from tools.measure.scenarios.precisions import one_bundle

COMMON = Common(max_new_tokens=64, repeats=3)
# a GGUF type (or llama-quantize's mix) -> our --target-weights
OUR_WEIGHTS = {"F32": "float32", "Q8_0": "int8", "Q4_0": "int4", "Q4_K_M": "int4"}
MIXES = ("Q4_K_M",)  # quantized as llama.cpp's users get them: its per-tensor mix, not --pure
THREADS = 2
COLUMNS = (Column("pair"), Column("precision"), Column("ours_plain", "tok/s", 1, "ours plain"),
           Column("ours_speculative", "tok/s", 1, "ours speculative"), Column("ours_speedup", "×", 2, "ours speedup"),
           Column("ours_acceptance", digits=2, label="ours acceptance"),
           Column("llama_plain", "tok/s", 1, "llama.cpp plain"),
           Column("llama_speculative", "tok/s", 1, "llama.cpp speculative"),
           Column("llama_speedup", "×", 2, "llama.cpp speedup"),
           Column("llama_acceptance", digits=2, label="llama.cpp acceptance"),
           Column("plain_lead", "×", 2, "ours / llama.cpp plain"),
           Column("speculative_lead", "×", 2, "ours / llama.cpp speculative"))
SPLIT_COLUMNS = (Column("pair"), Column("precision"), Column("prompt_tokens", digits=0, label="prompt tokens"),
                 Column("ours_prefill", "ms", 0, "ours prefill"), Column("llama_prefill", "ms", 0, "llama.cpp prefill"),
                 Column("ours_per_token", "ms", 1, "ours per new token"),
                 Column("llama_per_token", "ms", 1, "llama.cpp per new token"))
# our plain decoding, phase by phase: each prompt's prefill and ms per new token after the first
OURS_SPLIT = r"""
import json, sys
import speccompile
from speccompile.core.params import GenerationParams
from tools.measure.prompts import heldout_functions, workloads
runtime = speccompile.load(sys.argv[1])
prompts = workloads(heldout_functions(3))["completion"]
runtime.generate(prompts[:1], GenerationParams(max_new_tokens=4, ignore_eos=True, gamma=0))
split = []
for prompt in prompts:
    [r] = runtime.generate([prompt], GenerationParams(max_new_tokens=int(sys.argv[2]), ignore_eos=True, gamma=0))
    split.append({"prefill_ms": r.stats.prefill_ms,
                  "per_token_ms": (r.stats.total_ms - r.stats.prefill_ms) / (len(r.token_ids) - 1)})
print(json.dumps(split))
"""


def add_options(parser) -> None:
    parser.add_argument("--target", type=Path, nargs="+", required=True, help="the targets' Hugging Face checkpoints")
    parser.add_argument("--draft", type=Path, nargs="+", required=True,
                        help="the drafts' Hugging Face checkpoints, one per target, in order")
    parser.add_argument("--llama-cpp", type=Path, required=True, help="a llama.cpp tree built into its build/")
    parser.add_argument("--work", type=Path, default=Path("/tmp/llama_cpp_side_by_side"),
                        help="where the GGUF files and bundles are made, once")
    parser.add_argument("--precisions", nargs="+", default=list(OUR_WEIGHTS), choices=list(OUR_WEIGHTS))
    parser.add_argument("--gamma", type=positive, default=4)


@dataclass(frozen=True)
class Pair:
    """One pair at one precision: the target's and the draft's GGUF, and our bundle built from them."""

    name: str  # the target checkpoint's directory
    precision: str
    target: Path
    draft: Path
    bundle: Path

    @property
    def label(self) -> str:
        return f"{self.name} {self.precision}"


def prepare(args, target: Path, draft: Path, precision: str) -> Pair:
    """The GGUF files and the bundle of one pair at one precision, made where missing."""
    work = args.work / target.name
    work.mkdir(parents=True, exist_ok=True)
    files = {}
    for role, checkpoint in (("target", target), ("draft", draft)):
        f32 = work / f"{role}-F32.gguf"
        if not f32.is_file():
            convert_to_gguf(args.llama_cpp, checkpoint, f32, "f32")
        files[role] = work / f"{role}-{precision}.gguf"
        if not files[role].is_file():
            pure = [] if precision in MIXES else ["--pure"]
            subprocess.run([str(binary(args, "llama-quantize")), *pure, str(f32), str(files[role]), precision],
                           check=True, capture_output=True)
    bundle = work / f"bundle-{precision}"
    if not (bundle / "manifest.json").is_file():
        subprocess.run(["speccompile", "build", "--target", str(files["target"]), "--draft", str(files["draft"]),
                        "--out", str(bundle), "--target-weights", OUR_WEIGHTS[precision], "--gamma", str(args.gamma),
                        "--max-seq", "512", "--max-batch", "4", "--force"], check=True, capture_output=True)
    return Pair(target.name, precision, files["target"], files["draft"], bundle)


def binary(args, name: str) -> Path:
    return args.llama_cpp / "build" / "bin" / name


def llama_run(args, pair: Pair, prompt: str, speculative: bool) -> dict:
    """One request through llama.cpp: (new tokens, seconds of prefill and decoding), and for a
    speculative run the drafted and accepted counts."""
    common = ["-p", prompt, "-n", str(args.max_new_tokens), "--temp", "0", "--ignore-eos", "-t", str(THREADS),
              "-c", "512"]
    if speculative:
        command = [str(binary(args, "llama-speculative-simple")), "-m", str(pair.target), "-md", str(pair.draft),
                   "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.gamma), "--spec-draft-n-min", "0",
                   "--spec-draft-p-min", "0", "-td", str(THREADS), *common]
    else:
        command = [str(binary(args, "llama-completion")), "-m", str(pair.target), "-no-cnv", *common]
    log = subprocess.run(command, capture_output=True, check=True, timeout=600, stdin=subprocess.DEVNULL,
                         encoding="utf-8", errors="replace")  # a random model's text need not be UTF-8
    return parse_speculative(log.stderr) if speculative else parse_plain(log.stderr)


def parse_plain(log: str) -> dict:
    """llama-completion's timings: prompt eval and eval (its new tokens after the first)."""
    prompt_ms, prompt_tokens = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", log).groups()
    eval_ms, runs = re.search(r"\s eval time =\s*([\d.]+) ms /\s*(\d+) runs", log).groups()
    return {"tokens": int(runs) + 1, "seconds": (float(prompt_ms) + float(eval_ms)) / 1000,
            "prompt_tokens": int(prompt_tokens), "prefill_ms": float(prompt_ms),
            "per_token_ms": float(eval_ms) / int(runs)}


def parse_speculative(log: str) -> dict:
    """llama-speculative-simple's summary: encoded and decoded times, tokens drafted and accepted."""
    encoded = float(re.search(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log).group(1))
    decoded, seconds = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log).groups()
    drafted = int(re.search(r"n_drafted\s*=\s*(\d+)", log).group(1))
    accepted = int(re.search(r"n_accept\s*=\s*(\d+)", log).group(1))
    return {"tokens": int(decoded), "seconds": encoded + float(seconds), "drafted": drafted, "accepted": accepted}


def llama_requests(args, pair: Pair, prompts: list[str], speculative: bool) -> dict:
    runs = [llama_run(args, pair, prompt, speculative) for prompt in prompts]
    totals = {key: sum(run.get(key, 0) for run in runs) for key in ("tokens", "seconds", "drafted", "accepted")}
    split = [{key: run[key] for key in ("prompt_tokens", "prefill_ms", "per_token_ms")}
             for run in runs] if not speculative else None
    return {"tokens_per_s": totals["tokens"] / totals["seconds"],
            "acceptance": totals["accepted"] / totals["drafted"] if totals["drafted"] else None, "split": split}


def ours_split(args, pair: Pair) -> list[dict]:
    """Our plain decoding of each prompt, phase by phase, in a fresh process (OURS_SPLIT)."""
    return in_fresh_process(OURS_SPLIT, pair.bundle, args.max_new_tokens)


def run(args) -> Measured:
    from tools.measure.prompts import heldout_functions, workloads

    prompts = workloads(heldout_functions(3))["completion"]
    if len(args.target) != len(args.draft):
        raise SpecCompileError(f"{len(args.target)} targets and {len(args.draft)} drafts: give one draft per target")
    pairs = [prepare(args, target, draft, precision)
             for target, draft in zip(args.target, args.draft) for precision in args.precisions]
    variants = {}
    for pair in pairs:
        variants[f"ours {pair.label}"] = lambda _, p=pair: one_bundle(p.bundle, args.gamma, args.max_new_tokens, 1,
                                                                      "draft")["bench"]
        variants[f"ours split {pair.label}"] = lambda _, p=pair: ours_split(args, p)
        for speculative in (False, True):
            variants[f"llama.cpp {pair.label} {speculative}"] = (
                lambda _, p=pair, s=speculative: llama_requests(args, p, prompts, s))
    samples = interleaved(variants, args.repeats)
    values = {name: [s.value for s in runs] for name, runs in samples.items()}
    return Measured((Table.of("llama_cpp", COLUMNS, [row(pair, values) for pair in pairs]),
                     Table.of("llama_cpp_split", SPLIT_COLUMNS,
                              [split_row(pair, prompt, values) for pair in pairs for prompt in range(len(prompts))],
                              "plain decoding, phase by phase: each prompt's prefill and ms per new token")),
                    {"runs": values, "gamma": args.gamma, "files": {pair.label: str(pair.target) for pair in pairs}})


def row(pair: Pair, values: dict) -> dict:
    ours, plain, speculative = (values[f"ours {pair.label}"], values[f"llama.cpp {pair.label} False"],
                                values[f"llama.cpp {pair.label} True"])
    over = Spread.of
    return {"pair": pair.name, "precision": pair.precision, "ours_plain": over(r["ar_tokens_per_s"] for r in ours),
            "ours_speculative": over(r["spec_tokens_per_s"] for r in ours),
            "ours_speedup": over(r["speedup"] for r in ours),
            "ours_acceptance": over(r["acceptance_rate"] for r in ours),
            "llama_plain": over(r["tokens_per_s"] for r in plain),
            "llama_speculative": over(r["tokens_per_s"] for r in speculative),
            "llama_speedup": over(s["tokens_per_s"] / p["tokens_per_s"] for s, p in zip(speculative, plain)),
            "llama_acceptance": over(r["acceptance"] for r in speculative if r["acceptance"] is not None),
            "plain_lead": over(o["ar_tokens_per_s"] / p["tokens_per_s"] for o, p in zip(ours, plain)),
            "speculative_lead": over(o["spec_tokens_per_s"] / s["tokens_per_s"] for o, s in zip(ours, speculative))}


def split_row(pair: Pair, prompt: int, values: dict) -> dict:
    ours = [run[prompt] for run in values[f"ours split {pair.label}"]]
    theirs = [run["split"][prompt] for run in values[f"llama.cpp {pair.label} False"]]
    over = Spread.of
    return {"pair": pair.name, "precision": pair.precision, "prompt_tokens": theirs[0]["prompt_tokens"],
            "ours_prefill": over(r["prefill_ms"] for r in ours), "llama_prefill": over(r["prefill_ms"] for r in theirs),
            "ours_per_token": over(r["per_token_ms"] for r in ours),
            "llama_per_token": over(r["per_token_ms"] for r in theirs)}
