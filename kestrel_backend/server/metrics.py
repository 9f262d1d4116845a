"""Custom metric families on Triton's metrics endpoint (pb_utils.MetricFamily), Prometheus naming."""

from __future__ import annotations

LATENCY_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120]


class TritonMetrics:
    def __init__(self, pb):
        MF = pb.MetricFamily
        self._requests = MF("kestrel_requests_total", "Requests by skill and outcome", MF.COUNTER)
        self._tokens = MF("kestrel_output_tokens_total", "Output tokens (or objects) by skill", MF.COUNTER)
        self._cached = MF("kestrel_cached_prompt_tokens_total", "Prompt positions whose KV pages came from the prefix "
                          "cache (not prefilled), by skill", MF.COUNTER)
        self._ttft = MF("kestrel_time_to_first_token_seconds", "Time to first output", MF.HISTOGRAM)
        self._latency = MF("kestrel_request_latency_seconds", "End-to-end request latency", MF.HISTOGRAM)
        self._adapter_requests = MF("kestrel_adapter_requests_total",
                                    "Requests that named a LoRA adapter, by adapter and outcome (invalid ones left out: "
                                    "any text could be an id)", MF.COUNTER)
        gauges = MF("kestrel_engine_state", "Engine state: queue_depth, running, kv_pages_used (by requests), "
                    "kv_pages_cached (prompt pages kept for later requests), kv_pages_total, draining (1: stopping)",
                    MF.GAUGE)
        self._gauges = {name: gauges.Metric(labels={"state": name}) for name in
                        ("queue_depth", "running", "kv_pages_used", "kv_pages_cached", "kv_pages_total", "draining")}
        prefix_hits = MF("kestrel_prefix_cache_hits_total",
                         "Requests that started from KV pages of their prompt in the prefix cache", MF.COUNTER)
        self._prefix_hits, self._prefix_hits_counted = prefix_hits.Metric(labels={}), 0
        self._families = (self._requests, self._tokens, self._cached, self._ttft, self._latency,
                          self._adapter_requests, gauges, prefix_hits)
        self._metrics: dict = {}
        self._gauge_values: dict = {}  # what each engine gauge was last set to

    def _metric(self, family, labels: dict, **kw):
        key = (id(family), tuple(sorted(labels.items())))
        if key not in self._metrics:
            self._metrics[key] = family.Metric(labels=labels, **kw)
        return self._metrics[key]

    def request_done(self, skill: str, outcome: str, latency_s: float, ttft_s: float | None = None,
                     output_tokens: int = 0, adapter: str | None = None, cached_tokens: int = 0) -> None:
        self._metric(self._requests, {"skill": skill, "outcome": outcome}).increment(1)
        if adapter is not None and outcome != "invalid":
            self._metric(self._adapter_requests, {"adapter": adapter, "outcome": outcome}).increment(1)
        self._metric(self._latency, {"skill": skill}, buckets=LATENCY_BUCKETS).observe(latency_s)
        if ttft_s is not None:
            self._metric(self._ttft, {"skill": skill}, buckets=LATENCY_BUCKETS).observe(ttft_s)
        if output_tokens:
            self._metric(self._tokens, {"skill": skill}).increment(output_tokens)
        if cached_tokens:
            self._metric(self._cached, {"skill": skill}).increment(cached_tokens)

    def engine_state(self, stats: dict) -> None:
        """The gauges that changed (each update is a round trip to tritonserver)."""
        for gauge, key in (("queue_depth", "queue_depth"), ("running", "running"), ("kv_pages_used", "pages_used"),
                           ("kv_pages_cached", "pages_cached"), ("kv_pages_total", "pages_total"),
                           ("draining", "draining")):
            if self._gauge_values.get(gauge) != stats[key]:
                self._gauges[gauge].set(stats[key])
                self._gauge_values[gauge] = stats[key]
        new_hits = stats["prefix_hits"] - self._prefix_hits_counted  # (the engine's count only grows)
        if new_hits:
            self._prefix_hits.increment(new_hits)
            self._prefix_hits_counted += new_hits
