"""Gray failures' decisions with no processes (``controller.graydecide``): a slow primary's switchover, the canary's
verdict. Each row is a situation and what the controller must decide in it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hotweights.controller.decide import best_standby, plan_slots
from hotweights.controller.graydecide import (
    CanaryReading,
    CanaryVerdict,
    DegradePolicy,
    SlowSpell,
    degraded_primary,
    judge_canaries,
    last_gray_failure,
)
from hotweights.controller.health import HealthRecord
from hotweights.controller.snapshot import MemberView

pytestmark = pytest.mark.unit

POLICY = DegradePolicy(factor=4.0, for_s=2.0, every_s=300.0)
NOW = 1000.0


def member(index: int, role: str = "standby", slowness: float | None = None) -> MemberView:
    body = {"slowness": None if slowness is None else {"ratio": slowness, "steps": 10}}
    fields: dict[str, object] = dict(
        id=f"g0-e{index}", group=0, port=8200 + index, device="cpu", url=f"http://127.0.0.1:{8200 + index}",
        role=role, state="ready", status="healthy", pid=100 + index, alive=True, exit_reason=None, exited_at=None,
        exiting_at=None, age_s=10.0, start_timeout_s=120.0, health=HealthRecord(ok=True, ever_ok=True, body=body),
    )  # fmt: skip
    return MemberView(**fields)  # type: ignore[arg-type]


def canary(index: int, slowness: float | None = 1.0, at: float = NOW - 0.5, tokens: tuple[int, ...] = (1, 2, 3)):
    return CanaryReading(f"g0-e{index}", 100 + index, "fp", tokens, slowness, at)


SLOW = member(0, "primary", slowness=20.0)
LOOKS_SLOW = SlowSpell("g0-e0", NOW - 3.0)  # slow against its best for 3 s, no standby compared yet
SPELL = SlowSpell("g0-e0", NOW - 3.0, NOW - 2.5)  # and against a standby for 2.5 s
STANDBYS = (member(1), member(2))
FAST = {"g0-e1": canary(1, 1.2), "g0-e2": canary(2, 1.1)}
AS_SLOW = {"g0-e1": canary(1, 6.0), "g0-e2": canary(2, 5.5)}


@pytest.mark.parametrize(
    ("primary", "canaries", "spell", "switch_to", "spell_after"),
    [
        pytest.param(member(0, "primary", slowness=1.3), FAST, SlowSpell(), None, SlowSpell(), id="healthy"),
        pytest.param(member(0, "primary"), FAST, SPELL, None, SlowSpell(), id="idle primary: no steps, no verdict"),
        pytest.param(SLOW, {}, SlowSpell(), None, SlowSpell("g0-e0", NOW), id="looks slow: no standby measured yet"),
        pytest.param(
            SLOW,
            FAST,
            LOOKS_SLOW,
            "g0-e2",
            SlowSpell("g0-e0", NOW - 3.0, NOW, NOW),
            id="a standby confirms a primary slow for longer than for_s: at once",
        ),
        pytest.param(
            SLOW,
            FAST,
            SlowSpell("g0-e0", NOW - 1.5),
            None,
            SlowSpell("g0-e0", NOW - 1.5, NOW),
            id="a standby confirms it, slow for too short",
        ),
        pytest.param(
            SLOW,
            FAST,
            SlowSpell("g0-e0", NOW - 1.5, NOW - 1.0),
            None,
            SlowSpell("g0-e0", NOW - 1.5, NOW - 1.0),
            id="confirmed, slow for too short",
        ),
        pytest.param(SLOW, FAST, SPELL, "g0-e2", SlowSpell("g0-e0", NOW - 3.0, NOW - 2.5, NOW), id="20x: least slow"),
        pytest.param(
            SLOW,
            AS_SLOW,
            SPELL,
            None,
            SlowSpell("g0-e0", NOW),
            id="the standbys are as slow: the host, not the primary; the spell starts again",
        ),
        pytest.param(
            SLOW,
            {"g0-e1": canary(1, 1.0, at=NOW - 4.0)},
            SPELL,
            None,
            LOOKS_SLOW,
            id="no standby canary since it looked slow",
        ),
        pytest.param(
            SLOW,
            FAST,
            replace(SPELL, last_switch=NOW - 100.0),
            None,
            replace(SPELL, last_switch=NOW - 100.0),
            id="a switchover 100 s ago: none again yet",
        ),
        pytest.param(
            member(0, "primary", slowness=3.9),
            FAST,
            replace(SPELL, last_switch=NOW - 100.0),
            None,
            SlowSpell(last_switch=NOW - 100.0),
            id="below the factor: spell over, the last switchover kept",
        ),
        pytest.param(
            SLOW,
            FAST,
            SlowSpell("g0-e9", NOW - 10.0, NOW - 10.0),
            None,
            SlowSpell("g0-e0", NOW),
            id="a new primary's spell begins",
        ),
    ],
)
def test_degraded_primary(primary, canaries, spell, switch_to, spell_after) -> None:
    switch, after = degraded_primary(primary, STANDBYS, canaries, spell, NOW, POLICY)
    assert (switch.new.id if switch else None) == switch_to
    assert after == spell_after
    if switch is not None:
        assert switch.old is primary and "20.0x their best for 3.0 s" in switch.reason


def test_degraded_primary_needs_a_ready_standby_of_its_process() -> None:
    """A standby's canary of a former process (another pid) says nothing of the engine in its slot now."""
    switch, _ = degraded_primary(SLOW, (), FAST, SPELL, NOW, POLICY)
    assert switch is None
    stale = {"g0-e1": CanaryReading("g0-e1", 999, "fp", (1,), 1.0, NOW - 0.5)}
    assert degraded_primary(SLOW, STANDBYS[:1], stale, SPELL, NOW, POLICY)[0] is None


