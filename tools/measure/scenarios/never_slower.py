"""Never slower than plain decoding: `bench`'s default (γ auto, proposer auto, no profile, every
measured run cold) against plain decoding on pairs whose draft rarely or never agrees, and on the
demo pair whose draft does.

    python -m tools.measure never_slower [--repeats 3] [--max-new-tokens 64] [--pairs demo,poor,tiny,smollm2]
        [--proposer auto]

Pairs (bundles built once into the speccompile cache):
  demo     the embedded demo pair (its distilled draft agrees often)
  poor     the demo target with a draft of the demo draft's shape left at its random initialisation
           (it agrees about as often as chance): what a deliberately poor draft costs
  tiny     a tiny random Llama target and an unrelated tiny draft (tools/make_tiny_pair.py)
  smollm2  SmolLM2-135M-Instruct from its GGUF (python -m tools.fetch_real_models) and its first 4 of 30
           layers as the draft, chat prompts rendered with its template, 96 tokens
Each row: plain and default tokens/s (medians over repeats, runs interleaved), their ratio, the
share of iterations that decoded plainly, and what the draft model and lookups drafted. With
`--proposer draft` on a pair whose draft never pays, the ratio's distance from 1 is what deciding and
probing cost after the fallback, and the drafts column counts the probes.
"""

import shutil
from pathlib import Path

from speccompile.errors import SpecCompileError
from tools.measure.options import Common
from tools.measure.record import Column, Measured, Table
from tools.measure.scenarios.proposers import drafts

COMMON = Common(max_new_tokens=64, repeats=3)
PROMPTS = 6  # per pair
CHAT = ["What is the capital of France? Answer in two sentences.", "Write a short poem about the sea.",
        "Explain what a hash table is to a beginner.", "Give me three tips for learning to cook.",
        "Write a Python function that reverses a string.", "Why is the sky blue?"]
COLUMNS = (Column("pair"), Column("proposer"), Column("plain_tokens_per_s", "tok/s", 1, "plain"),
           Column("default_tokens_per_s", "tok/s", 1, "default"), Column("speedup", "×", 3),
           Column("plain_iteration_share", digits=3, label="plain iterations"),
           Column("acceptance_rate", digits=3, label="acceptance"), Column("drafts", label="drafts (share kept)"),
           Column("prompts"), Column("max_new_tokens"))


def add_options(parser) -> None:
    parser.add_argument("--pairs", default="demo,poor,tiny,smollm2")
    parser.add_argument("--proposer", default="auto",
                        help="who drafts (draft: the draft model alone, so that on a poor draft what remains after "
                        "the fallback is the probes' cost)")


# ---- the pairs ------------------------------------------------------------------------------------


def demo_pair() -> tuple[Path, list[str]]:
    from speccompile.demo import demo_bundle
    from tools.measure.prompts import demo_prompts

    return demo_bundle(), demo_prompts()


def poor_pair() -> tuple[Path, list[str]]:
    """The demo target with a random-initialised draft of the demo draft's shape."""
    import torch
    import transformers

    from speccompile.demo import DEMO_DRAFT, DEMO_TARGET, cache_dir, demo_bundle
    from tools.measure.prompts import demo_prompts

    draft = cache_dir() / "never-slower" / "random-demo-draft"
    if not (draft / "config.json").is_file():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(DEMO_DRAFT))
        model.save_pretrained(draft)
        for kept in [*DEMO_DRAFT.glob("tokenizer*"), DEMO_DRAFT / "token_frequencies.json"]:  # all but the weights
            shutil.copy(kept, draft / kept.name)
    return demo_bundle(DEMO_TARGET, draft), demo_prompts()


def tiny_pair() -> tuple[Path, list[str]]:
    from speccompile.compiler.build import build_bundle
    from speccompile.demo import cache_dir
    from tests.tiny_models import make_checkpoint, make_tokenizer

    root = cache_dir() / "never-slower" / "tiny-llama"
    if not (root / "bundle" / "manifest.json").is_file():
        tokenizer = make_tokenizer()
        make_checkpoint(root / "target", "llama", seed=0, tokenizer=tokenizer)
        make_checkpoint(root / "draft", "llama", seed=1, size="draft", tokenizer=tokenizer)
        build_bundle(root / "target", root / "draft", root / "bundle", gammas=[4], max_seq=256, max_batch=4)
    return root / "bundle", ["def parse(x):", "import os\nimport sys", "class Node:", "for i in range(10):"]


def smollm2_pair() -> tuple[Path, list[str]]:
    import transformers

    from speccompile.compiler.build import build_bundle
    from speccompile.demo import cache_dir
    from tools.fetch_real_models import SMOLLM2_135M, models_dir, transformers_model

    gguf = models_dir() / SMOLLM2_135M.file
    if not gguf.is_file():
        raise SpecCompileError(f"{gguf} is missing: run python -m tools.fetch_real_models")
    root = cache_dir() / "never-slower" / "smollm2"
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if not (root / "bundle" / "manifest.json").is_file():
        read = transformers_model(gguf)
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


PAIRS = {"demo": demo_pair, "poor": poor_pair, "tiny": tiny_pair, "smollm2": smollm2_pair}
TOKENS = {"smollm2": 96}  # chat answers: longer than the code pairs' default


def pairs(option: str) -> list[str]:
    names = option.split(",")
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        raise SpecCompileError(f"unknown pair(s) {', '.join(unknown)}; the pairs: {', '.join(PAIRS)}")
    return names


# ---- the measurement ------------------------------------------------------------------------------


def measure(name: str, repeats: int, tokens: int, proposer: str) -> tuple[dict, dict]:
    """(the pair's row, bench's result as JSON) of `bench` on the pair's first prompts."""
    import speccompile
    from speccompile.core.params import GenerationParams
    from speccompile.runtime.bench import bench

    bundle, prompts = PAIRS[name]()
    runtime = speccompile.load(bundle)
    tokens = TOKENS.get(name, tokens)
    result = bench(runtime, prompts[:PROMPTS], GenerationParams(max_new_tokens=tokens, proposer=proposer), repeats)
    runtime.close()
    row = {"pair": name, "proposer": proposer, "plain_tokens_per_s": result.ar_tokens_per_s,
           "default_tokens_per_s": result.spec_tokens_per_s, "speedup": result.speedup,
           "plain_iteration_share": result.costs.plain_iterations / max(1, result.costs.iterations),
           "acceptance_rate": result.acceptance_rate, "drafts": drafts(result.by_proposer),
           "prompts": len(prompts[:PROMPTS]), "max_new_tokens": tokens}
    return row, result.to_json()


def run(args) -> Measured:
    rows, summaries = [], {}
    for name in pairs(args.pairs):
        row, summaries[name] = measure(name, args.repeats, args.max_new_tokens, args.proposer)
        rows.append(row)
    return Measured((Table.of("never_slower", COLUMNS, rows),), {"bench": summaries})
