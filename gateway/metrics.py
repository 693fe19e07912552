"""The gateway's Prometheus metrics, in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

HOLD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
SHORT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)  # a worker's own: a refusal, a wait


class GatewayMetrics:
    """Prometheus metrics in a registry of their own."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "hotweights_gateway_requests", "proxied requests, by status sent", ["status"], registry=r
        )
        self.retries = Counter(
            "hotweights_gateway_retries", "requests re-sent after their upstream failed before any byte", registry=r
        )
        self.upstream_errors = Counter(
            "hotweights_gateway_upstream_errors",
            "failed proxied requests, by upstream and kind (connect, disconnected, unavailable, mid_stream)",
            ["upstream", "kind"],
            registry=r,
        )
        self.rejected = Counter(
            "hotweights_gateway_rejected",
            "503s because no primary came (queue_full, hold_timeout)",
            ["reason"],
            registry=r,
        )
        self.held = Gauge("hotweights_gateway_held_requests", "requests waiting for a primary now", registry=r)
        self.hold_seconds = Histogram(
            "hotweights_gateway_hold_seconds", "time a request waited for a primary", buckets=HOLD_BUCKETS, registry=r
        )
        self.primaries = Gauge("hotweights_gateway_primaries", "upstreams answering 200 on /primary", registry=r)
        self.migrations = Counter(
            "hotweights_gateway_migrations",
            "completions whose upstream failed mid-way, by outcome (migrated, failed)",
            ["outcome"],
            registry=r,
        )
        self.tokens_replayed = Counter(
            "hotweights_gateway_tokens_replayed",
            "generated tokens re-sent as prompt to continue a completion",
            registry=r,
        )
        self.cut_to_next_token = Histogram(
            "hotweights_gateway_migration_gap_seconds",
            "time from a completion's upstream failure to its next text on the new primary",
            buckets=HOLD_BUCKETS,
            registry=r,
        )
        self.admission = Counter(
            "hotweights_gateway_admission",
            "requests by admission verdict (admitted, queued, refused)",
            ["verdict"],
            registry=r,
        )
        self.refusal_seconds = Histogram(
            "hotweights_gateway_refusal_seconds",
            "time from a request reaching the gateway's handler to its answer 429 or 503, by who refused it (gateway; "
            "unaccepted: the gateway, once the primary did not accept a connection in time; unavailable: no primary "
            "within the hold; engine: relayed)",
            ["by"],
            buckets=SHORT_BUCKETS,
            registry=r,
        )
        self.wait_seconds = Histogram(
            "hotweights_gateway_wait_seconds",
            "time from a request reaching a worker (its connection set up, or on a kept connection its bytes read) to "
            "the gateway's handler: the worker's event loop, the body's read and checks",
            buckets=SHORT_BUCKETS,
            registry=r,
        )
        self.suspects = Counter(
            "hotweights_gateway_suspect_requests",
            "requests refused because engines failed while serving them, by rule (failures: not re-sent; body: a "
            "suspect body; client: a client at its bound)",
            ["rule"],
            registry=r,
        )
