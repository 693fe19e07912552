"""The HA decision core with no processes: a group's situation in, the decision out (``controller.decide``).

Each table row is a situation the drills or an earlier bug produced, and what the loop must decide in it."""

from __future__ import annotations

import pytest

from hotweights.controller.decide import (
    GIVE_UP_AFTER,
    Elect,
    FailOver,
    Footprint,
    GiveUp,
    Intent,
    ResolveSplitBrain,
    SlotRestarts,
    Streak,
    Wait,
    after_start,
    best_standby,
    failed_primary,
    give_up,
    keep_in_split_brain,
    missing_primary,
    plan_slots,
    room_refusal,
)
from hotweights.controller.executor import backoff_s
from hotweights.controller.health import (
    HealthRecord,
    checks_failed,
    not_ready_within,
    process_exited,
    process_stopped,
)
from hotweights.controller.ids import engine_id, engine_slot
from hotweights.controller.snapshot import MemberView
from hotweights.proctree import BUSY_GRACE_S, busy_not_hung

pytestmark = pytest.mark.unit

HEALTHY = HealthRecord(ok=True, ever_ok=True)
NEVER_CHECKED = HealthRecord()
HUNG = HealthRecord(ok=False, ever_ok=True, consecutive_failures=3, error="no answer within 500 ms")
ONE_MISS = HealthRecord(ok=False, ever_ok=True, consecutive_failures=1, error="no answer within 500 ms")
IS_FAILED = process_exited() | process_stopped(0.05) | checks_failed(3) | not_ready_within()
SIGKILL = "killed by signal 9 (SIGKILL)"


def member(index: int, role: str = "standby", **changes: object) -> MemberView:
    fields: dict[str, object] = dict(
        id=f"g0-e{index}", group=0, port=8200 + index, device="cpu", url=f"http://127.0.0.1:{8200 + index}",
        role=role, state="ready", status="healthy", pid=100 + index, alive=True, exit_reason=None, exited_at=None,
        exiting_at=None, age_s=10.0 + index, start_timeout_s=120.0, health=HEALTHY,
    )  # fmt: skip
    return MemberView(**(fields | changes))  # type: ignore[arg-type]


def dead(index: int, role: str = "standby", ever_ok: bool = True, exited_at: float = 50.0) -> MemberView:
    health = HealthRecord(ok=True, ever_ok=True) if ever_ok else NEVER_CHECKED
    return member(
        index, role, status="exited", alive=False, pid=None, exit_reason=SIGKILL, exited_at=exited_at, health=health
    )


PRIMARY = member(0, "primary")


@pytest.mark.parametrize(
    ("stopped_s", "health", "reason"),
    [
        (None, HEALTHY, None),  # running
        (0.02, HEALTHY, None),  # stopped, not for long yet: a check may still fail it later
        (0.05, HEALTHY, "is stopped (SIGSTOP or a tracer: its process has not run for 50 ms)"),
        (0.3, ONE_MISS, "is stopped (SIGSTOP or a tracer: its process has not run for 300 ms)"),  # before the checks
        (None, HUNG, "failed 3 health checks in a row (no answer within 500 ms)"),
    ],
)
def test_a_stopped_primary_fails_once_stopped_for_the_bound(
    stopped_s: float | None, health: HealthRecord, reason: str | None
) -> None:
    """A stopped process runs nothing until it is continued: it fails as soon as it has been stopped for the bound,
    before its health checks time out; one stopped for less, or running, is judged by its checks."""
    assert IS_FAILED(member(0, "primary", stopped_s=stopped_s, health=health)) == reason


