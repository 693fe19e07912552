"""The controller's Prometheus metrics, in a registry of its own (names prefixed ``hotweights_controller_``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class ControllerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.failovers = Counter(
            "hotweights_controller_failovers",
            "Primary changes, by group and kind (automatic, forced, switchover)",
            ["group", "kind"],
            registry=self.registry,
        )
        self.failover_duration = Histogram(
            "hotweights_controller_failover_duration_seconds",
            "From detection (or request) to the new primary answering 200 on /primary",
            ["kind"],
            buckets=(0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=self.registry,
        )
        self.members = Gauge(
            "hotweights_controller_members",
            "Engines by role (primary, standby, none)",
            ["role"],
            registry=self.registry,
        )
        self.daemon_restarts = Counter(
            "hotweights_controller_daemon_restarts",
            "Cache daemon respawns, by group",
            ["group"],
            registry=self.registry,
        )
        self.health_check_latency = Histogram(
            "hotweights_controller_health_check_seconds",
            "Latency of engine health checks, failed ones included",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
            registry=self.registry,
        )
