"""The scenarios' own prompts: held-out standard-library code (never seen in the demo pair's
training), and the demo's prompts file."""

import ast
import json

from tools.measure.options import Prompts


def demo_prompts(count: int | None = None) -> list[str]:
    from speccompile.demo import DEMO_PROMPTS

    return json.loads(DEMO_PROMPTS.read_text())[:count]


def heldout_prompts(count: int, lines: int, from_code: bool = False) -> list[str]:
    """`lines` non-empty lines of held-out files: from each file's start, or (from_code) from its
    first line that starts a top-level def or class (skipping licence headers and docstrings)."""
    from speccompile.corpus import read_texts, stdlib_split

    _, heldout = stdlib_split()
    prompts = []
    for text in read_texts(heldout):
        body = [line for line in text.splitlines() if line.strip()]
        if from_code:
            starts = [i for i, line in enumerate(body) if line.startswith(("def ", "class "))]
            body = body[starts[0]:] if starts else []
        body = body[:lines]
        if len(body) == lines:
            prompts.append("\n".join(body) + "\n")
        if len(prompts) == count:
            break
    return prompts


def heldout_functions(count: int, min_lines: int = 6, max_lines: int = 16) -> list[tuple[str, str, str]]:
    """(name, source, first parameter) of top-level functions with a parameter, from held-out files."""
    from speccompile.corpus import read_texts, stdlib_split

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
    """Three workloads of the same functions:
      - completion: the function's first 4 lines; the model writes the rest;
      - editing: the whole function, a blank line, and its first line again with the first parameter
        renamed: what follows should largely repeat the function;
      - grounded: the whole function, then `def test_<name>():`: a test that uses the function's names."""
    completion = ["\n".join(source.splitlines()[:4]) + "\n" for _, source, _ in functions]
    editing = []
    for _, source, parameter in functions:
        first = source.splitlines()[0].replace(f"({parameter}", "(value", 1)
        editing.append(f"{source}\n\n\n{first}\n")
    grounded = [f"{source}\n\n\ndef test_{name}():\n" for name, source, _ in functions]
    return {"completion": completion, "editing": editing, "grounded": grounded}


def workload(choice: Prompts, name: str) -> list[str]:
    """One workload of `choice.count` held-out functions, or the prompts file's prompts."""
    return choice.pick(lambda count: workloads(heldout_functions(count))[name])


def all_workloads(choice: Prompts) -> dict[str, list[str]]:
    """The three workloads, or one named "file": the prompts file's prompts."""
    if choice.file is not None:
        return {"file": choice.pick(list)}
    return workloads(heldout_functions(choice.count))