@pytest.mark.parametrize(
    ("primaries", "action", "stale"),
    [
        ((), None, ()),  # a group without a primary is step 4's
        ((PRIMARY,), None, ()),
        ((member(0, "primary", health=ONE_MISS, status="failing"),), None, ()),  # one missed check is no failure
        ((dead(0, "primary"),), FailOver(dead(0, "primary"), SIGKILL), ()),  # kill-primary
        (
            (member(0, "primary", health=HUNG, status="failing"),),  # hang-primary (SIGSTOP)
            FailOver(
                member(0, "primary", health=HUNG, status="failing"),
                "failed 3 health checks in a row (no answer within 500 ms)",
            ),
            (),
        ),
        (
            (member(0, "primary", exiting_at=40.0),),  # a watched primary whose threads all began to exit
            FailOver(member(0, "primary", exiting_at=40.0), "is exiting (every thread has begun to exit)"),
            (),
        ),
        (
            (member(0, "primary"), member(1, "primary")),
            ResolveSplitBrain((member(0, "primary"), member(1, "primary"))),
            (),
        ),
        ((PRIMARY, dead(1, "primary")), None, ("g0-e1",)),  # a stale record beside the serving primary
        (
            (member(0, "primary", health=HUNG), dead(1, "primary")),
            FailOver(member(0, "primary", health=HUNG), "failed 3 health checks in a row (no answer within 500 ms)"),
            ("g0-e1",),
        ),
    ],
)
def test_failed_primary(primaries: tuple[MemberView, ...], action: object, stale: tuple[str, ...]) -> None:
    decision = failed_primary(primaries, IS_FAILED)
    assert decision.action == action
    assert decision.stale == stale


def test_a_split_brain_keeps_the_serving_primary_then_the_oldest() -> None:
    young, old = member(1, "primary", age_s=5.0), member(2, "primary", age_s=50.0)
    assert keep_in_split_brain([young, old]) == old
    draining = member(3, "primary", age_s=500.0, state="draining")
    assert keep_in_split_brain([draining, young]) == young


@pytest.mark.parametrize(
    ("members", "generation", "served", "chosen"),
    [
        ((PRIMARY, member(1), member(2)), 0, True, "g0-e1"),  # ties: the lowest slot
        ((PRIMARY, member(1, health=ONE_MISS), member(2)), 0, True, "g0-e2"),  # fewest failed checks
        ((PRIMARY, member(1, state="draining"), member(2, status="starting", health=NEVER_CHECKED)), 0, True, None),
        ((PRIMARY, dead(1), member(2)), 0, True, "g0-e2"),
        # a model update: the new generation's standby first; an old one only before the new one served
        ((PRIMARY, member(1), member(2, generation=1)), 1, False, "g0-e2"),
        ((PRIMARY, member(1)), 1, False, "g0-e1"),
        ((PRIMARY, member(1)), 1, True, None),  # answers never switch back to the old weights
    ],
)
def test_best_standby(members: tuple[MemberView, ...], generation: int, served: bool, chosen: str | None) -> None:
    best = best_standby(members, generation, served)
    assert (best.id if best else None) == chosen


@pytest.mark.parametrize(
    ("members", "refusal", "expected"),
    [
        ((PRIMARY, member(1)), None, None),
        ((dead(0, "primary"), member(1)), None, None),  # a dead primary record is failover's (step 1)
        ((member(1), member(2)), "g0 is led by host b", Wait("group 0 has no primary here: g0 is led by host b")),
        (
            (member(1), member(2, health=NEVER_CHECKED, status="starting")),
            None,
            Wait("group 0 has no known primary; waiting for the first checks of ['g0-e2']"),
        ),
        (
            (dead(1), member(2, state="draining")),
            None,
            Wait("group 0 has no primary and no ready standby yet (g0-e1 exited, g0-e2 healthy)"),
        ),
        ((member(1), member(2)), None, Elect(member(1))),
    ],
)
def test_missing_primary(members: tuple[MemberView, ...], refusal: str | None, expected: object) -> None:
    assert missing_primary(0, members, refusal, best_standby(members, 0, True)) == expected


