"""Prometheus metrics of the server, named as vLLM names its own (prefix `kvlab:`, or `vllm:` for
clients that read vLLM's series).

One registry per server, so several servers (tests) in one process never share counters.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds; as vLLM's buckets, from a cached short prompt to a long CPU prefill.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
    2.5,
)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServeMetrics:
    """Counters, gauges and histograms the engine and the HTTP layer update (already labelled with the
    model's name)."""

    def __init__(self, model_name: str, prefix: str = "kvlab") -> None:
        self.registry = registry = CollectorRegistry()
        self.model_name = model_name
        model = {"model_name": model_name}

        def named(name: str) -> str:
            return name.replace("kvlab:", f"{prefix}:", 1)

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(named(name), text, ["model_name"], registry=registry).labels(**model)

        def counter(name: str, text: str) -> Counter:
            return Counter(named(name), text, ["model_name"], registry=registry).labels(**model)

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(named(name), text, ["model_name"], buckets=buckets, registry=registry).labels(**model)

        self.running = gauge("kvlab:num_requests_running", "Requests prefilling or decoding.")
        # Set through `set_waiting`: the requests waiting in the engine and those waiting for tokens.
        self.waiting = gauge(
            "kvlab:num_requests_waiting",
            "Requests queued for a slot (prefix fetches included) or for tokens of max_tokens_in_system.",
        )
        self._waiting_lock = threading.Lock()
        self._num_waiting = {"engine": 0, "tokens": 0}
        self.tokens_in_system = gauge(
            "kvlab:num_tokens_in_system", "Prompt + max_tokens of the requests running and queued."
        )
        self.fetching = gauge("kvlab:num_requests_fetching", "Requests whose prefix is being looked up or fetched.")
        self.prompt_tokens = counter("kvlab:prompt_tokens", "Prompt tokens of admitted requests.")
        self.generation_tokens = counter("kvlab:generation_tokens", "Generated tokens.")
        self.prefix_fetched_tokens = counter(
            "kvlab:prefix_fetched_tokens", "Prompt tokens restored from the prefix store."
        )
        self.prefix_recomputed_tokens = counter("kvlab:prefix_recomputed_tokens", "Prompt tokens computed by prefill.")
        self.num_draft_tokens = counter("kvlab:spec_decode_num_draft_tokens", "Tokens drafted (lossless mode).")
        self.num_accepted_tokens = counter("kvlab:spec_decode_num_accepted_tokens", "Drafted tokens accepted.")
        # vLLM's meaning: proposals made. A round that stood aside (drafted nothing) is a plain step.
        self.num_drafts = counter("kvlab:spec_decode_num_drafts", "Draft/verify rounds that drafted a token.")
        self.cost_model_error = gauge(
            "kvlab:cost_model_mean_relative_error",
            "The round planner's cost model: mean |predicted - measured| / measured seconds per tick (lossless).",
        )
        self.cost_model_ticks = gauge("kvlab:cost_model_ticks", "Ticks the cost model predicted before seeing them.")
        self.ttft = histogram("kvlab:time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram(
            "kvlab:inter_token_latency_seconds",
            "Time between a request's tokens (tokens emitted together share the interval).",
            ITL_BUCKETS,
        )
        self.e2e = histogram("kvlab:e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS)
        self._success = Counter(
            named("kvlab:request_success"), "Finished requests.", ["model_name", "finished_reason"], registry=registry
        )
        self._failure = Counter(
            named("kvlab:request_failure"), "Requests refused, cancelled or failed.", ["model_name", "reason"],
            registry=registry,
        )

    def set_waiting(self, *, engine: int | None = None, tokens: int | None = None) -> None:
        """Requests waiting in the engine for a slot (`engine`, prefix fetches included) or before it for
        tokens (`tokens`); `num_requests_waiting` is their sum. Thread-safe."""
        with self._waiting_lock:
            for part, value in (("engine", engine), ("tokens", tokens)):
                if value is not None:
                    self._num_waiting[part] = value
            self.waiting.set(sum(self._num_waiting.values()))

    def one_more_waiting(self) -> None:
        """A request joined the engine's queue (the engine's thread sets the exact count at its next tick)."""
        with self._waiting_lock:
            self._num_waiting["engine"] += 1
            self.waiting.set(sum(self._num_waiting.values()))

    def finished(self, reason: str) -> None:
        self._success.labels(model_name=self.model_name, finished_reason=reason).inc()

    def failed(self, reason: str) -> None:
        self._failure.labels(model_name=self.model_name, reason=reason).inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
