"""lm-evaluation-harness against `speccompile serve`, and the same scores computed in process.

Runs lm-eval's `local-completions` model (OpenAI's completions API: log-likelihoods by echo with
logprobs, generations with stop sequences) on two small local tasks over the demo pair's domain, a
multiple-choice log-likelihood task and a generate-until task, against a server on loopback; then
computes every per-document score again in process (Runtime.generate with prompt_logprobs, and greedy
generation with the same stop) and compares them.

    python -m venv --system-site-packages /tmp/lm-eval && /tmp/lm-eval/bin/pip install lm_eval
    /tmp/lm-eval/bin/python tools/lm_eval_check.py [BUNDLE]     (default: the demo bundle)

lm_eval is not a dependency of speccompile (it is large, and its tasks normally download datasets;
these tasks are local JSON files written here).
"""

import json
import math
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHOICES = [  # (context, choices, the index of the choice Python code would take)
    ("import os\nimport ", ["sys", "banana", "))"], 0),
    ("def main(", ["):", "argv):", "]]"], 1),
    ("for i in range(", ["len(items)):", "10):", "}{"], 1),
    ("    return ", ["None", "self", "%%%"], 0),
    ("if __name__ == ", ['"__main__":', "'__main__':", "(("], 0),
    ("class ", ["Config:", "Parser(object):", "=="], 0),
    ("    def __init__(self", ["):", ", name):", ":::"], 1),
    ("with open(", ["path) as f:", "path, 'w') as f:", ")("], 0),
]
GENERATIONS = ["import os\nimport ", "def parse_args(", "class Config:\n    def __init__(self", "for line in ",
               "    return self.", "if not os.path.exists(", "try:\n    import ", "        raise ValueError("]
MAX_GEN = 16


def write_tasks(directory: Path) -> None:
    choice_rows = [{"context": c, "choices": ch, "label": label} for c, ch, label in CHOICES]
    generate_rows = [{"prompt": p, "target": ""} for p in GENERATIONS]
    for name, rows in (("choice", choice_rows), ("generate", generate_rows)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: test\n"
    (directory / "speccompile_choice.yaml").write_text(
        f"task: speccompile_choice\n{common}dataset_kwargs:\n  data_files:\n    test: {directory / 'choice.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{context}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{label}}\"\ntarget_delimiter: \"\"\nmetric_list:\n  - metric: acc\n")
    (directory / "speccompile_generate.yaml").write_text(
        f"task: speccompile_generate\n{common}dataset_kwargs:\n  data_files:\n    test: "
        f"{directory / 'generate.jsonl'}\noutput_type: generate_until\ndoc_to_text: \"{{{{prompt}}}}\"\n"
        f"doc_to_target: \"{{{{target}}}}\"\ntarget_delimiter: \"\"\ngeneration_kwargs:\n  until: [\"\\n\"]\n"
        f"  max_gen_toks: {MAX_GEN}\n  do_sample: false\n  temperature: 0\nmetric_list:\n  - metric: exact_match\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(bundle: str | None, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "speccompile", "serve", *([bundle] if bundle else []), "--port", str(port),
               "--served-model-name", "demo", "--disable-access-log"]
    server = subprocess.Popen(command)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return server
        except OSError:
            time.sleep(0.2)
    server.kill()
    raise SystemExit("the server did not start")


def lm_eval_scores(port: int, tokenizer_dir: Path, tasks_dir: Path) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    model_args = (f"model=demo,base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,"
                  f"tokenizer={tokenizer_dir},num_concurrent=1,max_retries=1,tokenized_requests=True")
    return lm_eval.simple_evaluate(model="local-completions", model_args=model_args,
                                   tasks=["speccompile_choice", "speccompile_generate"],
                                   task_manager=TaskManager(include_path=str(tasks_dir)), log_samples=True)


def in_process_scores(runtime, encode_pair, requests: list[list[tuple[str, str]]]) -> tuple[list, list[str]]:
    """Each choice's log-likelihood of the (context, continuation) pairs lm-eval asked for, tokenized
    by lm-eval's own `_encode_pair` (the sum over the continuation's tokens), and each greedy
    generation with the task's stop."""
    likelihoods = []
    for pairs in requests:
        scores = []
        for context, continuation in pairs:
            context_ids, continuation_ids = encode_pair(context, continuation)
            [result] = runtime.generate([context_ids + continuation_ids], max_new_tokens=1, temperature=0,
                                        prompt_logprobs=0)
            scored = [entry[0] for entry in result.prompt_logprobs]  # positions 1.. of the prompt
            scores.append(sum(scored[len(context_ids) - 1 :]))
        likelihoods.append(scores)
    generations = [r.text for r in runtime.generate(GENERATIONS, max_new_tokens=MAX_GEN, temperature=0, stop=["\n"])]
    return likelihoods, generations


def lm_eval_encoder(tokenizer_dir: Path):
    """lm-eval's own pair encoding for this tokenizer (its local-completions model, never asked to send)."""
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    model = LocalCompletionsAPI(model="demo", base_url="http://127.0.0.1:9/v1/completions",
                                tokenizer_backend="huggingface", tokenizer=str(tokenizer_dir))
    return model._encode_pair


def main() -> None:
    import speccompile
    from speccompile.cli import resolve_bundle

    bundle_arg = sys.argv[1] if len(sys.argv) > 1 else None
    bundle = Path(resolve_bundle(bundle_arg))
    tokenizer_dir = bundle / "tokenizer"
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        tasks_dir = Path(tmp)
        write_tasks(tasks_dir)
        server = start_server(bundle_arg, port)
        try:
            began = time.perf_counter()
            results = lm_eval_scores(port, tokenizer_dir, tasks_dir)
            took = time.perf_counter() - began
        finally:
            server.terminate()
            server.wait(60)
    choice_samples = sorted(results["samples"]["speccompile_choice"], key=lambda s: s["doc_id"])
    requests = [[tuple(argument) for argument in sample["arguments"]] for sample in choice_samples]
    runtime = speccompile.load(bundle)
    likelihoods, generations = in_process_scores(runtime, lm_eval_encoder(tokenizer_dir), requests)
    runtime.close()
    theirs_ll = [[float(resp[0][0]) for resp in sample["resps"]] for sample in choice_samples]
    theirs_gen = [sample["resps"][0][0] for sample in
                  sorted(results["samples"]["speccompile_generate"], key=lambda s: s["doc_id"])]
    largest = max(abs(a - b) for ours, theirs in zip(likelihoods, theirs_ll) for a, b in zip(ours, theirs))
    ours_acc = sum(max(range(len(s)), key=s.__getitem__) == label for s, (_, _, label) in
                   zip(likelihoods, CHOICES)) / len(CHOICES)
    print(f"lm-eval against speccompile serve: {took:.1f} s")
    for task, metrics in results["results"].items():
        print(f"  {task}: " + ", ".join(f"{k} {v}" for k, v in metrics.items() if isinstance(v, (int, float))))
    print(f"in process: speccompile_choice acc {ours_acc}")
    print(f"log-likelihoods, lm-eval vs in process: largest difference {largest:.2e} over "
          f"{sum(map(len, likelihoods))} choices")
    same = sum(a == b for a, b in zip(generations, theirs_gen))
    print(f"generations equal: {same}/{len(generations)}")
    ok = largest < 1e-4 and same == len(generations) and math.isclose(
        ours_acc, results["results"]["speccompile_choice"]["acc,none"])
    print("EQUAL" if ok else "DIFFERENT")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
