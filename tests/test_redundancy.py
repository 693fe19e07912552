"""The redundancy core and a spare's pacing, with no processes: situation in, assessment and changes out."""

from __future__ import annotations

import pytest

from hotweights.controller.health import HealthRecord
from hotweights.controller.redundancy import Redundancy, Tracker, assess
from hotweights.controller.snapshot import MemberView, Snapshot
from hotweights.controller.spares import plan
from hotweights.errors import ConfigError
from hotweights.spawn import parse_message
from hotweights.standby.pacing import Pacer, narrowed

pytestmark = pytest.mark.unit

HEALTHY = HealthRecord(ok=True, ever_ok=True)


def member(index: int, role: str = "standby", status: str = "healthy", **changes: object) -> MemberView:
    fields: dict[str, object] = dict(
        id=f"g0-e{index}", group=0, port=8200 + index, device="cpu", url=f"http://127.0.0.1:{8200 + index}",
        role=role, state="ready", status=status, pid=100 + index, alive=True, exit_reason=None, exited_at=None,
        exiting_at=None, age_s=2.5, start_timeout_s=120.0, health=HEALTHY,
    )  # fmt: skip
    return MemberView(**(fields | changes))  # type: ignore[arg-type]


PRIMARY = member(0, "primary")
STARTING = member(1, status="starting", health=HealthRecord(), state="unknown")
EXITED = member(1, status="exited", alive=False, exit_reason="killed by signal 9 (SIGKILL)")
FAILING = member(2, status="failing", health=HealthRecord(ok=False, ever_ok=True, consecutive_failures=3))
DEAD_PRIMARY = member(0, "primary", status="exited", alive=False, exit_reason="killed by signal 9 (SIGKILL)")


@pytest.mark.parametrize(
    ("members", "spare_failure", "ready", "reason"),
    [
        ((PRIMARY, member(1), member(2)), "", 2, None),
        ((PRIMARY, STARTING, member(2)), "", 1, "g0-e1 starting (2.5 s)"),
        ((PRIMARY, EXITED, FAILING), "", 0, "g0-e1 killed by signal 9 (SIGKILL); g0-e2 failing (3 failed checks)"),
        (
            (DEAD_PRIMARY, member(1), member(2)),
            "",
            2,
            "no serving primary; g0-e0 killed by signal 9 (SIGKILL)",
        ),
        (
            (PRIMARY, member(1, pid=None, alive=False, status="absent"), member(2)),
            "spare (pid 7) exited with code 1",
            1,
            "g0-e1 absent; its last spare failed: spare (pid 7) exited with code 1",
        ),
        ((PRIMARY, member(1), member(2)), "spare (pid 7) exited with code 1", 2, None),  # full: the spare is extra
        ((PRIMARY, member(1, state="draining")), "", 0, "g0-e1 standby draining"),
    ],
)
def test_assess_names_every_slot_that_is_not_ready(
    members: tuple[MemberView, ...], spare_failure: str, ready: int, reason: str | None
) -> None:
    state = assess(Snapshot(0.0, 1, members, ()), 0, 1, 0, spare_failure)
    assert (state.standbys_wanted, state.standbys_ready, state.reason, state.full) == (
        len(members) - 1, ready, reason, reason is None,
    )  # fmt: skip


def state(ready: int, *unready: str, serving: bool = True) -> Redundancy:
    return Redundancy(0, 2, ready, 1, 1, serving, unready)


@pytest.mark.parametrize(
    ("timeline", "expected"),
    [
        # a group that has not been full yet is starting, not degraded
        ([(0.0, state(0, "g0-e1 starting")), (5.0, state(2))], []),
        # lost at 10, restored at 10.4: one spell of 0.4 s, its first reason kept
        (
            [(0.0, state(2)), (10.0, state(1, serving=False)), (10.2, state(1, "g0-e0 starting")),
             (10.4, state(2))],
            [("redundancy_lost", 0.0, "no serving primary"), ("redundancy_restored", 0.4, "no serving primary")],
        ),
        # degraded past the bound: one alert, not one per cycle
        (
            [(0.0, state(2)), (1.0, state(1, "g0-e2 exited")), (20.0, state(1, "g0-e2 exited")),
             (31.5, state(1, "g0-e2 exited")), (40.0, state(1, "g0-e2 exited")), (41.0, state(2))],
            [("redundancy_lost", 0.0, "g0-e2 exited"), ("redundancy_alert", 30.5, "g0-e2 exited"),
             ("redundancy_restored", 40.0, "g0-e2 exited")],
        ),
        # two faults in one spell: still one spell
        (
            [(0.0, state(2)), (1.0, state(1, "a")), (2.0, state(0, "b")), (3.0, state(2))],
            [("redundancy_lost", 0.0, "a"), ("redundancy_restored", 2.0, "a")],
        ),
    ],
)  # fmt: skip
def test_tracker_turns_assessments_into_spells(
    timeline: list[tuple[float, Redundancy]], expected: list[tuple[str, float, str]]
) -> None:
    tracker = Tracker(alert_after_s=30.0)
    changes = [change for now, s in timeline for change in tracker.observe(now, [s])]
    assert [(c.kind, round(c.degraded_s, 3), c.details["reason"]) for c in changes] == expected