def test_slots_a_dead_standby_after_serving_restarts_at_once_and_a_failed_one_is_fenced() -> None:
    failing = member(2, health=HUNG, status="failing")
    plan = plan_slots((PRIMARY, dead(1), failing), {}, now=60.0, daemons_serve=True, is_failed=IS_FAILED)
    assert plan.tend is not None
    assert [(v.id, why) for v, why in plan.tend.fence] == [("g0-e2", IS_FAILED(failing))]
    assert [v.id for v in plan.tend.start] == ["g0-e1"]
    assert [(e.member.id, e.delay_s) for e in plan.exits] == [("g0-e1", 0.0)]
    assert plan.restarts["g0-e1"] == SlotRestarts(0, 50.0, 50.0)


def test_slots_engines_that_never_get_ready_restart_after_a_growing_backoff() -> None:
    restarts: dict[str, SlotRestarts] = {}
    for failures in (1, 2, 3):
        exited_at = 100.0 * failures
        gone = dead(1, ever_ok=False, exited_at=exited_at)
        plan = plan_slots((PRIMARY, gone), restarts, now=exited_at, daemons_serve=True, is_failed=IS_FAILED)
        assert plan.tend is None, failures  # not before its backoff
        assert [e.delay_s for e in plan.exits] == [backoff_s(failures)]
        restarts = plan.restarts
        again = plan_slots((PRIMARY, gone), restarts, exited_at + backoff_s(failures), True, IS_FAILED)
        assert again.exits == ()  # the same exit is seen once
        assert again.tend is not None and [v.id for v in again.tend.start] == ["g0-e1"]
    healthy = plan_slots((PRIMARY, member(1)), restarts, now=1000.0, daemons_serve=True, is_failed=IS_FAILED)
    assert healthy.tend is None and healthy.restarts["g0-e1"].failures == 0  # once it served, the count restarts


@pytest.mark.parametrize(
    ("members", "daemons_serve", "started"),
    [
        ((PRIMARY, member(1, status="absent", alive=False, pid=None)), False, []),  # the daemon restarts first
        ((PRIMARY, member(1, status="absent", alive=False, pid=None)), True, ["g0-e1"]),
        ((dead(0, "primary"), member(1)), True, []),  # a dead primary's slot restarts after its failover
        ((PRIMARY, member(1, status="starting", health=NEVER_CHECKED)), True, []),  # starting: leave it be
        ((PRIMARY, member(1, status="starting", health=NEVER_CHECKED, age_s=500.0)), True, []),  # fenced, below
    ],
)
def test_slots_start(members: tuple[MemberView, ...], daemons_serve: bool, started: list[str]) -> None:
    plan = plan_slots(members, {}, now=60.0, daemons_serve=daemons_serve, is_failed=IS_FAILED)
    assert ([v.id for v in plan.tend.start] if plan.tend else []) == started


def test_slots_a_standby_never_ready_within_its_start_timeout_is_fenced() -> None:
    stuck = member(1, status="starting", health=NEVER_CHECKED, age_s=500.0)
    plan = plan_slots((PRIMARY, stuck), {}, now=60.0, daemons_serve=True, is_failed=IS_FAILED)
    assert plan.tend is not None and [v.id for v, _ in plan.tend.fence] == ["g0-e1"]


def test_intents_are_the_words_of_the_rest_api() -> None:
    assert Intent("restart_cache") is Intent.RESTART_CACHE
    assert f"{Intent.SWITCHOVER} (requested)" == "switchover (requested)"


@pytest.mark.parametrize(("group", "index"), [(0, 0), (3, 12)])
def test_an_engine_id_is_built_and_parsed_in_one_place(group: int, index: int) -> None:
    assert engine_slot(engine_id(group, index)) == (group, index)


@pytest.mark.parametrize("text", ["g0-spare", "g0-cache", "g-e1", "g0-e", "g0-e1x", "x-g0-e1"])
def test_what_is_not_an_engine_id_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="is not an engine id"):
        engine_slot(text)


GIB = 1 << 30


