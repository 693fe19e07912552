"""The engine's Prometheus metrics, in a registry of its own (so tests and embedders never collide).

Gauges that mirror live state (role, in-flight, KV bytes) are read at scrape time from the
objects that own that state, so no handler has to remember to update them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from hotweights.contract import Role, State
from hotweights.standby.roles import Roles

if TYPE_CHECKING:  # the agent's metrics have no scheduler: it imports this without torch
    from hotweights.standby.scheduler import Scheduler

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1, 2.5, 5, 10)
PROMOTION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5)


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "hotweights_engine_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("hotweights_engine_prompt_tokens", "prompt tokens processed", registry=r)
        self.completion_tokens = Counter("hotweights_engine_completion_tokens", "tokens generated", registry=r)
        self.admission = Counter(
            "hotweights_engine_admission",
            "completions by admission verdict (admitted, queued, refused)",
            ["verdict"],
            registry=r,
        )
        self.request_latency = Histogram(
            "hotweights_engine_request_duration_seconds",
            "completion request latency, to the last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "hotweights_engine_time_to_first_token_seconds",
            "time from request to its first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "hotweights_engine_queue_wait_seconds",
            "how long a queued completion waited for a slot (the reference engine's admission)",
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.promotions = Counter("hotweights_engine_promotions", "standby -> primary promotions", registry=r)
        self.promotion_duration = Histogram(
            "hotweights_engine_promotion_duration_seconds",
            "time to promote (KV cache allocation included)",
            buckets=PROMOTION_BUCKETS,
            registry=r,
        )
        self.role = Gauge("hotweights_engine_role", "1 for the engine's current role", ["role"], registry=r)
        self.state = Gauge("hotweights_engine_state", "1 for the engine's current state", ["state"], registry=r)
        self.in_flight = Gauge("hotweights_engine_in_flight_requests", "admitted, unanswered /v1 requests", registry=r)
        self.kv_cache_bytes = Gauge("hotweights_engine_kv_cache_bytes", "bytes of KV cache held", registry=r)
        self.weight_cache = Info("hotweights_engine_weight_cache", "where the weights came from", registry=r)
        self.kv_pool = Gauge(
            "hotweights_engine_kv_pool",
            "the KV pool: its blocks, those sequences hold (used), the sequences running and waiting",
            ["measure"],
            registry=r,
        )
        self.kv_adopted = Gauge(
            "hotweights_engine_kv_adopted_sequences",
            "continuations started from another engine's deposited KV cache, since start",
            registry=r,
        )
        self.kv_adopted_tokens = Gauge(
            "hotweights_engine_kv_adopted_tokens",
            "tokens whose keys and values those continuations copied instead of computing, since start",
            registry=r,
        )

    def bind_adoption(self, scheduler: Scheduler) -> None:
        """The reference engine's continuations from deposited KV caches (``standby.kvshare``)."""
        self.kv_adopted.set_function(lambda: scheduler.adopted)
        self.kv_adopted_tokens.set_function(lambda: scheduler.adopted_tokens)

    def bind_pool(self, pool: Callable[[], dict[str, int]]) -> None:
        """The reference engine's KV pool (``standby.server.EngineContext.pool``), read at scrape time."""
        for measure in ("blocks", "used", "running", "waiting"):
            self.kv_pool.labels(measure).set_function(lambda measure=measure: pool()[measure])

    def bind(self, roles: Roles, kv_cache_bytes: Callable[[], int], weight_cache: dict[str, str]) -> None:
        """Read live state at scrape time from its owners; ``weight_cache`` labels where the weights came from."""
        for role in Role:
            self.role.labels(role.value).set_function(lambda role=role: float(roles.role is role))
        for state in State:
            self.state.labels(state.value).set_function(lambda state=state: float(roles.state is state))
        self.in_flight.set_function(lambda: roles.in_flight)
        self.kv_cache_bytes.set_function(kv_cache_bytes)
        self.weight_cache.info(weight_cache)


class RequestCounter:
    """ASGI middleware counting answered requests by endpoint and status. Paths outside
    ``endpoints`` count as "other", so a scanner cannot blow up the label set."""

    def __init__(self, app: ASGIApp, counter: Counter, endpoints: frozenset[str]) -> None:
        self.app = app
        self.counter = counter
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # what the client sees if the app dies before answering

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            endpoint = scope["path"] if scope["path"] in self.endpoints else "other"
            self.counter.labels(endpoint, str(status)).inc()