A, B, C = (1, 2, 3), (9, 9, 9), (5, 5, 5)


def readings(*answers: tuple[int, ...], fingerprint: str = "fp") -> list[CanaryReading]:
    return [CanaryReading(f"g0-e{i}", 100 + i, fingerprint, tokens, 1.0, NOW) for i, tokens in enumerate(answers)]


WRONG_E2 = {"g0-e2": "answered the canary [9, 9, 9], not [1, 2, 3] as the others agree"}


@pytest.mark.parametrize(
    ("answers", "agreed", "verdict"),
    [
        pytest.param((A, A, A), {}, CanaryVerdict({"fp": A}, {}, ("fp",)), id="first round: agreed"),
        pytest.param((A, A, A), {"fp": A}, CanaryVerdict({"fp": A}, {}, ()), id="all right"),
        pytest.param((A, A, B), {"fp": A}, CanaryVerdict({"fp": A}, WRONG_E2, ()), id="one wrong of three"),
        pytest.param((A, A, B), {}, CanaryVerdict({"fp": A}, WRONG_E2, ("fp",)), id="wrong from the start"),
        pytest.param(
            (A, B),
            {"fp": A},
            CanaryVerdict({"fp": A}, {"g0-e1": WRONG_E2["g0-e2"]}, ()),
            id="two differ: the agreed answer decides",
        ),
        pytest.param((A, B), {}, CanaryVerdict({}, {}, ()), id="two differ, nothing agreed: nothing to judge by"),
        pytest.param((A,), {}, CanaryVerdict({"fp": A}, {}, ("fp",)), id="one engine sets the answer"),
        pytest.param(
            (B, B, B), {"fp": A}, CanaryVerdict({"fp": B}, {}, ("fp",)), id="all differ alike: re-established"
        ),
        pytest.param((B, C), {"fp": A}, CanaryVerdict({"fp": A}, {}, ()), id="all differ: the agreed one is odd"),
        pytest.param((B,), {"fp": A}, CanaryVerdict({"fp": A}, {}, ()), id="one engine alone never fenced"),
    ],
)
def test_judge_canaries(answers, agreed, verdict) -> None:
    assert judge_canaries(readings(*answers), agreed) == verdict


def test_new_weights_set_their_own_answer() -> None:
    """A model update: the engines of the new weights (another fingerprint) answer otherwise, and none is wrong."""
    new = CanaryReading("g0-e2", 102, "fp2", C, 1.0, NOW)
    verdict = judge_canaries([*readings(A, A), new], {"fp": A})
    assert verdict == CanaryVerdict({"fp": A, "fp2": C}, {}, ("fp2",))


def test_status_names_the_groups_last_gray_failure() -> None:
    events = [
        {"seq": 1, "kind": "degraded", "group": 0, "member": "g0-e0", "time": "T1", "reason": "slow", "message": "m"},
        {"seq": 2, "kind": "switchover", "group": 0, "time": "T2", "message": "m"},
        {
            "seq": 3,
            "kind": "wrong_output",
            "group": 1,
            "member": "g1-e1",
            "time": "T3",
            "reason": "bad",
            "message": "m",
        },
    ]
    assert last_gray_failure(events, 0) == "degraded g0-e0 at T1: slow"
    assert last_gray_failure(events, 1) == "wrong_output g1-e1 at T3: bad"
    assert last_gray_failure(events, 2) is None


def test_a_standby_that_passes_its_health_checks_is_fenced_when_its_canary_is_wrong() -> None:
    """The loop's step 3 judges every live standby, healthy ones too (``decide.plan_slots``)."""
    primary, healthy, wrong = member(0, "primary"), member(1), member(2)

    def is_failed(view: MemberView) -> str | None:
        return "answered the canary wrong" if view is wrong else None

    plan = plan_slots((primary, healthy, wrong), {}, now=60.0, daemons_serve=True, is_failed=is_failed)
    assert plan.tend is not None and plan.tend.fence == ((wrong, "answered the canary wrong"),)


def test_the_best_standby_is_the_least_slow_of_those_with_the_fewest_failed_checks() -> None:
    """A primary switched over for slowness is a standby afterwards: the next failover picks another."""
    slowed, fine = member(1, slowness=20.0), member(2, slowness=1.3)
    assert best_standby((slowed, fine), generation=0, served=True) is fine
    assert best_standby((member(1), member(2)), generation=0, served=True).id == "g0-e1"  # none measured: lowest slot
