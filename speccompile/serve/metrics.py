"""Prometheus metrics of the service under vLLM's names, labels and meanings, so that dashboards and
alerts written for vLLM read them unchanged.

Every series carries `model_name` (the served model's id); draft positions are labelled from 0, as
vLLM's `spec_decode_num_accepted_tokens_per_pos`; inter-token latency is observed at every delivery of
tokens after the first (several tokens arrive at once after a verification, as in vLLM with
speculation); time per output token is each request's decode time over its tokens after the first.
Ours alone keep the `speccompile:` prefix (the γ of the last iteration).
"""

import threading

# seconds: vLLM's buckets for request latencies and for the shorter per-token ones
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
# a request's finish_reason (core/request.py) -> vLLM's finished_reason label
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


class Metrics:
    """The service's metrics, on a registry of its own; `finished` records a request when it ends."""

    def __init__(self, runtime, model_name: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = registry = CollectorRegistry()
        self._count = threading.Lock()  # the event loop counts requests in, the engine thread out
        self.in_flight = 0  # submitted and not finished
        labels = {"model_name": model_name}

        def series(kind, name, text, extra=(), **options):
            made = kind(f"vllm:{name}", text, ["model_name", *extra], registry=registry, **options)
            return made if extra else made.labels(**labels)

        def histogram(name, text, buckets):
            return series(Histogram, name, text, buckets=buckets)

        self.labels = labels
        self.drafts = series(Counter, "spec_decode_num_drafts", "Verifications that checked at least one draft token")
        self.draft_tokens = series(Counter, "spec_decode_num_draft_tokens", "Draft tokens proposed")
        self.accepted = series(Counter, "spec_decode_num_accepted_tokens", "Draft tokens accepted")
        self.accepted_per_pos = series(Counter, "spec_decode_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted at each draft position (from 0)", ["position"])
        self.requests = series(Counter, "request_success", "Requests finished", ["finished_reason"])
        self.prompt_tokens = series(Counter, "prompt_tokens", "Prompt tokens processed")
        self.generated = series(Counter, "generation_tokens", "Tokens generated")
        self.prompt_lengths = histogram("request_prompt_tokens", "Prompt tokens per request", LENGTH_BUCKETS)
        self.generation_lengths = histogram("request_generation_tokens", "Tokens generated per request",
                                            LENGTH_BUCKETS)
        self.latency = histogram("e2e_request_latency_seconds", "Request latency from arrival", REQUEST_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Time waiting for a slot", REQUEST_BUCKETS)
        self.inference = histogram("request_inference_time_seconds", "Time from the start of prefill to the end",
                                   REQUEST_BUCKETS)
        self.prefill = histogram("request_prefill_time_seconds", "Time from the start of prefill to the first token",
                                 REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "Time from the first token to the last",
                                REQUEST_BUCKETS)
        self.ttft = histogram("time_to_first_token_seconds", "Time from arrival to the first token", TOKEN_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between deliveries of a request's tokens",
                             TOKEN_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds",
                              "Decode time per token after the first, per request", TOKEN_BUCKETS)
        scheduler = runtime.scheduler
        series(Gauge, "num_requests_running", "Requests decoding or being prefilled").set_function(
            lambda: scheduler.active)
        series(Gauge, "num_requests_waiting", "Requests waiting for a slot").set_function(
            lambda: max(0, self.in_flight - scheduler.active))
        Gauge("speccompile:spec_decode_gamma", "γ of the last decoding iteration (0: a plain step)", ["model_name"],
              registry=registry).labels(**labels).set_function(lambda: scheduler.last_gamma)

    def started(self) -> None:
        with self._count:
            self.in_flight += 1

    def refused(self) -> None:
        with self._count:
            self.in_flight -= 1

    def finished(self, request) -> None:
        """A request ended (on the engine thread): count what it did."""
        with self._count:
            self.in_flight -= 1
        s, generated = request.stats, len(request.generated)
        self.drafts.inc(sum(n for g, n in s.gammas_used.items() if g))
        self.draft_tokens.inc(s.draft_tokens)
        self.accepted.inc(s.accepted_tokens)
        for position, kept in enumerate(s.accepted_at):
            self.accepted_per_pos.labels(position=str(position), **self.labels).inc(kept)
        self.requests.labels(finished_reason=FINISHED_REASONS[request.finish_reason or "error"], **self.labels).inc()
        self.prompt_tokens.inc(len(request.prompt))
        self.generated.inc(generated)
        self.prompt_lengths.observe(len(request.prompt))
        self.generation_lengths.observe(generated)
        self.latency.observe(s.total_ms / 1e3)
        self.queue.observe(s.queue_ms / 1e3)
        self.inference.observe(max(0.0, s.total_ms - s.queue_ms) / 1e3)
        if generated:
            self.ttft.observe(s.ttft_ms / 1e3)
            self.prefill.observe(max(0.0, s.ttft_ms - s.queue_ms) / 1e3)
            self.decode.observe((s.total_ms - s.ttft_ms) / 1e3)
        for gap in s.gaps_ms:
            self.itl.observe(gap / 1e3)
        if generated > 1:
            self.tpot.observe((s.total_ms - s.ttft_ms) / 1e3 / (generated - 1))

    def exposition(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)
