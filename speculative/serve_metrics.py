"""The server's Prometheus metrics (GET /metrics), in a registry of their own per server.

Counters: requests by outcome (stop, length, cancelled, error, rejected), prompt and generated
tokens. Gauges: running rows, queued requests, reserved KV tokens and their bytes (target, drafter). Histograms: tokens a row emits
per round (its acceptance length; the bonus or recovered token counts, a stop or the budget cuts
it), time to first token, inter-token latency (between a request's successive emissions), time per
output token (per request, after the first) and end-to-end latency.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServeMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, draft_len: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("draftsmith_requests", "Requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("draftsmith_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("draftsmith_generation_tokens", "Tokens generated", registry=r)
        self.running = Gauge("draftsmith_running_requests", "Rows in the running batch", registry=r)
        self.queued = Gauge("draftsmith_queued_requests", "Requests waiting for room in the batch", registry=r)
        self.kv_reserved = Gauge("draftsmith_kv_reserved_tokens", "KV cache slots reserved by running requests",
                                 registry=r)
        self.kv_bytes = Gauge("draftsmith_kv_reserved_bytes", "Those slots' KV bytes, target and drafter (engine ledger)",
                              ["cache"], registry=r)
        self.round_tokens = Histogram("draftsmith_acceptance_length", "Tokens a row emitted per round",
                                      buckets=tuple(float(k) for k in range(1, draft_len + 2)), registry=r)
        self.time_to_first_token = Histogram("draftsmith_time_to_first_token_seconds", "Arrival to first token",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("draftsmith_inter_token_latency_seconds",
                                             "Time between a request's successive emissions",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.time_per_output_token = Histogram("draftsmith_time_per_output_token_seconds",
                                               "Per request: (last token - first token) / (tokens - 1)",
                                               buckets=LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("draftsmith_e2e_request_latency_seconds", "Arrival to the last token",
                                     buckets=LATENCY_BUCKETS, registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
