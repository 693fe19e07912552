"""The HA loop's decision core: from one group's part of a snapshot to what to do, with no I/O.

Every function here is pure: it reads immutable views (``Snapshot``'s members), the few facts the loop keeps
between cycles (each slot's restart backoff, a leadership refusal) and a clock reading, and returns a typed
decision. ``controller.ha`` carries the decisions out (fence, promote, start, record), one group at a time; these
functions never touch a process, a socket or the event log, so each can be read alone and is tested with tables of
situations and the decisions expected (``tests/test_decide.py``).

For each failover group the loop takes the first of these that applies (``controller.ha`` has the order):

1. ``failed_primary``: two live primaries: resolve (keep one); a primary that failed: fail over from it, step by
   step (``next_failover_step``: fence, ask, promote, restart);
2. a queued REST intent (``Intent``), one at a time per group;
3. ``plan_slots``: standbys that failed are fenced, absent or exited slots (re)started once the group's daemons
   serve, a slot whose engines exit before ever being ready only after its backoff;
4. ``missing_primary``: no primary: elect the best ready standby (``best_standby``).

Beside them, for every engine slot and service (cache daemon, gateway worker): its failed starts in a row that
failed the same way (``after_start``), and whether ``up`` gives up on its stack (``give_up``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, NamedTuple

from hotweights.contract import Role
from hotweights.controller.graydecide import slowness_of
from hotweights.controller.snapshot import MemberView, Status
from hotweights.eventkinds import FailoverKind

Verdict = Callable[[MemberView], str | None]  # why an engine counts as failed (``controller.health``), or None
# Failed starts of one slot in a row, each for the same reason, after which ``up`` stops its stack and exits: the
# first is reported at once, the others confirm that retrying does not help (backoff 0.5, 1 s between them).
GIVE_UP_AFTER = 3
BACKOFF_FIRST_S = 0.5  # the wait before the first retry of something that keeps failing; it doubles with each retry
BACKOFF_MAX_S = 30.0


def backoff_s(failures: int) -> float:
    """The wait before retry number ``failures`` (1: the first retry): 0.5 s, doubling, at most 30 s."""
    return min(BACKOFF_MAX_S, BACKOFF_FIRST_S * 2 ** (failures - 1))


class Intent(StrEnum):
    """What a REST request asks the loop to do (``Ha.request``); each one is an action of ``controller.ha``."""

    SWITCHOVER = "switchover"
    FAILOVER = "failover"
    DRAIN = "drain"
    PROMOTE = "promote"
    ADD = "add"
    DELETE = "delete"
    RESTART_CACHE = "restart_cache"
    ROLLOUT = "rollout"


@dataclass(frozen=True)
class ResolveSplitBrain:
    """Two or more live primaries in one group: keep one, fence the others."""

    live: tuple[MemberView, ...]


@dataclass(frozen=True)
class FailOver:
    """Fence ``old`` (a primary that failed, for ``reason``) and promote the best ready standby."""

    old: MemberView
    reason: str


@dataclass(frozen=True)
class PrimaryDecision:
    """Step 1's answer: ``action`` (None: the primary is fine, or the group has none), and ``stale``: records of
    dead primaries beside a live one, to be set back to standby (they restart as standbys)."""

    action: ResolveSplitBrain | FailOver | None
    stale: tuple[str, ...] = ()


def failed_primary(primaries: Sequence[MemberView], is_failed: Verdict) -> PrimaryDecision:
    """Step 1 for a group whose primaries (by the records, in slot order) are ``primaries``. With one live primary
    the dead records are stale and the live one is judged; with none, the first record is (a dead primary is
    failed over from)."""
    live = [p for p in primaries if p.alive]
    if len(live) > 1:
        return PrimaryDecision(ResolveSplitBrain(tuple(live)))
    stale = tuple(p.id for p in primaries if not p.alive) if live else ()
    old = live[0] if live else (primaries[0] if primaries else None)
    reason = is_failed(old) if old is not None else None
    return PrimaryDecision(FailOver(old, reason) if old is not None and reason else None, stale)


def keep_in_split_brain(live: Sequence[MemberView]) -> MemberView:
    """Of several live primaries, the one to keep: a serving one before one that is not, then the oldest."""
    return max(live, key=lambda m: (m.is_serving_primary, m.age_s))


# --- a failover, step by step ------------------------------------------------------------------------------------
# ``Ha.failover`` asks ``next_failover_step`` what to do, does it (fence, ask, promote), records what it found in the
# ``FailoverFacts`` and asks again, until the answer is a ``Stop``; every decision of a failover is made here.


class Promotion(NamedTuple):
    """What promoting a standby came to: ``done`` (it answers /primary 200), its duration, the engine's message
    (or why it failed)."""

    done: bool
    ms: float
    message: str


@dataclass(frozen=True)
class FailoverFacts:
    """What a failover of ``group`` has found out so far; None: not asked yet."""

    group: int
    old: MemberView | None  # the primary failed over from (None: a forced failover in a group with no primary)
    candidate: MemberView | None  # the standby to promote: the request's, else the best ready one (None: none)
    fenced: bool | None = None  # ``old`` killed (False: still alive after SIGKILL)
    stranger: bool | None = None  # after the fence: a process we do not supervise answers /primary on its port
    serving: tuple[str, ...] | None = None  # with no ``old``: the group's engines that answer /primary 200
    promotion: Promotion | None = None


@dataclass(frozen=True)
class FenceOld:
    """Kill ``old``, so that it cannot serve beside the engine promoted next."""

    old: MemberView


@dataclass(frozen=True)
class AskStranger:
    """Ask ``old``'s port for /primary: an engine we do not supervise may hold it (and serve)."""

    old: MemberView


