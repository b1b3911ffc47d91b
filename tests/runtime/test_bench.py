"""`bench`: the summary keys, and numbers that follow from the runs they summarise."""

import json
import threading
import time
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

import speccompile
from speccompile.cli import main
from speccompile.cli import read_prompts as cli_prompts
from speccompile.core.params import GenerationParams
from speccompile.core.stats import GenerationStats
from speccompile.demo import DEMO_PROMPTS
from speccompile.errors import SpecCompileError
from speccompile.runtime.bench import BENCH_KEYS, LOAD_KEYS, read_prompts, request_stream
from speccompile.runtime.bench import bench as bench_result
from speccompile.runtime.bench import bench_load as load_rows


def bench(runtime, prompts, repeats=3, **params):
    """bench's result as its JSON (the summary) and its costs'."""
    result = bench_result(runtime, prompts, GenerationParams.of(**params), repeats)
    return result.to_json(), result.costs.to_json()


def bench_load(runtime, prompts, concurrencies, requests, repeats, rate=None, **params):
    """bench_load's rows and their details, as their JSON."""
    rows = load_rows(runtime, prompts, GenerationParams.of(**params), concurrencies, requests, rate, repeats)
    return [r.to_json() for r in rows], [r.details.to_json() for r in rows]


class ScriptedRuntime:
    """Every timed call makes 10 tokens. Autoregressive: 10 decode steps of 5 ms, 60 ms in all, except
    one hiccup of 600 ms. Speculative at γ=2: 4 verifications keeping 2, 2, 1 and 1 drafts, 1 ms per
    draft step, 3 ms per verification, 1 ms of prefill, 25 ms in all. Warm-up calls (8 tokens) take
    an hour, so that counting one would show."""

    bundle = SimpleNamespace(medusa=None)  # a bundle with a draft model

    def forget(self):  # a fresh load's knowledge: nothing to forget here
        pass

    def __init__(self):
        self.timed_ar_calls = 0

    def generate(self, prompts, params):
        max_new_tokens, mode, gamma = params.max_new_tokens, params.mode, params.gamma
        stats = GenerationStats(mode, gamma, new_tokens=10)
        if mode == "autoregressive":
            self.timed_ar_calls += max_new_tokens != 8
            stats.iterations, stats.decode_ms = 10, 50.0
            stats.total_ms = 600.0 if self.timed_ar_calls == 2 else 60.0
        else:
            for accepted in (2, 2, 1, 1):
                stats.record_iteration(accepted, gamma)
            stats.prefill_ms, stats.draft_ms, stats.verify_ms, stats.total_ms = 1.0, 8.0, 12.0, 25.0
        if max_new_tokens == 8:
            stats.total_ms = stats.decode_ms = stats.verify_ms = 3.6e6
        return [SimpleNamespace(stats=stats)]


def test_bench_reports_medians_of_the_timed_runs_and_the_costs_behind_them():
    summary, details = bench(ScriptedRuntime(), ["a"], max_new_tokens=10, repeats=3, gamma=2)
    assert summary["ar_tokens_per_s"] == pytest.approx(10 / 0.060)  # the 600 ms repeat is not the median
    assert summary["spec_tokens_per_s"] == pytest.approx(10 / 0.025)
    assert summary["speedup"] == pytest.approx(2.4)
    acceptance = (summary["acceptance_rate"], summary["mean_accepted_drafts"], summary["mean_acceptance_length"])
    assert acceptance == (0.75, 1.5, 2.5)
    assert summary["gamma"] == 2 and summary["gammas_used"] == {2: 12}
    assert details["acceptance_by_position"] == [1.0, 0.5]
    assert details["target_step_ms"] == pytest.approx(5.0) and details["draft_step_ms"] == pytest.approx(1.0)
    assert details["verify_ms"] == pytest.approx(3.0)
    assert details["overhead_ms_per_iteration"] == pytest.approx(1.0)  # (25 - 1) / 4 - 2 x 1 - 3
    assert details["draft_to_target_step_ratio"] == pytest.approx(0.2)
    assert summary["predicted_speedup"] == pytest.approx(2.5)  # 2.5 tokens x 5 ms / (2 x 1 + 3) ms: no overhead
    assert summary["efficiency"] == pytest.approx(0.96)
    # whole requests: a plain token's 6 ms (the median run) against 1/10 ms of prefill and its 5 ms of
    # target steps at the decode speedup with the loop's overhead, 2.5 x 5 / (2 x 1 + 3 + 1)
    assert details["predicted_end_to_end"] == pytest.approx(6 / (0.1 + 5 / (12.5 / 6)))


