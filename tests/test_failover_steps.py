"""A failover as a sequence of decisions with no processes: what it has found so far in, its next step out
(``controller.decide.next_failover_step``), and what it reports (``failover_sentence``, ``FailoverResult``).

``Ha.failover`` only carries the steps out; every row here is a situation of a drill or a bug, and the step the loop
must take next in it."""

from __future__ import annotations

from dataclasses import replace

import pytest
from tenacity import RetryCallState

from hotweights.controller.decide import (
    AskServing,
    AskStranger,
    FailoverFacts,
    FailoverOutcome,
    FailoverResult,
    FailoverStep,
    FenceOld,
    Promote,
    Promotion,
    Stop,
    backoff_s,
    failed_at,
    failover_sentence,
    next_failover_step,
)
from hotweights.controller.executor import BACKOFF
from hotweights.controller.snapshot import HealthRecord
from hotweights.eventkinds import FailoverKind
from tests.test_decide import PRIMARY, dead, member

pytestmark = pytest.mark.unit

OLD = dead(0, "primary")
STANDBY = member(1)
DONE = Promotion(True, 12.0, "promoted")
REFUSED = Promotion(False, 3.0, "409: not a ready standby")
FACTS = FailoverFacts(0, OLD, STANDBY)  # an automatic failover from a dead primary, a ready standby to promote
FENCED = replace(FACTS, fenced=True, stranger=False)
FORCED = FailoverFacts(0, None, STANDBY)  # a forced one in a group without a primary record


@pytest.mark.parametrize(
    ("facts", "step"),
    [
        (FACTS, FenceOld(OLD)),
        (replace(FACTS, fenced=False), Stop(FailoverOutcome.FENCE_FAILED)),  # never two primaries
        (replace(FACTS, fenced=True), AskStranger(OLD)),
        (replace(FACTS, fenced=True, stranger=True), Stop(FailoverOutcome.STRANGER)),  # its port still serves
        (FENCED, Promote(STANDBY)),
        (replace(FENCED, candidate=None), Stop(FailoverOutcome.NO_STANDBY, restart_old=True, release=True)),
        (replace(FENCED, promotion=REFUSED), Stop(FailoverOutcome.PROMOTE_FAILED, restart_old=True)),
        (replace(FENCED, promotion=DONE), Stop(FailoverOutcome.PROMOTED, restart_old=True)),
        (FORCED, AskServing(0)),  # nothing to fence: is an engine primary that our checks do not know of?
        (replace(FORCED, serving=("g0-e2",)), Stop(FailoverOutcome.SERVING)),
        (replace(FORCED, serving=()), Promote(STANDBY)),
        (replace(FORCED, serving=(), candidate=None), Stop(FailoverOutcome.NO_STANDBY, release=True)),
        (replace(FORCED, serving=(), promotion=DONE), Stop(FailoverOutcome.PROMOTED)),  # no old slot to restart
    ],
)
def test_the_next_step_follows_from_what_the_failover_found(facts: FailoverFacts, step: FailoverStep) -> None:
    assert next_failover_step(facts) == step


def walk(facts: FailoverFacts, found: dict[type, dict[str, object]]) -> list[FailoverStep]:
    """The steps a failover takes when each step finds what ``found`` says (by the step's type)."""
    steps = [next_failover_step(facts)]
    while not isinstance(steps[-1], Stop):
        facts = replace(facts, **found[type(steps[-1])])
        steps.append(next_failover_step(facts))
    return steps


@pytest.mark.parametrize(
    ("facts", "found", "kinds", "outcome"),
    [
        (  # kill-primary: fenced, its port quiet, the standby promoted
            FACTS,
            {FenceOld: {"fenced": True}, AskStranger: {"stranger": False}, Promote: {"promotion": DONE}},
            [FenceOld, AskStranger, Promote, Stop],
            FailoverOutcome.PROMOTED,
        ),
        (  # the promotion failed: stop (the loop retries after its backoff), the old slot restarts
            FACTS,
            {FenceOld: {"fenced": True}, AskStranger: {"stranger": False}, Promote: {"promotion": REFUSED}},
            [FenceOld, AskStranger, Promote, Stop],
            FailoverOutcome.PROMOTE_FAILED,
        ),
        (  # an unkillable primary: nothing else is asked or promoted
            FACTS,
            {FenceOld: {"fenced": False}},
            [FenceOld, Stop],
            FailoverOutcome.FENCE_FAILED,
        ),
        (  # POST /failover in a group whose primary record is gone
            FORCED,
            {AskServing: {"serving": ()}, Promote: {"promotion": DONE}},
            [AskServing, Promote, Stop],
            FailoverOutcome.PROMOTED,
        ),
    ],
)
def test_a_failover_visits_each_step_once_in_order(
    facts: FailoverFacts, found: dict, kinds: list[type], outcome: FailoverOutcome
) -> None:
    steps = walk(facts, found)
    assert [type(step) for step in steps] == kinds
    assert isinstance(steps[-1], Stop) and steps[-1].outcome == outcome


