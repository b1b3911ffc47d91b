"""The request-level engine end to end on tiny bundles: exactness under churn, per-request random
streams, queueing, cancellation, refusals, stop strings, and the submit / stream / asyncio API."""

import asyncio
import random
import threading
import time

import pytest

import speccompile
from speccompile.errors import SpecCompileError
from tests.runtime.test_generate import hf_greedy

VOCAB_SPAN = range(3, 250)


def random_prompt(rng: random.Random) -> list[int]:
    return [rng.choice(VOCAB_SPAN) for _ in range(rng.randint(1, 20))]


@pytest.fixture(scope="module")
def runtime(bundles):
    with speccompile.load(bundles("llama", "random"), prefill_chunk=8) as rt:  # max batch 4, max_seq 96
        yield rt


def test_greedy_requests_joining_and_leaving_at_random_equal_running_alone_and_hf(runtime, checkpoints):
    rng = random.Random(0)
    jobs = [(random_prompt(rng), rng.randint(1, 30), rng.choice([1, 4, "auto", None])) for _ in range(12)]
    handles = []
    for prompt, max_new, gamma in jobs:  # arrivals at random moments while others decode
        handles.append(runtime.submit(prompt, max_new_tokens=max_new, gamma=gamma, mode="speculative"))
        time.sleep(rng.random() * 0.02)
    together = [h.result(timeout=120).token_ids for h in handles]
    alone = [runtime.generate([p], max_new_tokens=n)[0].token_ids for p, n, _ in jobs]
    assert together == alone
    for (prompt, max_new, _), tokens in list(zip(jobs, together))[:3]:
        assert tokens == hf_greedy(checkpoints("llama"), prompt, max_new)[: len(tokens)]
        assert len(tokens) == max_new or tokens[-1] in runtime.tokenizer.eos_token_ids


def test_a_sampled_request_depends_on_its_seed_not_its_company(runtime):
    prompt = [5, 17, 33, 2, 9]
    sampled = dict(max_new_tokens=24, temperature=0.9, top_p=0.95, seed=1234, gamma=4)
    alone = runtime.submit(prompt, **sampled).result(timeout=60).token_ids
    company = [runtime.submit(random_prompt(random.Random(i)), max_new_tokens=20 + i, temperature=0.7, seed=i,
                              gamma=1) for i in range(3)]
    crowded = runtime.submit(prompt, **sampled)
    for h in company:
        h.result(timeout=60)
    assert crowded.result(timeout=60).token_ids == alone
    other_seed = runtime.submit(prompt, **{**sampled, "seed": 99}).result(timeout=60).token_ids
    assert other_seed != alone


def test_requests_beyond_max_batch_queue_and_cancelling_frees_a_slot(runtime, monkeypatch):
    verify = runtime.target.verify
    monkeypatch.setattr(runtime.target, "verify", lambda *args, **kw: time.sleep(0.03) or verify(*args, **kw))
    slow = dict(max_new_tokens=80, gamma=1)  # 30 ms an iteration: over 1 s each, in parallel
    long = [runtime.submit([7, 8, 9], **slow) for _ in range(runtime.max_batch)]
    waiting = runtime.submit([10, 11], max_new_tokens=5, gamma=1)
    time.sleep(0.3)
    assert not waiting.done  # every slot is taken: it waits, it is not refused
    long[0].cancel()
    assert waiting.result(timeout=60).finish_reason in ("length", "stop")
    assert not all(h.done for h in long[1:])  # it ran in the freed slot, not after everyone
    cancelled = long[0].result(timeout=60)
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) < 80
    for h in long[1:]:
        h.cancel()
        h.result(timeout=60)


def test_a_request_too_long_for_the_bundle_is_refused_while_the_others_go_on(runtime):
    running = runtime.submit([1, 2, 3], max_new_tokens=40, gamma=4)
    with pytest.raises(SpecCompileError, match="max sequence length 96"):
        runtime.submit([5] * 60, max_new_tokens=40, gamma=4)
    assert len(running.result(timeout=60).token_ids) == 40