def test_suffix_bench_is_cold_whatever_the_repeats(bundles):
    """Every measured speculative run drafts only from what a fresh process would have: its figures
    are a fresh runtime's first pass over the prompts, not those of a cache that saw the plain runs'
    (identical) answers, the warm-ups' or an earlier repeat's."""
    prompts, gamma, tokens = ["import os", "def f(x):", "class A:"], 4, 24
    fresh = speccompile.load(bundles("llama", "none"))
    first = [fresh.generate([p], max_new_tokens=tokens, gamma=gamma, proposer="suffix")[0].stats for p in prompts]
    drafted = sum(s.draft_tokens for s in first)
    cold = sum(s.accepted_tokens for s in first) / drafted if drafted else 0.0
    again = [fresh.generate([p], max_new_tokens=tokens, gamma=gamma, proposer="suffix")[0].stats for p in prompts]
    warm = sum(s.accepted_tokens for s in again) / sum(s.draft_tokens for s in again)
    assert warm > cold + 0.3  # the answers seen before make a flattering figure (what bench must not report)
    summary, _ = bench(speccompile.load(bundles("llama", "none")), prompts, max_new_tokens=tokens, repeats=2,
                       gamma=gamma, proposer="suffix")
    assert summary["acceptance_rate"] == pytest.approx(cold)


def test_copy_draft_bench_accepts_every_draft(bundles):
    runtime = speccompile.load(bundles("llama", "copy"))
    summary, details = bench(runtime, ["import os", "def f(x):"], max_new_tokens=16, repeats=2, gamma=4,
                             proposer="draft")
    assert list(summary) == BENCH_KEYS
    assert summary["acceptance_rate"] == 1.0 and summary["mean_accepted_drafts"] == 4.0 and summary["gamma"] == 4
    assert summary["mean_acceptance_length"] == 5.0 and list(summary["gammas_used"]) == [4]
    assert details["acceptance_by_position"] == [1.0] * 4
    assert details["target_step_ms"] > 0 and details["draft_step_ms"] > 0 and details["verify_ms"] > 0


def test_auto_gamma_bench_reports_the_gammas_it_used_and_acceptance_per_drafted_position(bundles, monkeypatch):
    """The policy's choice is forced to move (tiny models' timings are noise); positions 2-4 are
    drafted only by the γ=4 iterations and must not be divided by all of them."""
    import itertools

    from speccompile.core.gamma_policy import GammaPolicy

    runtime = speccompile.load(bundles("llama", "copy"))
    schedule = itertools.cycle([1, 4])  # from the first request on (load serves a warm-up request of its own)
    monkeypatch.setattr(GammaPolicy, "choose", lambda self, allow_zero=True: next(schedule))
    summary, details = bench(runtime, ["import os", "def f(x):"], max_new_tokens=16, repeats=1, gamma="auto",
                             mode="speculative", proposer="draft")  # a copy draft costs a target step: it would not pay
    used = summary["gammas_used"]
    # γ=0: a request's last iteration, when the one token it still needs is the target's own
    assert summary["gamma"] == "auto" and set(used) - {0} == {1, 4} and used.get(0, 0) <= 2
    mean_gamma = (used[1] + 4 * used[4]) / sum(used.values())
    assert details["acceptance_by_position"] == [1.0] * 4
    assert summary["mean_acceptance_length"] == pytest.approx(1 + mean_gamma)
    t_target, t_draft, t_verify = (details[k] for k in ("target_step_ms", "draft_step_ms", "verify_ms"))
    # the cost model over the mix predicts the tokens per iteration that were measured
    drafting = 1 - used.get(0, 0) / sum(used.values())
    assert summary["predicted_speedup"] == pytest.approx(summary["mean_acceptance_length"] * t_target / (
        mean_gamma * t_draft + drafting * t_verify + (1 - drafting) * t_target))


