"""What a round measured, from the controller's events and the clients' request records.

Controller timings: ``detection_ms`` runs from the fault to the controller's first event about a
hurt process (it includes the health checks a hang needs); ``fence_ms`` and ``promotion_ms`` are the
durations the controller recorded, ``respawn_ms`` a respawned daemon's or gateway worker's (from the
controller's decision to serving). Client timings, all ends of successful (correct 200) requests:
``lb_convergence_ms`` from the fault to the first success of a request sent after it, and
``outage_ms`` from the last success before the fault to that same first success. A round of several
faults (flapping's kills) is measured at each of them and reports its worst one: a later kill that
finds no ready standby is what clients wait for longest.

``fault_outages_ms`` lists each fault's outage (a storm's many). ``redundancy_ms`` runs from the round's last fault to
the controller's ``redundancy_restored`` event: the group has a serving primary and every other slot a ready
standby again, safe against the next fault.

``quiet_outage_ms`` is the same formula at an instant QUIET_LEAD_S before the (first) fault, when nothing
was wrong: the floor that the load and the requests' own time set (about one request interval plus one
request's time). ``outage_ms`` minus it is what the fault cost clients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from hotweights.chaos.clusterview import EVENT_TIME_RESOLUTION_S, event_time, since_ms
from hotweights.chaos.load import RequestRecord
from hotweights.eventkinds import EventField, EventKind

MEASURES = (
    "detection_ms", "fence_ms", "promotion_ms", "lb_convergence_ms", "outage_ms", "quiet_outage_ms",
    "respawn_ms", "batch_back_ms", "redundancy_ms",
)  # fmt: skip
QUIET_LEAD_S = 0.5


@dataclass
class RoundResult:
    scenario: str
    index: int
    started_at: float  # time.time()
    skipped: str | None = None
    ended_at: float = 0.0
    fault_at: float | None = None
    later_faults: list[float] = field(default_factory=list)
    detected_at: float | None = None
    promoted_at: float | None = None
    recovered_at: float | None = None
    detection_ms: float | None = None
    fence_ms: float | None = None
    promotion_ms: float | None = None
    lb_convergence_ms: float | None = None
    outage_ms: float | None = None
    quiet_outage_ms: float | None = None  # the outage formula at a fault-free instant just before the fault
    respawn_ms: float | None = None  # a respawned daemon's or gateway's: the controller's decision to serving
    batch_back_ms: float | None = None  # the slowest return of a batch engine that yielded in this round
    redundancy_ms: float | None = None  # from the last fault to full redundancy again
    fault_outages_ms: list[float] = field(default_factory=list)  # each fault's outage, in order
    requests: int = 0
    failed: int = 0
    broken_streams: int = 0  # of the failed: streams cut mid-way
    refused: int = 0  # of the failed: no connection at all (the load balancer's port refused it)
    suspects: int = 0  # of the failed: refused by the gateway as suspect (gateway.suspect_after)
    retried: int | None = None  # the gateway's re-sent requests; None for another load balancer
    wrong: int = 0
    split_brain: int = 0
    leak: str | None = None
    problem: str | None = None
    client_errors_expected: bool = False
    suspects_expected: bool = False
    memory_before: dict[str, Any] = field(default_factory=dict)
    memory_after: dict[str, Any] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # the first few, for the report

    def failures(self, judge_client_errors: bool) -> list[str]:
        """Why this round fails the drill; [] when it passes."""
        found = []
        if self.split_brain:
            found.append(f"{self.split_brain} split-brain sample(s)")
        if self.wrong:
            found.append(f"{self.wrong} wrong output(s)")
        if self.leak:
            found.append(f"leak: {self.leak}")
        if self.problem:
            found.append(self.problem)
        errors = self.failed - (self.suspects if self.suspects_expected else 0)
        if judge_client_errors and errors and not self.client_errors_expected:
            first = f", the first {self.errors[0]}" if self.errors else ""
            found.append(f"{errors} client-visible error(s){first}")
        if judge_client_errors and self.broken_streams and not self.client_errors_expected:
            found.append(f"{self.broken_streams} broken stream(s)")
        return found

    def to_json(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def apply_events(result: RoundResult, events: Sequence[dict[str, Any]], targets: set[str]) -> None:
    """Fill the controller timings from the events recorded since the fault (oldest first)."""
    assert result.fault_at is not None
    for event in events:
        subject = {event.get(EventField.MEMBER), event.get(EventField.SERVICE)}
        if result.detected_at is None and subject & targets:
            result.detected_at = event_time(event)
            result.detection_ms = since_ms(result.fault_at, result.detected_at)
        if result.fence_ms is None and event["kind"] == EventKind.FENCE and EventField.FENCE_MS in event:
            result.fence_ms = event[EventField.FENCE_MS]
        if result.promotion_ms is None and event["kind"] == EventKind.PROMOTE:
            result.promotion_ms = event[EventField.PROMOTE_MS]
            result.promoted_at = event_time(event)
        if result.respawn_ms is None and event["kind"] == EventKind.RESPAWN and EventField.DURATION_MS in event:
            result.respawn_ms = event[EventField.DURATION_MS]
        last_fault = max([result.fault_at, *result.later_faults])
        restored = (
            event["kind"] == EventKind.REDUNDANCY_RESTORED and event_time(event) >= last_fault - EVENT_TIME_RESOLUTION_S
        )
        if result.redundancy_ms is None and restored:
            result.redundancy_ms = since_ms(last_fault, event_time(event))
        if event["kind"] == EventKind.BATCH_RETURN and event.get(EventField.BACK_MS) is not None:
            result.batch_back_ms = max(result.batch_back_ms or 0.0, event[EventField.BACK_MS])


def apply_requests(result: RoundResult, records: Sequence[RequestRecord], until: float) -> None:
    """Fill the client numbers from every request record. A request belongs to the round in which it
    ended ([started_at, until)): a failure shows when it ends, and a request held across rounds fails
    because of the fault of the round it ends in."""
    mine = [r for r in records if result.started_at <= r.end < until]
    result.requests = len(mine)
    bad = [r for r in mine if not r.ok]
    result.failed = len(bad)
    result.broken_streams = sum(r.broken_stream for r in bad)
    result.refused = sum(r.status is None and r.error.startswith("ConnectError") for r in bad)
    result.suspects = sum(r.suspect for r in bad)
    result.wrong = sum(r.correct is False for r in mine)
    result.errors = [f"{r.status}: {r.error}" for r in bad[:3]]
    if result.fault_at is None:
        return
    result.fault_outages_ms = []
    for fault_at in (result.fault_at, *result.later_faults):
        gap = _gap(records, fault_at)
        if gap is None:
            continue
        last, first = gap
        result.lb_convergence_ms = max(result.lb_convergence_ms or 0.0, (first - fault_at) * 1000)
        if last is not None:
            result.fault_outages_ms.append((first - last) * 1000)
            result.outage_ms = max(result.outage_ms or 0.0, (first - last) * 1000)
    quiet = _gap(records, result.fault_at - QUIET_LEAD_S)
    if quiet is not None and quiet[0] is not None and quiet[1] <= result.fault_at:
        result.quiet_outage_ms = (quiet[1] - quiet[0]) * 1000


def _gap(records: Sequence[RequestRecord], at: float) -> tuple[float | None, float] | None:
    """(end of the last success before ``at`` or None, end of the first success of a request sent at or after
    ``at``); None when no request sent after ``at`` succeeded."""
    before = [r.end for r in records if r.ok and r.end <= at]
    after = [r.end for r in records if r.ok and r.start >= at]
    if not after:
        return None
    return (max(before) if before else None), min(after)