EXITING = member(0, "primary", exiting_at=40.0)
FAILING = member(0, "primary", health=HealthRecord(ok=False, ever_ok=True, failing_since=30.0), status="failing")


@pytest.mark.parametrize(
    ("old", "kind", "at"),
    [
        (OLD, FailoverKind.AUTOMATIC, 50.0),  # its exit (pidfd)
        (EXITING, FailoverKind.AUTOMATIC, 40.0),  # every thread began to exit before it was reaped
        (FAILING, FailoverKind.AUTOMATIC, 30.0),  # a hang: its first failed check
        (PRIMARY, FailoverKind.AUTOMATIC, 100.0),  # nothing seen (a wrong canary): now
        (OLD, FailoverKind.FORCED, 100.0),  # a forced failover runs from the request
        (None, FailoverKind.FORCED, 100.0),
    ],
)
def test_a_failovers_durations_run_from_the_failure(old: object, kind: FailoverKind, at: float) -> None:
    assert failed_at(old, kind, now=100.0) == at  # type: ignore[arg-type]


TIMINGS = {"detect_ms": 5.0, "fence_ms": 2.0, "promote_ms": 12.0, "total_ms": 20.0}


@pytest.mark.parametrize(
    ("outcome", "facts", "sentence"),
    [
        (
            FailoverOutcome.FENCE_FAILED,
            replace(FACTS, fenced=False),
            "not failing over: primary g0-e0 exited but is still alive 5 s after SIGKILL; promoting another engine "
            "could make two primaries",
        ),
        (
            FailoverOutcome.STRANGER,
            replace(FACTS, fenced=True, stranger=True),
            "failing over: primary g0-e0 exited; fenced in 2.0 ms; not promoting another: http://127.0.0.1:8200 still "
            "answers /primary 200 (a process we do not supervise): stop it",
        ),
        (
            FailoverOutcome.SERVING,
            replace(FORCED, serving=("g0-e2",)),
            "failing over in group 0: exited; not promoting: g0-e2 answer /primary 200",
        ),
        (
            FailoverOutcome.NO_STANDBY,
            replace(FENCED, candidate=None),
            "failing over: primary g0-e0 exited; fenced in 2.0 ms; no ready standby to promote",
        ),
        (
            FailoverOutcome.PROMOTE_FAILED,
            replace(FENCED, promotion=REFUSED),
            "failing over: primary g0-e0 exited; fenced in 2.0 ms; promoting g0-e1 failed (409: not a ready standby), "
            "will retry",
        ),
        (
            FailoverOutcome.PROMOTED,
            replace(FENCED, promotion=DONE),
            "failing over: primary g0-e0 exited; fenced in 2.0 ms; promoted g0-e1 in 12.0 ms (20.0 ms after the "
            "failure)",
        ),
    ],
)
def test_each_ending_is_told_in_one_sentence(outcome: FailoverOutcome, facts: FailoverFacts, sentence: str) -> None:
    assert failover_sentence(outcome, facts, "exited", TIMINGS, fence_timeout_s=5.0) == sentence


def test_the_result_answers_the_rest_request_with_timings_only_once_promoted() -> None:
    done = FailoverResult("promoted", FailoverOutcome.PROMOTED, 0, FailoverKind.FORCED, "g0-e0", "g0-e1", TIMINGS)
    assert done.ok and done.to_json() == {
        "ok": True, "group": 0, "kind": "forced", "old_primary": "g0-e0", "new_primary": "g0-e1",
        "message": "promoted", **TIMINGS,
    }  # fmt: skip
    failed = FailoverResult("no standby", FailoverOutcome.NO_STANDBY, 0, FailoverKind.AUTOMATIC, "g0-e0")
    assert not failed.ok
    assert failed.to_json() == {"ok": False, "group": 0, "kind": "automatic", "old_primary": "g0-e0"}


@pytest.mark.parametrize(("failures", "wait_s"), [(1, 0.5), (2, 1.0), (3, 2.0), (6, 16.0), (7, 30.0), (20, 30.0)])
def test_a_retry_waits_twice_as_long_as_the_last_up_to_30_s(failures: int, wait_s: float) -> None:
    """One backoff for the loop's actions (``decide``) and the services' keepers (tenacity's, ``executor``)."""
    state = RetryCallState(None, None, (), {})
    state.attempt_number = failures
    assert backoff_s(failures) == BACKOFF(state) == wait_s