@pytest.mark.parametrize(
    ("need", "host_free", "device_free", "refused"),
    [
        (Footprint(2 * GIB, 5 * GIB), 8 * GIB, 80 * GIB, ""),  # fits both
        (Footprint(2 * GIB, 5 * GIB), 1 * GIB, 80 * GIB, "2.00 GiB of host memory (what a running one holds), 1.00"),
        (Footprint(2 * GIB, 5 * GIB), 8 * GIB, 4 * GIB, "5.00 GiB on cuda:0 (what a running one holds), 4.00 GiB"),
        (Footprint(None, None), 0, 0, ""),  # no engine measured: nothing to judge by
        (Footprint(2 * GIB, 5 * GIB), None, None, ""),  # memory unreadable: not a reason to refuse
    ],
)
def test_post_engines_is_refused_when_one_more_engine_does_not_fit(
    need: Footprint, host_free: int | None, device_free: int | None, refused: str
) -> None:
    refusal = room_refusal(0, "cuda:0", need, host_free, device_free)
    if refused:
        assert refusal is not None and refused in refusal, refusal
    else:
        assert refusal is None


PORT = "gateway.port: 127.0.0.1:8000 is in use by another process (pid 7: python3 -m http.server 8000)"
OOM = "exited (signal 9, SIGKILL); its log ends: Killed"


@pytest.mark.parametrize(
    ("failures", "streak"),
    [
        ([PORT], Streak(PORT, 1)),
        ([PORT, PORT, PORT], Streak(PORT, 3)),
        ([PORT, OOM], Streak(OOM, 1)),  # another reason begins a new streak
        ([PORT, PORT, OOM, PORT], Streak(PORT, 1)),
        ([PORT, PORT, None], Streak()),  # a start that worked ends it
        ([PORT, None, PORT], Streak(PORT, 1)),
        ([None], Streak()),
    ],
)
def test_a_streak_counts_the_starts_in_a_row_that_failed_alike(failures: list[str | None], streak: Streak) -> None:
    found = Streak()
    for failure in failures:
        found = after_start(found, failure)
    assert found == streak


@pytest.mark.parametrize(
    ("streaks", "decision"),
    [
        ({}, None),
        ({"gateway": Streak(PORT, GIVE_UP_AFTER - 1)}, None),
        ({"gateway": Streak(PORT, GIVE_UP_AFTER)}, GiveUp("gateway", PORT, GIVE_UP_AFTER)),
        # several slots that failed alike often enough: the first by name
        ({"g0-e1": Streak(OOM, 5), "g0-cache": Streak(OOM, 3), "g0-e0": Streak(OOM, 1)}, GiveUp("g0-cache", OOM, 3)),
        # failures of one slot for changing reasons never add up
        ({"g0-e1": Streak(OOM, 1), "g0-e2": Streak(PORT, 2)}, None),
    ],
)
def test_up_gives_up_on_the_first_slot_that_failed_alike_often_enough(
    streaks: dict[str, Streak], decision: GiveUp | None
) -> None:
    assert give_up(streaks) == decision


def test_the_give_up_sentence_names_the_slot_the_count_and_the_reason() -> None:
    assert GiveUp("gateway", PORT, 3).sentence == f"gateway failed to start 3 times in a row, each time: {PORT}"


@pytest.mark.parametrize(
    ("cpu_s", "waited_s", "since_ok_s", "not_counted"),
    [
        (0.15, 0.2, 0.5, True),  # saturated by its load, answered half a second ago: late, not hung
        (0.05, 0.2, 0.5, True),  # a quarter of a core is still running
        (0.04, 0.2, 0.5, False),  # barely running: a deadlock's or a stop's few ticks
        (0.0, 0.2, 0.5, False),  # SIGSTOPped
        (None, 0.2, 0.5, False),  # its CPU unknown (not ours to read, gone)
        (0.2, 0.2, BUSY_GRACE_S, False),  # spinning without answering since the grace: a hang
        (0.2, 0.2, None, False),  # never answered healthy
    ],
)
def test_a_late_check_of_a_running_engine_is_not_counted_within_the_grace(
    cpu_s: float | None, waited_s: float, since_ok_s: float | None, not_counted: bool
) -> None:
    assert busy_not_hung(cpu_s, waited_s, since_ok_s) is not_counted