@pytest.mark.parametrize(
    ("members", "message"),
    [
        # the primary killed, both standbys ready: a standby replaces it, and no count says the group is whole
        ((DEAD_PRIMARY, member(1), member(2)),
         "group 0 lost full redundancy: no serving primary, 2 standbys ready to replace it "
         "(g0-e0 killed by signal 9 (SIGKILL))"),
        ((DEAD_PRIMARY, member(1), STARTING),
         "group 0 lost full redundancy: no serving primary, 1 standby ready to replace it "
         "(g0-e0 killed by signal 9 (SIGKILL); g0-e1 starting (2.5 s))"),
        ((member(0, "primary", state="draining"), STARTING),
         "group 0 lost full redundancy: no serving primary, no standbys ready to replace it "
         "(g0-e0 primary draining; g0-e1 starting (2.5 s))"),
        ((PRIMARY, EXITED, member(2)),
         "group 0 lost full redundancy: 1 of 2 standbys ready (g0-e1 killed by signal 9 (SIGKILL))"),
    ],
)  # fmt: skip
def test_a_lost_redundancy_says_what_is_missing_in_counts_that_agree(
    members: tuple[MemberView, ...], message: str
) -> None:
    tracker = Tracker(alert_after_s=30.0)
    tracker.observe(0.0, [assess(Snapshot(0.0, 1, (PRIMARY, member(1), member(2)), ()), 0, 1, 1)])
    (change,) = tracker.observe(1.0, [assess(Snapshot(1.0, 1, members, ()), 0, 1, 1)])
    assert (change.kind, change.message) == ("redundancy_lost", message)


def test_tracker_reports_the_current_spell() -> None:
    tracker = Tracker(alert_after_s=1.0)
    tracker.observe(0.0, [state(2)])
    tracker.observe(1.0, [state(1, "g0-e1 exited")])
    tracker.observe(2.5, [state(1, "g0-e1 starting")])
    (row,) = tracker.to_json(3.0)
    assert row == {
        "group": 0, "standbys_wanted": 2, "standbys_ready": 1, "spares_wanted": 1, "spares_ready": 1, "full": False,
        "degraded": True, "degraded_s": 2.0, "reason": "g0-e1 starting", "alert": True,
    }  # fmt: skip


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(round(seconds, 6))
        self.now += seconds


@pytest.mark.parametrize(
    ("duty", "work", "urgent_after", "slept"),
    [
        (1.0, [0.2, 0.3], None, [0.0, 0.0]),
        (0.5, [0.2, 0.3], None, [0.2, 0.3]),
        (0.25, [0.1, 0.1], None, [0.3, 0.3]),
        (0.5, [0.2, 0.2, 0.2], 1, [0.2, 0.0, 0.0]),  # a start message waits after the first unit: no more pauses
    ],
)
def test_pacer_keeps_the_busy_share_at_its_duty(
    duty: float, work: list[float], urgent_after: int | None, slept: list[float]
) -> None:
    clock, done = Clock(), []
    urgent = (lambda: len(done) > urgent_after) if urgent_after is not None else (lambda: False)
    pacer = Pacer(duty, urgent, clock=lambda: clock.now, sleep=clock.sleep)
    for seconds in work:
        clock.now += seconds
        done.append(seconds)
        before = len(clock.slept)
        pacer.step()
        if len(clock.slept) == before:
            clock.slept.append(0.0)
    assert clock.slept == slept


@pytest.mark.parametrize("duty", [0.0, -1.0, 1.5])
def test_pacer_refuses_a_duty_outside_0_1(duty: float) -> None:
    with pytest.raises(ValueError, match="duty must be in"):
        Pacer(duty)


@pytest.mark.parametrize(
    ("allowed", "narrow"), [({0}, {0}), ({0, 1}, {1}), (set(range(16)), {12, 13, 14, 15}), ({2, 5, 9}, {9})]
)
def test_a_preparing_spare_runs_on_the_last_quarter_of_its_cpus(allowed: set[int], narrow: set[int]) -> None:
    assert narrowed(allowed) == narrow


@pytest.mark.parametrize(
    ("data", "message"),
    [(b"", None), (b"{}\n", {}), (b'{"port":8201,"engine_id":"g0-e1"}\n', {"port": 8201, "engine_id": "g0-e1"})],
)
def test_spare_pipe_messages(data: bytes, message: dict | None) -> None:
    assert parse_message(data) == message


@pytest.mark.parametrize("data", [b"1", b"[1]", b"\xff"])
def test_a_spare_pipe_message_that_is_no_json_object_is_refused(data: bytes) -> None:
    with pytest.raises(ConfigError, match="spare's pipe message"):
        parse_message(data)


@pytest.mark.parametrize(
    ("pool", "wanted", "may_start", "expected"),
    [
        ([], 2, True, (0, True)),  # empty: start the first
        ([(1.0, True)], 2, True, (0, True)),  # every spare ready: the next one
        ([(1.0, True), (2.0, False)], 3, True, (0, False)),  # one still preparing: no second warm-up beside it
        ([(1.0, True), (2.0, True)], 2, True, (0, False)),  # full
        ([(1.0, True), (2.0, True), (3.0, False)], 1, True, (2, False)),  # fewer wanted: release the two youngest
        ([(1.0, True), (2.0, True)], 3, False, (0, False)),  # between primaries (or backing off): keep, start none
        ([], 0, True, (0, False)),  # spare_engines = 0
    ],
)
def test_a_spare_pool_starts_one_at_a_time_and_keeps_its_spares_between_primaries(
    pool: list[tuple[float, bool]], wanted: int, may_start: bool, expected: tuple[int, bool]
) -> None:
    assert plan(pool, wanted, may_start) == expected
