"""The controller's Prometheus metrics, in a registry of its own (names prefixed ``hotweights_controller_``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hotweights.controller.redundancy import Redundancy


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
        self.standbys_wanted = Gauge(
            "hotweights_controller_standbys_wanted", "Ready standbys each group wants: its engines - 1", ["group"],
            registry=self.registry,
        )  # fmt: skip
        self.standbys_ready = Gauge(
            "hotweights_controller_standbys_ready", "Ready standbys each group has", ["group"], registry=self.registry
        )
        self.spares_ready = Gauge(
            "hotweights_controller_spares_ready", "Warmed spare engines waiting in each group's pool", ["group"],
            registry=self.registry,
        )  # fmt: skip
        self.redundancy_degraded = Gauge(
            "hotweights_controller_redundancy_degraded",
            "1 while a group (once whole) lacks a serving primary or a ready standby in any slot, else 0",
            ["group"],
            registry=self.registry,
        )
        self.redundancy_alert = Gauge(
            "hotweights_controller_redundancy_alert",
            "1 while a group has been degraded for longer than health.redundancy_alert_s, else 0",
            ["group"],
            registry=self.registry,
        )
        self.time_to_redundancy = Histogram(
            "hotweights_controller_time_to_redundancy_seconds",
            "How long each spell without full redundancy lasted, from the cycle that saw it to the one that saw it end",
            buckets=(0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0),
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

        self.state_dir_failing = Gauge(
            "hotweights_controller_state_dir_failing",
            "1 while writes to the state dir fail (state.json and events are kept in memory and retried), else 0",
            registry=self.registry,
        )
        self.state_dir_write_failures = Counter(
            "hotweights_controller_state_dir_write_failures",
            "Failed writes to the state dir, by file (state.json, events.jsonl)",
            ["file"],
            registry=self.registry,
        )
        self.events_held = Gauge(
            "hotweights_controller_events_held",
            "Events kept in memory because events.jsonl could not be written yet",
            registry=self.registry,
        )
        self.events_dropped = Counter(
            "hotweights_controller_events_dropped",
            "Events dropped from memory before they could be written (more were held than the bound); "
            "events.jsonl names each gap in an events_lost line",
            registry=self.registry,
        )

    def export_redundancy(self, state: Redundancy, degraded: bool, alerting: bool) -> None:
        """The gauges of one group's redundancy (``controller.redundancy``)."""
        group = str(state.group)
        self.standbys_wanted.labels(group).set(state.standbys_wanted)
        self.standbys_ready.labels(group).set(state.standbys_ready)
        self.spares_ready.labels(group).set(state.spares_ready)
        self.redundancy_degraded.labels(group).set(1 if degraded else 0)
        self.redundancy_alert.labels(group).set(1 if alerting else 0)
