"""Prometheus metrics of the server (prometheus-client), served at GET /metrics.

Counters and histograms are updated by the serving layer as requests finish; the gauges (and
the preemption counter) are read from `AsyncLLMEngine.status()` when /metrics is scraped. Each
server owns its registry (several apps can live in one test process). Latencies are seconds,
measured on the server from the moment a request was parsed:

- TTFT: until the first generated token reached the HTTP layer;
- TPOT: (e2e - TTFT) / (output tokens - 1) of each finished sample with >= 2 tokens;
- e2e: until the request finished (all its samples).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Buckets in seconds: CPU decode of a small model is tens of ms per token, a GPU one ms.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class Metrics:
    """All server metrics in one registry (`ferrum_` prefix)."""

    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = ["model_name"]
        self.requests = Counter("ferrum_requests", "HTTP API requests by endpoint and status code",
                                lab + ["endpoint", "status"], registry=r)
        self.finished = Counter("ferrum_request_success", "finished samples by finish reason",
                                lab + ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("ferrum_prompt_tokens", "prompt tokens of accepted requests",
                                     lab, registry=r)
        self.generation_tokens = Counter("ferrum_generation_tokens", "generated tokens", lab, registry=r)
        self.ttft = Histogram("ferrum_time_to_first_token_seconds", "time to first token", lab,
                              buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("ferrum_time_per_output_token_seconds", "time per output token after "
                              "the first", lab, buckets=_TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("ferrum_e2e_request_latency_seconds", "request latency", lab,
                             buckets=_E2E_BUCKETS, registry=r)
        self.running = Gauge("ferrum_num_requests_running", "sequences running", lab, registry=r)
        self.waiting = Gauge("ferrum_num_requests_waiting", "sequences waiting", lab, registry=r)
        self.kv_usage = Gauge("ferrum_kv_cache_usage_ratio", "fraction of KV blocks in use (0..1)",
                              lab, registry=r)
        self.kv_free = Gauge("ferrum_kv_blocks_free", "free KV blocks (cached prefix blocks count "
                             "as free)", lab, registry=r)
        self.prefix_hit = Gauge("ferrum_prefix_cache_hit_rate", "prefix-cache hit rate (0..1)",
                                lab, registry=r)
        self.healthy = Gauge("ferrum_engine_healthy", "1 while the engine loop is alive", lab,
                             registry=r)
        self.preemptions = Counter("ferrum_num_preemptions", "sequences preempted (their KV freed, "
                                   "recomputed later) since the engine started", lab, registry=r)
        self._preemptions_seen = 0
        self.model_name = model_name
        self._l(self.preemptions)   # exported as 0 before the first preemption

    def _l(self, metric, **labels):
        return metric.labels(model_name=self.model_name, **labels)

    def count_request(self, endpoint: str, status: int) -> None:
        """One HTTP request to `endpoint` answered with `status`."""
        self._l(self.requests, endpoint=endpoint, status=str(status)).inc()

    def observe_finish(self, finish_reason: str | None) -> None:
        """One finished sample; None counts as "abort"."""
        self._l(self.finished, finish_reason=finish_reason or "abort").inc()

    def add_tokens(self, prompt: int = 0, generated: int = 0) -> None:
        """Add prompt / generated token counts."""
        if prompt:
            self._l(self.prompt_tokens).inc(prompt)
        if generated:
            self._l(self.generation_tokens).inc(generated)

    def observe_ttft(self, seconds: float) -> None:
        """Time to first token of one request, seconds."""
        self._l(self.ttft).observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        """Mean time per output token after the first of one request, seconds."""
        self._l(self.tpot).observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        """End-to-end latency of one request, seconds."""
        self._l(self.e2e).observe(seconds)

    def render(self, status: dict) -> bytes:
        """Set the gauges from an engine status dict and return the text exposition format."""
        self._l(self.running).set(status.get("num_running", 0))
        self._l(self.waiting).set(status.get("num_waiting", 0))
        self._l(self.kv_usage).set(status.get("kv_cache_usage", 0.0))
        self._l(self.kv_free).set(status.get("kv_blocks_free", 0))
        self._l(self.prefix_hit).set(status.get("prefix_cache_hit_rate", 0.0))
        self._l(self.healthy).set(1 if status.get("healthy", True) else 0)
        preemptions = status.get("num_preemptions", 0)   # the engine's running total
        if preemptions > self._preemptions_seen:
            self._l(self.preemptions).inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions
        return generate_latest(self.registry)