@dataclass(frozen=True)
class AskServing:
    """Nothing fenced: ask every engine of the group for /primary (one our checks do not know as primary yet)."""

    group: int


@dataclass(frozen=True)
class Promote:
    candidate: MemberView


class FailoverOutcome(StrEnum):
    """How a failover ended."""

    PROMOTED = "promoted"
    FENCE_FAILED = "fence_failed"  # the old primary is still alive after SIGKILL: another would make two
    STRANGER = "stranger"  # a process we do not supervise answers /primary on the old primary's port
    SERVING = "serving"  # nothing fenced, and an engine of the group answers /primary 200
    NO_STANDBY = "no_standby"
    PROMOTE_FAILED = "promote_failed"  # retried by the loop, after its backoff


@dataclass(frozen=True)
class Stop:
    """The failover ends with ``outcome``; ``restart_old``: the old primary's slot starts again (as a standby);
    ``release``: the group's leadership is given up (another host's standby may take over)."""

    outcome: FailoverOutcome
    restart_old: bool = False
    release: bool = False


FailoverStep = FenceOld | AskStranger | AskServing | Promote | Stop


def next_failover_step(facts: FailoverFacts) -> FailoverStep:
    """The failover's next step from what it found so far: fence the old primary, and stop if it outlives
    SIGKILL or a stranger answers on its port (with none, stop if an engine of the group answers /primary); then
    promote the candidate; stop with none to promote (releasing the leadership), or once the promotion is done
    or failed. The old primary's slot restarts once nothing more is to be done with it."""
    old = facts.old
    if old is not None:
        if facts.fenced is None:
            return FenceOld(old)
        if not facts.fenced:
            return Stop(FailoverOutcome.FENCE_FAILED)
        if facts.stranger is None:
            return AskStranger(old)
        if facts.stranger:
            return Stop(FailoverOutcome.STRANGER)
    elif facts.serving is None:
        return AskServing(facts.group)
    elif facts.serving:
        return Stop(FailoverOutcome.SERVING)
    if facts.candidate is None:
        return Stop(FailoverOutcome.NO_STANDBY, restart_old=old is not None, release=True)
    if facts.promotion is None:
        return Promote(facts.candidate)
    done = FailoverOutcome.PROMOTED if facts.promotion.done else FailoverOutcome.PROMOTE_FAILED
    return Stop(done, restart_old=old is not None)


def failed_at(old: MemberView | None, kind: FailoverKind, now: float) -> float:
    """When the failure a failover answers began (time.monotonic()): an automatic one's, the old primary's exit,
    else the first sign of it (every thread exiting, its stop, then its first failed check); a forced one's, ``now``
    (the request)."""
    if old is None or kind != FailoverKind.AUTOMATIC:
        return now
    stopped_at = None if old.stopped_s is None else now - old.stopped_s
    return (old.exited_at if not old.alive else old.exiting_at or stopped_at or old.health.failing_since) or now


