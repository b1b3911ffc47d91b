"""Proposers on three workloads of held-out code: speedup, acceptance and mean accepted length each.

    python tools/measure_proposers.py [--bundle DIR] [--prompts 12] [--max-new-tokens 64] [--gamma auto]
        [--proposers draft,ngram,auto]

Every prompt comes from a top-level function (6 to 16 lines) of a held-out standard-library file
(never seen in training), in one of three workloads:
  - completion: the function's first 4 lines; the model writes the rest;
  - editing: the whole function, a blank line, and its first line again with the first parameter
    renamed: what follows should largely repeat the function;
  - grounded: the whole function, then `def test_<name>():`: a test that uses the function's names.
Per workload, `bench` runs plain decoding and every proposer interleaved (same prompts, batch 1,
medians over repeats). Beside it: how much the target's own greedy output repeats its prompt (the
share of generated tokens that complete a 3-gram that occurs in the prompt), which bounds what
prompt lookup can find there.
"""

import argparse
import ast
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import speccompile  # noqa: E402
from speccompile.corpus import read_texts, stdlib_split  # noqa: E402
from speccompile.runtime.bench import bench_proposers  # noqa: E402

PROPOSERS = ["draft", "ngram", "auto"]


def heldout_functions(count: int, min_lines: int = 6, max_lines: int = 16) -> list[tuple[str, str, str]]:
    """(name, source, first parameter) of top-level functions with a parameter, from held-out files."""
    _, heldout = stdlib_split()
    found = []
    for text in read_texts(heldout):
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.args.args and not node.decorator_list:
                source = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                if min_lines <= source.count("\n") + 1 <= max_lines and node.args.args[0].arg != "self":
                    found.append((node.name, source, node.args.args[0].arg))
                    break  # one per file: the workloads span many files
        if len(found) == count:
            break
    return found


def workloads(functions) -> dict[str, list[str]]:
    completion = ["\n".join(source.splitlines()[:4]) + "\n" for _, source, _ in functions]
    editing = []
    for _, source, parameter in functions:
        first = source.splitlines()[0].replace(f"({parameter}", "(value", 1)
        editing.append(f"{source}\n\n\n{first}\n")
    grounded = [f"{source}\n\n\ndef test_{name}():\n" for name, source, _ in functions]
    return {"completion": completion, "editing": editing, "grounded": grounded}


def prompt_copy_rate(runtime, prompts: list[str], max_new_tokens: int) -> float:
    """Share of the target's greedy tokens that complete a 3-gram occurring in their prompt."""
    copied = total = 0
    for prompt, result in zip(prompts, runtime.generate(prompts, max_new_tokens, mode="autoregressive")):
        ids = runtime.tokenizer.encode(prompt)
        grams = {tuple(ids[i : i + 3]) for i in range(len(ids) - 2)}
        history = ids + result.token_ids
        for i in range(len(ids), len(history)):
            copied += tuple(history[i - 2 : i + 1]) in grams
            total += 1
    return copied / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", default=None, help="default: the embedded demo bundle")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gamma", default="auto", help="a compiled γ, or auto (the runtime's policy)")
    parser.add_argument("--proposers", default=",".join(PROPOSERS), help="a draft-free bundle: ngram")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.bundle is None:
        from speccompile.demo import demo_bundle

        args.bundle = demo_bundle()
    runtime = speccompile.load(args.bundle, shared_threads=True)  # as the CLI runs it
    gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
    rows = []
    for workload, prompts in workloads(heldout_functions(args.prompts)).items():
        copy = prompt_copy_rate(runtime, prompts, args.max_new_tokens)
        proposers = args.proposers.split(",")
        for summary, _ in bench_proposers(runtime, prompts, proposers, args.max_new_tokens, args.repeats, gamma):
            rows.append({"workload": workload, "prompt_copy_rate": copy, **summary})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'workload':<11} {'copies':>6} {'proposer':<8} {'speedup':>8} {'accept':>7} {'accept len':>10} "
          f"{'AR tok/s':>9}  drafts by proposer (share kept)")
    for row in rows:
        split = ", ".join(f"{name} {p['draft_tokens']} ({p['acceptance_rate']:.2f})"
                          for name, p in row["by_proposer"].items())
        print(f"{row['workload']:<11} {row['prompt_copy_rate']:>6.2f} {row['proposer']:<8} {row['speedup']:>7.2f}x "
              f"{row['acceptance_rate']:>7.2f} {row['mean_acceptance_length']:>10.2f} {row['ar_tokens_per_s']:>9.1f}"
              f"  {split}")


if __name__ == "__main__":
    main()
