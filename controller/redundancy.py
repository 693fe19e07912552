"""A group's redundancy: how many ready standbys it wants and has, and how long it has run without them.

A group is safe against its next fault only while it has a serving primary and every other engine slot holds a
ready standby (``engines - 1`` of them): that is *full* redundancy. A fault takes it away (a fenced primary, a dead
standby) and the group is *degraded* until the slots are ready again; the time that takes is a service level of its
own (``hotweights_controller_time_to_redundancy_seconds``). Spare engines (``controller.spares``) are what restores
it quickly; they are reported beside it, not counted in it.

Pure functions and one small state machine, no I/O: ``assess`` reads a snapshot, ``Tracker.observe`` turns the
assessments of successive cycles into the changes to record (lost, restored, alerting). A group is tracked once it
has been full: until then it is starting, not degraded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hotweights.controller.snapshot import MemberView, Snapshot, Status
from hotweights.eventkinds import EventKind

NO_PRIMARY = "no serving primary"


@dataclass(frozen=True)
class Redundancy:
    """One group at one instant."""

    group: int
    standbys_wanted: int  # the group's engines - 1
    standbys_ready: int
    spares_wanted: int
    spares_ready: int
    primary_serving: bool
    unready: tuple[str, ...] = ()  # each slot neither a ready standby nor the serving primary, and why; then a
    # spare's failure

    @property
    def reason(self) -> str | None:
        """Why it is not full (None: full): no serving primary, then ``unready``."""
        return "; ".join(([] if self.primary_serving else [NO_PRIMARY]) + list(self.unready)) or None

    @property
    def full(self) -> bool:
        return self.reason is None

    def shortfall(self) -> str:
        """What full redundancy lacks, in counts that agree with it: without a serving primary, the ready standbys
        are the ones to replace it (all of them may be ready); with one, too few of them are ready."""
        if not self.primary_serving:
            ready = self.standbys_ready
            return f"{NO_PRIMARY}, {ready or 'no'} standby{'s' if ready != 1 else ''} ready to replace it"
        return f"{self.standbys_ready} of {self.standbys_wanted} standbys ready"

    def lost_message(self) -> str:
        """The ``redundancy_lost`` event's sentence: the shortfall, then each slot that is not ready and why."""
        why = f" ({'; '.join(self.unready)})" if self.unready else ""
        return f"group {self.group} lost full redundancy: {self.shortfall()}{why}"


def assess(snap: Snapshot, group: int, spares_wanted: int, spares_ready: int, spare_failure: str = "") -> Redundancy:
    """``group``'s redundancy in ``snap``; the reason names the primary's absence or each slot that is not ready
    (and, then, a spare that failed to start)."""
    members = snap.group(group)
    ready = sum(m.is_ready_standby for m in members)
    serving = any(m.is_serving_primary for m in members)
    missing = [slot_state(m) for m in members if not (m.is_ready_standby or m.is_serving_primary)]
    if (missing or not serving) and spare_failure:
        missing.append(f"its last spare failed: {spare_failure}")
    return Redundancy(group, len(members) - 1, ready, spares_wanted, spares_ready, serving, tuple(missing))


def slot_state(member: MemberView) -> str:
    """Why ``member`` is neither a ready standby nor a serving primary, in a few words."""
    if not member.alive:
        return f"{member.id} {member.exit_reason or member.status}" if member.pid is not None else f"{member.id} absent"
    if member.status == Status.STARTING:
        return f"{member.id} starting ({member.age_s:.1f} s)"
    if member.status in (Status.FAILING, Status.EXITING):
        failed = member.health.consecutive_failures
        return f"{member.id} {member.status} ({failed} failed check{'s' if failed != 1 else ''})"
    return f"{member.id} {member.role} {member.state}"


@dataclass(frozen=True)
class Change:
    """Something to record: ``kind`` is ``redundancy_lost``, ``redundancy_restored`` or ``redundancy_alert``."""

    kind: EventKind
    group: int
    message: str
    degraded_s: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class Episode:
    """A group's current spell without full redundancy."""

    since: float
    first_reason: str
    alerted: bool = False


class Tracker:
    """Turns each cycle's assessments into changes; keeps the last ones for ``GET /cluster`` and the gauges."""

    def __init__(self, alert_after_s: float) -> None:
        self.alert_after_s = alert_after_s
        self.tracked: set[int] = set()  # groups that have been full once
        self.episodes: dict[int, Episode] = {}
        self.last: dict[int, Redundancy] = {}

    def observe(self, now: float, states: list[Redundancy]) -> list[Change]:
        changes = []
        for state in states:
            self.last[state.group] = state
            change = self._observe(now, state)
            if change is not None:
                changes.append(change)
        return changes

    def _observe(self, now: float, state: Redundancy) -> Change | None:
        group, episode = state.group, self.episodes.get(state.group)
        counts = {"standbys_ready": state.standbys_ready, "standbys_wanted": state.standbys_wanted}
        if state.full:
            self.tracked.add(group)
            if episode is None:
                return None
            del self.episodes[group]
            degraded_s = now - episode.since
            message = f"group {group} has full redundancy again after {degraded_s:.3f} s ({episode.first_reason})"
            details = counts | {"reason": episode.first_reason}
            return Change(EventKind.REDUNDANCY_RESTORED, group, message, degraded_s, details)
        if group not in self.tracked:
            return None
        if episode is None:
            assert state.reason is not None
            self.episodes[group] = Episode(now, state.reason)
            return Change(
                EventKind.REDUNDANCY_LOST, group, state.lost_message(), 0.0, counts | {"reason": state.reason}
            )
        degraded_s = now - episode.since
        if not episode.alerted and degraded_s > self.alert_after_s:
            episode.alerted = True
            message = f"group {group} has run without full redundancy for {degraded_s:.1f} s: {state.reason}"
            return Change(EventKind.REDUNDANCY_ALERT, group, message, degraded_s, counts | {"reason": state.reason})
        return None

    def degraded_s(self, group: int, now: float) -> float:
        episode = self.episodes.get(group)
        return now - episode.since if episode else 0.0

    def degraded(self, group: int) -> bool:
        """Whether the group, full once, is not now."""
        return group in self.episodes

    def alerting(self, group: int) -> bool:
        episode = self.episodes.get(group)
        return episode is not None and episode.alerted

    def to_json(self, now: float) -> list[dict[str, Any]]:
        """Each group's last assessment, with how long it has been degraded and whether that is alerting."""
        return [
            {
                "group": group,
                "standbys_wanted": state.standbys_wanted,
                "standbys_ready": state.standbys_ready,
                "spares_wanted": state.spares_wanted,
                "spares_ready": state.spares_ready,
                "full": state.full,
                "degraded": self.degraded(group),
                "degraded_s": round(self.degraded_s(group, now), 3),
                "reason": state.reason,
                "alert": self.alerting(group),
            }
            for group, state in sorted(self.last.items())
        ]