@dataclass(frozen=True)
class FailoverResult:
    """What a failover reports: its sentence, how it ended, and (once promoted) the new primary and timings."""

    sentence: str
    outcome: FailoverOutcome
    group: int
    kind: FailoverKind
    old_primary: str | None
    new_primary: str | None = None
    timings: Mapping[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.outcome == FailoverOutcome.PROMOTED

    def to_json(self) -> dict[str, Any]:
        """The REST answer (``POST /failover``)."""
        done = {"new_primary": self.new_primary, "message": self.sentence, **self.timings} if self.ok else {}
        return {"ok": self.ok, "group": self.group, "kind": self.kind, "old_primary": self.old_primary} | done


def failover_sentence(
    outcome: FailoverOutcome, facts: FailoverFacts, reason: str, timings: Mapping[str, float], fence_timeout_s: float
) -> str:
    """The loop's sentence for a failover that ended with ``outcome`` (what became of the old slot is added by
    the loop, once it has restarted it)."""
    old, new = facts.old, facts.candidate
    if outcome == FailoverOutcome.FENCE_FAILED and old is not None:
        return (
            f"not failing over: primary {old.id} {reason} but is still alive {fence_timeout_s:g} s after SIGKILL; "
            "promoting another engine could make two primaries"
        )
    prefix = f"failing over: primary {old.id} {reason}" if old else f"failing over in group {facts.group}: {reason}"
    prefix += f"; fenced in {timings['fence_ms']} ms" if facts.fenced else ""
    if outcome == FailoverOutcome.STRANGER and old is not None:
        stranger = f"{old.url} still answers /primary 200 (a process we do not supervise): stop it"
        return f"{prefix}; not promoting another: {stranger}"
    if outcome == FailoverOutcome.SERVING:
        return f"{prefix}; not promoting: {', '.join(facts.serving or ())} answer /primary 200"
    if new is None or facts.promotion is None:
        return f"{prefix}; no ready standby to promote"
    if outcome == FailoverOutcome.PROMOTE_FAILED:
        return f"{prefix}; promoting {new.id} failed ({facts.promotion.message}), will retry"
    return f"{prefix}; promoted {new.id} in {timings['promote_ms']} ms ({timings['total_ms']} ms after the failure)"


@dataclass(frozen=True)
class SlotRestarts:
    """Backoff of an engine slot whose engines exit before ever being ready."""

    failures: int = 0  # such exits in a row
    next_start_at: float = 0.0  # time.monotonic()
    seen_exit_at: float | None = None  # the exit already accounted for


@dataclass(frozen=True)
class SlotExit:
    """A standby's exit seen for the first time; its slot restarts ``delay_s`` after the exit."""

    member: MemberView
    delay_s: float


@dataclass(frozen=True)
class TendSlots:
    """Fence the standbys that failed (each with its reason), then start the slots named."""

    fence: tuple[tuple[MemberView, str], ...]
    start: tuple[MemberView, ...]


@dataclass(frozen=True)
class SlotPlan:
    """Step 3's answer: ``tend`` (None: nothing to do), every slot's backoff after this cycle, the new exits."""

    tend: TendSlots | None
    restarts: dict[str, SlotRestarts]
    exits: tuple[SlotExit, ...]


def plan_slots(
    members: Sequence[MemberView],
    restarts: Mapping[str, SlotRestarts],
    now: float,
    daemons_serve: bool,
    is_failed: Verdict,
) -> SlotPlan:
    """Step 3 for one group's ``members``: a live standby that failed is fenced (one that passes its health checks
    too: its canary answer may be wrong, ``controller.graywatch``); a healthy engine clears its slot's backoff; an
    absent or exited standby slot is started once ``daemons_serve``, at once after an engine that was ever ready,
    else after ``backoff_s`` of the exits in a row that never were (a dead primary is step 1's)."""
    after = dict(restarts)
    fence: list[tuple[MemberView, str]] = []
    start: list[MemberView] = []
    exits: list[SlotExit] = []
    for view in members:
        slot = after.get(view.id, SlotRestarts())
        if view.alive:
            if view.role == Role.STANDBY and (reason := is_failed(view)):  # a healthy one too: a wrong canary
                fence.append((view, reason))
            elif view.status == Status.HEALTHY:
                slot = replace(slot, failures=0)
        elif view.role != Role.PRIMARY:
            if view.status == Status.EXITED and slot.seen_exit_at != view.exited_at:  # first look at this exit
                failures = slot.failures + (not view.health.ever_ok)
                delay = backoff_s(failures) if failures else 0.0
                slot = SlotRestarts(failures, (view.exited_at or now) + delay, view.exited_at)
                exits.append(SlotExit(view, delay))
            if daemons_serve and now >= slot.next_start_at:
                start.append(view)
        after[view.id] = slot
    tend = TendSlots(tuple(fence), tuple(start)) if fence or start else None
    return SlotPlan(tend, after, tuple(exits))


@dataclass(frozen=True)
class Elect:
    """The group has no primary: promote ``candidate``."""

    candidate: MemberView


@dataclass(frozen=True)
class Wait:
    """Nothing to do yet, for the reason given (the loop's sentence)."""

    sentence: str


def missing_primary(
    group: int, members: Sequence[MemberView], refusal: str | None, candidate: MemberView | None
) -> Elect | Wait | None:
    """Step 4 for a group: None while it has a primary record; wait while another host leads it (``refusal``) or
    a live engine has not been checked yet (it may be a primary we do not know of); else elect ``candidate`` (the
    best ready standby), or wait for one."""
    if any(m.role == Role.PRIMARY for m in members):
        return None
    if refusal:
        return Wait(f"group {group} has no primary here: {refusal}")
    if unchecked := [m.id for m in members if m.alive and m.health.ok is None]:
        return Wait(f"group {group} has no known primary; waiting for the first checks of {unchecked}")
    if candidate is None:
        states = ", ".join(f"{m.id} {m.status}" for m in members)
        return Wait(f"group {group} has no primary and no ready standby yet ({states})")
    return Elect(candidate)


def best_standby(members: Sequence[MemberView], generation: int, served: bool) -> MemberView | None:
    """A ready standby with the fewest failed checks, then the least slow (``graydecide.slowness_of``: a primary
    switched over for slowness is a standby afterwards); ties go to the lowest slot (``members``' order). During a
    model update (``generation``: the group's current weight generation; ``served``: whether an engine of it has
    been primary), those of the current generation first; one of an older generation only while none of the
    current one has been primary (answers switch generation once, never back)."""
    ready = [m for m in members if m.is_ready_standby]
    if served or any(m.generation == generation for m in ready):
        ready = [m for m in ready if m.generation == generation]
    return min(ready, key=lambda m: (m.health.consecutive_failures, math.floor(slowness_of(m) or 1.0)), default=None)


@dataclass(frozen=True)
class Footprint:
    """What one engine of a group holds, as measured on its live engines (the largest of each): resident host
    memory (its process tree) and device memory (its CUDA processes); None where nothing could be read."""

    host_bytes: int | None
    device_bytes: int | None


def room_refusal(
    group: int, device: str, need: Footprint, host_free: int | None, device_free: int | None
) -> str | None:
    """Why ``POST /engines`` cannot add an engine to ``group`` (its 409 message): one more engine's ``need`` does
    not fit in the host's or the device's free memory; None when it fits or a figure is unknown."""
    gib = 1 << 30
    if need.host_bytes is not None and host_free is not None and need.host_bytes > host_free:
        return (
            f"group {group}: one more engine needs about {need.host_bytes / gib:.2f} GiB of host memory "
            f"(what a running one holds), {host_free / gib:.2f} GiB are available"
        )
    if need.device_bytes is not None and device_free is not None and need.device_bytes > device_free:
        return (
            f"group {group}: one more engine needs about {need.device_bytes / gib:.2f} GiB on {device} "
            f"(what a running one holds), {device_free / gib:.2f} GiB are free"
        )
    return None


@dataclass(frozen=True)
class Streak:
    """A slot's (an engine slot's, a daemon's, a gateway worker's) failed starts in a row, all for ``reason``."""

    reason: str = ""
    count: int = 0


def after_start(streak: Streak, failure: str | None) -> Streak:
    """A slot's streak after one start: none after a start that worked (``failure`` None), one longer after one
    that failed for the streak's reason, else a streak of one for the new reason."""
    if failure is None:
        return Streak()
    return Streak(failure, streak.count + 1 if failure == streak.reason else 1)


@dataclass(frozen=True)
class GiveUp:
    """Stop the stack: ``slot`` failed to start ``count`` times in a row, each time for ``reason``."""

    slot: str
    reason: str
    count: int

    @property
    def sentence(self) -> str:
        return f"{self.slot} failed to start {self.count} times in a row, each time: {self.reason}"


def give_up(streaks: Mapping[str, Streak], limit: int = GIVE_UP_AFTER) -> GiveUp | None:
    """The slot (the first by name) whose failed starts for one reason reached ``limit``; None while none has."""
    done = sorted(slot for slot, streak in streaks.items() if streak.count >= limit)
    return GiveUp(done[0], streaks[done[0]].reason, streaks[done[0]].count) if done else None
