"""What matching stop strings costs per iteration, against the output's length: the request's output
processor (runtime/output.py: each iteration's new tokens decoded alone and the stop strings looked
for in that text) against re-decoding the whole continuation every iteration (what the engine thread
did before the edge existed).

    python -m tools.measure stop_strings [--bundle DIR] [--max-new-tokens 1000] [--per-iteration 4] [--repeats 5]

The tokens are the demo target's own greedy output for a prompt (real text, so the decoder sees real
merges), fed in iterations of `--per-iteration` tokens with stop strings that never match. Each row:
the median microseconds of the iteration that reaches an output length, over the repeats, for both.
"""

from tools.measure.harness import timed
from tools.measure.options import Common, bundle
from tools.measure.record import Column, Measured, Spread, Table

COMMON = Common(bundle=True, max_new_tokens=1000, repeats=5)
STOPS = ("\nclass Never", "<|never|>")
PROMPT = "def parse_args(argv):"
MARKS = (100, 250, 500, 1000, 2000)  # output lengths reported
COLUMNS = (Column("tokens", label="output tokens"), Column("whole_text_redecoded", "µs", 1),
           Column("incremental", "µs", 1))


def add_options(parser) -> None:
    parser.add_argument("--per-iteration", type=int, default=4, help="tokens an iteration")


def output_processor(tokenizer, prompt: list[int]):
    from speccompile.core.params import GenerationParams
    from speccompile.core.request import Request
    from speccompile.runtime.output import OutputProcessor

    request = Request(prompt, 1 << 20, gamma=0, spec=GenerationParams(stop=STOPS))
    return OutputProcessor(tokenizer, request, prompt)


def one_pass(tokenizer, prompt: list[int], output: list[int], step: int, marks: list[int]) -> dict[int, tuple]:
    """Feed the output `step` tokens at a time; at each mark, (whole text re-decoded µs, incremental µs)."""
    processor, prompt_text = output_processor(tokenizer, prompt), tokenizer.decode(prompt)
    at_marks = {}
    for end in range(step, len(output) + 1, step):
        whole = timed(tokenizer.decode_continuation, prompt, output[:end], prompt_text)
        assert not any(s in whole.value for s in STOPS)
        incremental = timed(processor.add, output[end - step : end])
        assert not processor.stopped
        for mark in marks:
            if end - step < mark <= end:
                at_marks[mark] = (whole.seconds * 1e6, incremental.seconds * 1e6)
    return at_marks


def run(args) -> Measured:
    import speccompile

    runtime = speccompile.load(bundle(args))
    tokenizer = runtime.tokenizer
    prompt = tokenizer.encode(PROMPT)
    output = runtime.generate([PROMPT], max_new_tokens=args.max_new_tokens)[0].token_ids
    runtime.close()
    marks = [m for m in MARKS if m <= len(output)]
    passes = [one_pass(tokenizer, prompt, output, args.per_iteration, marks) for _ in range(args.repeats)]
    rows = [{"tokens": mark, "whole_text_redecoded": Spread.of(p[mark][0] for p in passes),
             "incremental": Spread.of(p[mark][1] for p in passes)} for mark in marks]
    title = f"µs per iteration of {args.per_iteration} tokens"
    return Measured((Table.of("stop_strings", COLUMNS, rows, title),), {"output_tokens": len(output)})