def test_stop_strings_end_the_text_before_them(runtime):
    prompt = "def parse_args(argv):"
    full = runtime.generate([prompt], max_new_tokens=30)[0]
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop.strip(), full.text
    [cut] = runtime.generate([prompt], max_new_tokens=30, stop=[stop, "never appears"])
    assert cut.text == full.text[: full.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.token_ids == full.token_ids[: len(cut.token_ids)]
    completing = runtime.tokenizer.decode_continuation(runtime.tokenizer.encode(prompt), cut.token_ids)
    assert stop in completing and stop not in runtime.tokenizer.decode_continuation(
        runtime.tokenizer.encode(prompt), cut.token_ids[:-1])  # the last kept token completes it


def test_stream_yields_the_result_tokens_in_order(runtime):
    handle = runtime.submit([4, 5, 6], max_new_tokens=25, gamma=4)
    streamed = [token for chunk in handle.stream() for token in chunk]
    assert streamed == handle.result().token_ids and len(streamed) == 25


def test_asyncio_handles(runtime):
    async def main():
        handles = [runtime.submit_async([4, 5, 6], max_new_tokens=12), runtime.submit_async([9, 9], max_new_tokens=7)]
        streamed = [token async for chunk in handles[0].stream() for token in chunk]
        results = [await h.result() for h in handles]
        return streamed, results

    streamed, results = asyncio.run(main())
    assert streamed == results[0].token_ids
    assert [r.token_ids for r in results] == [runtime.generate([p], max_new_tokens=n)[0].token_ids
                                              for p, n in (([4, 5, 6], 12), ([9, 9], 7))]


def test_close_cancels_what_is_in_flight(bundles):
    """close() during an iteration: the engine stops after it, and what is left ends cancelled (each
    iteration adds at most γ + 1 = 2 of a request's 80 tokens)."""
    runtime = speccompile.load(bundles("llama", "random"))
    started = threading.Event()

    def hold_the_first_iteration(tokens):
        if not started.is_set():
            started.set()
            time.sleep(0.3)  # the engine thread is inside an iteration while close() is called

    handles = [runtime.submit([3, 4], max_new_tokens=80, gamma=1, on_tokens=hold_the_first_iteration)
               for _ in range(runtime.max_batch + 2)]
    assert started.wait(10)
    runtime.close()
    reasons = [h.result(timeout=10).finish_reason for h in handles]
    assert "cancelled" in reasons and all(h.done for h in handles)


def test_threads_submitting_at_first_use_start_one_engine(bundles):
    """Eight threads submit at once to a runtime that has no engine thread yet: one starts, and every
    request is answered as it would be alone."""
    runtime = speccompile.load(bundles("llama", "random"))
    expected = runtime.generate([[3, 4, 5]], max_new_tokens=12, gamma=4)[0].token_ids
    runtime.close()  # no engine thread now
    barrier, results = threading.Barrier(8), []
    others = set(engine_threads())  # other runtimes' (of other tests)

    def client():
        barrier.wait()
        results.append(runtime.submit([3, 4, 5], max_new_tokens=12, gamma=4).result(timeout=60).token_ids)

    threads = [threading.Thread(target=client) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    started = set(engine_threads()) - others
    runtime.close()
    assert results == [expected] * 8 and len(started) == 1


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "speccompile-engine"]


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_prompts_prefilled_together_right_padded_give_hf_s_tokens(family, bundles, checkpoints):
    """Three prompts of 6, 7 and 8 tokens join in one target call (padded to 8: an eighth of it padding),
    sampled and greedy alike; each continues as HF continues it alone, and as it samples alone."""
    rng = random.Random(1)
    prompts = [[rng.choice(VOCAB_SPAN) for _ in range(n)] for n in (6, 7, 8)]
    with speccompile.load(bundles(family, "random")) as rt:
        rows = []
        forward = rt.target.forward
        rt.target.forward = lambda tokens, *a, **kw: rows.append(tokens.shape) or forward(tokens, *a, **kw)
        together = [r.token_ids for r in rt.generate(prompts, max_new_tokens=12, gamma=4)]
        assert rows[0] == (3, 8)
        sampled = dict(max_new_tokens=12, temperature=0.8)  # request i is seeded 5 + i
        assert [r.token_ids for r in rt.generate(prompts, seed=5, **sampled)] == \
            [rt.generate([p], seed=5 + i, **sampled)[0].token_ids for i, p in enumerate(prompts)]
    for prompt, tokens in zip(prompts, together):
        assert tokens == hf_greedy(checkpoints(family), prompt, 12)[: len(tokens)]