def test_cli_bench_json_has_exactly_the_keys(bundles, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("import os\n\ndef main():\n")
    result = CliRunner().invoke(main, ["bench", str(bundles("gpt2", "random")), "--prompts", str(prompts),
                                       "--max-new-tokens", "8", "--repeats", "1", "--json"])
    assert result.exit_code == 0, result.output
    assert list(json.loads(result.stdout)) == BENCH_KEYS


def test_prompt_files(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(["a\nb", "c"]))
    assert read_prompts(tmp_path / "p.json") == ["a\nb", "c"]
    (tmp_path / "bad.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(SpecCompileError, match="JSON list"):
        read_prompts(tmp_path / "bad.json")
    assert len(read_prompts(DEMO_PROMPTS)) >= 4
    assert cli_prompts(None) == read_prompts(DEMO_PROMPTS)  # what bench and profile run when given no --prompts


# ---- bench_load: serving under load ------------------------------------------------------------

class PacedRuntime:
    """Serves every request on a thread of its own (nothing shared, so N clients get N times the
    tokens): its first token 20 ms after submission, then two deliveries of 4 tokens, 40 ms apart:
    9 tokens in 100 ms. A speculative request's stats: 2 iterations keeping 3 of their 4 drafts."""

    def forget(self):  # a fresh load's knowledge: nothing to forget here
        pass

    def __init__(self):
        self.sent = []  # (perf_counter, max_new_tokens, mode) per submission

    def submit(self, prompt, params, on_tokens):
        self.sent.append((time.perf_counter(), params.max_new_tokens, params.mode))
        return PacedHandle(params.mode, on_tokens)


class PacedHandle:
    def __init__(self, mode, on_tokens):
        self.mode = mode
        self.thread = threading.Thread(target=self._serve, args=(on_tokens,))
        self.thread.start()

    @staticmethod
    def _serve(on_tokens):
        time.sleep(0.020)
        on_tokens([7])
        for _ in range(2):
            time.sleep(0.040)
            on_tokens([7] * 4)

    def result(self):
        self.thread.join()
        speculative = self.mode != "autoregressive"
        stats = GenerationStats("speculative" if speculative else "autoregressive", 4 if speculative else 0,
                                new_tokens=9)
        for _ in range(2 if speculative else 0):
            stats.record_iteration(3, 4)
        return SimpleNamespace(token_ids=[7] * 9, stats=stats)


def _row(rows, concurrency, mode):
    (row,) = [r for r in rows if (r["concurrency"], r["mode"]) == (concurrency, mode)]
    return row


def test_load_rows_report_what_the_clients_saw():
    rows, details = bench_load(PacedRuntime(), ["a", "b"], concurrencies=[1, 2], requests=4, max_new_tokens=8,
                               repeats=1)
    assert [(r["concurrency"], r["mode"]) for r in rows] == [
        (1, "autoregressive"), (1, "speculative"), (2, "autoregressive"), (2, "speculative")]
    for row in rows:
        assert list(row) == LOAD_KEYS
        assert 20 <= row["p50_ttft_ms"] < 35  # sleeps never end early; a loaded machine makes them late
        assert 10 <= row["p50_itl_ms"] < 15  # 40 ms for 4 tokens: per token, not per delivery
        assert 100 <= row["p50_latency_ms"] < 125
        assert row["p99_latency_ms"] >= row["p50_latency_ms"] and row["p99_ttft_ms"] >= row["p50_ttft_ms"]
    # 4 requests of 9 tokens: one after another at 1 client, two at a time at 2
    assert 60 < _row(rows, 1, "autoregressive")["tokens_per_s"] <= 90
    assert 120 < _row(rows, 2, "autoregressive")["tokens_per_s"] <= 180
    spec, ar = _row(rows, 2, "speculative"), _row(rows, 2, "autoregressive")
    assert (spec["acceptance_rate"], spec["mean_gamma"]) == (0.75, 4.0)
    assert (ar["acceptance_rate"], ar["mean_gamma"]) == (0.0, 0.0)
    assert [d["tokens"] for d in details] == [[36]] * 4  # the warm-up's tokens are not counted


def test_open_loop_latency_counts_from_arrival():
    """All 4 requests arrive within a few ms; one client serves them one after another, so the last
    one waits about 300 ms before it is even sent, and its user sees that."""
    rows, _ = bench_load(PacedRuntime(), ["a"], concurrencies=[1], requests=4, rate=1000.0, max_new_tokens=8,
                         repeats=1)
    row = _row(rows, 1, "autoregressive")
    assert row["p99_latency_ms"] > 350 and row["p99_ttft_ms"] > 250
    assert row["p50_itl_ms"] < 15  # waiting is not inter-token time


def test_open_loop_sends_each_request_when_it_arrives():
    """4 clients, so none is busy when a request arrives: the sends follow the arrivals (100 ms apart on
    average), up to the lateness of a thread on a loaded machine."""
    runtime = PacedRuntime()
    bench_load(runtime, ["a", "b"], concurrencies=[4], requests=4, rate=10.0, max_new_tokens=40, repeats=1)
    arrivals = [r.arrival_s for r in request_stream(["a", "b"], 4, 40, rate=10.0)]
    timed = [t for t, tokens, mode in runtime.sent if tokens > 8 and mode == "autoregressive"]  # warm-up: 8 tokens
    assert len(timed) == 4
    for sent, arrival in zip(timed, arrivals):
        assert sent - timed[0] == pytest.approx(arrival - arrivals[0], abs=0.025)


def test_request_stream_is_seeded_and_varied():
    prompts = ["a", "bb", "ccc"]
    stream = request_stream(prompts, 7, 10, seed=3)
    assert stream == request_stream(prompts, 7, 10, seed=3) != request_stream(prompts, 7, 10, seed=4)
    assert {r.prompt for r in stream[:3]} == set(prompts)  # every prompt once per cycle
    assert all(5 <= r.max_new_tokens <= 15 for r in stream) and len({r.max_new_tokens for r in stream}) > 1
    assert all(r.arrival_s is None for r in stream)  # closed loop
    arrivals = [r.arrival_s for r in request_stream(prompts, 4000, 10, rate=50.0)]
    assert arrivals == sorted(arrivals) and arrivals[-1] / 4000 == pytest.approx(1 / 50, rel=0.1)


class Recording:
    """A runtime that notes each timed request's handle, when it was sent and when its last tokens came."""

    def __init__(self, runtime):
        self.runtime, self.requests = runtime, []
        self.forget = runtime.forget

    def submit(self, prompt, params, on_tokens):
        record = {"mode": params.mode, "max_new_tokens": params.max_new_tokens, "sent": time.perf_counter()}

        def tokens(ids):
            on_tokens(ids)
            record["last"] = time.perf_counter()

        record["handle"] = self.runtime.submit(prompt, params, on_tokens=tokens)
        self.requests.append(record)
        return record["handle"]


def test_load_on_the_engine_counts_every_request_and_the_copy_draft_accepts_all(bundles):
    runtime = Recording(speccompile.load(bundles("llama", "copy")))
    rows, details = bench_load(runtime, ["import os", "def f(x):", "class A:"], concurrencies=[1, 3], requests=3,
                               max_new_tokens=24, repeats=1, gamma=4)
    runtime.runtime.close()
    for (row, detail), concurrency in zip(zip(rows[::2], details[::2]), [1, 3]):
        assert (row["concurrency"], row["mode"], detail["mode"]) == (concurrency, "autoregressive", "autoregressive")
    for row, detail in zip(rows, details):
        mine = [r for r in runtime.requests if r["max_new_tokens"] > 8  # the warm-up asks for 8
                and (r["mode"] == "autoregressive") == (row["mode"] == "autoregressive")]
        run = mine[:3] if row["concurrency"] == 1 else mine[3:]
        assert detail["tokens"] == [sum(len(r["handle"].result().token_ids) for r in run)]
        window = max(r["last"] for r in run) - min(r["sent"] for r in run)
        assert row["tokens_per_s"] <= detail["tokens"][0] / window
        assert 0 < row["p50_ttft_ms"] <= row["p50_latency_ms"] <= row["p99_latency_ms"] <= window * 1e3 + 50
        assert row["p99_ttft_ms"] <= row["p99_latency_ms"] and row["p50_itl_ms"] > 0
        if row["mode"] == "speculative":
            assert row["acceptance_rate"] == 1.0 and 1 <= row["mean_gamma"] <= 4
            assert set(detail["gammas_used"]) <= {0, 1, 2, 3, 4}
        else:
            assert (row["acceptance_rate"], row["mean_gamma"]) == (0.0, 0.0)


def test_load_request_that_cannot_fit_is_raised_not_hung(bundles):
    runtime = speccompile.load(bundles("llama", "random"))
    with pytest.raises(SpecCompileError, match="max sequence length"):
        bench_load(runtime, ["import os"], concurrencies=[2], requests=4, max_new_tokens=200, repeats=1)
    runtime.close()


def test_cli_bench_under_load(bundles, tmp_path):
    bundle = str(bundles("llama", "random"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("import os\ndef main():\n")
    common = ["bench", bundle, "--prompts", str(prompts), "--concurrency", "1,2", "--requests", "2",
              "--max-new-tokens", "4", "--repeats", "1"]
    result = CliRunner().invoke(main, [*common, "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [(r["concurrency"], r["mode"]) for r in rows] == [
        (1, "autoregressive"), (1, "speculative"), (2, "autoregressive"), (2, "speculative")]
    assert all(list(r) == LOAD_KEYS for r in rows)
    png = tmp_path / "load.png"
    result = CliRunner().invoke(main, [*common, "--rate", "100", "--plot", str(png)])
    assert result.exit_code == 0, result.output
    assert "speculative" in result.stdout and f"plot: {png}" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_bench_compares_proposers_against_the_same_plain_runs(bundles, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a b a b a b\ndef f(x):\n")
    args = ["bench", str(bundles("llama", "random")), "--prompts", str(prompts), "--max-new-tokens", "8",
            "--repeats", "1", "--gamma", "4", "--proposer", "draft", "--proposer", "ngram"]
    result = CliRunner().invoke(main, args + ["--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["proposer"] for r in rows] == ["draft", "ngram"] and all(list(r) == BENCH_KEYS for r in rows)
    assert rows[0]["ar_tokens_per_s"] == rows[1]["ar_tokens_per_s"]  # one set of plain runs
    assert set(rows[0]["by_proposer"]) == {"draft"} and set(rows[1]["by_proposer"]) <= {"ngram"}
    table = CliRunner().invoke(main, args)
    assert table.exit_code == 0, table.output
    assert table.stdout.splitlines()[0].startswith("autoregressive:") and "ngram" in table.stdout
    single = CliRunner().invoke(main, args[:-4] + ["--proposer", "draft"])
    assert "by_proposer" in single.stdout and "draft " in single.stdout.split("by_proposer")[1].splitlines()[0]
