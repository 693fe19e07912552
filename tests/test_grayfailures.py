"""Gray failures end to end: a primary that answers every health check but serves 20x slower is switched over, one
whose outputs went wrong is fenced, both under load through the gateway with no client error
(``controller.graywatch``, ``standby.canary``, ``standby.drillfaults``). One stack serves both tests, with the
shipped ``[health]`` gray-failure keys."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from hotweights.chaos.clusterview import event_time
from hotweights.eventkinds import EventKind
from hotweights.standby.drillfaults import SLOW_SIGNAL, WRONG_SIGNAL
from hotweights.waiting import wait_until
from tests.controllerhelpers import ControllerStack, gateway_load

RPS = 10  # completions a second through the gateway


@pytest.fixture(scope="module")
def stack(tiny_model: Path) -> Iterator[ControllerStack]:
    stack = ControllerStack(tiny_model, max_batch=4)  # the shipped engine.max_batch
    try:
        stack.start_controller("up")
        stack.wait_steady(timeout=180)
        yield stack
    finally:
        stack.close()


def alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists()


def gateway_url(stack: ControllerStack) -> str:
    return f"http://127.0.0.1:{stack.config.gateway.port}"


def test_a_primary_slowed_20x_is_switched_over_and_not_fenced(stack: ControllerStack) -> None:
    old = stack.primary()
    with gateway_load(gateway_url(stack), RPS) as load:
        wait_until(lambda: len(load.records) >= 10, 60, "load through the gateway")
        os.kill(old["pid"], SLOW_SIGNAL)
        try:
            new = wait_until(lambda: (p := stack.primary())["id"] != old["id"] and p, 30, "a new primary")
            served = len(load.records)
            wait_until(lambda: len(load.records) >= served + 10, 60, "load served by the new primary")
        finally:
            os.kill(old["pid"], SLOW_SIGNAL)  # its speed back
    errors = [r.error for r in load.records if r.error]
    assert errors == [] and all(r.correct for r in load.records), errors[:3]
    (degraded,) = [e for e in stack.events(EventKind.DEGRADED) if e["member"] == old["id"]]
    assert "their best" in degraded["reason"], degraded
    switchover = stack.events(EventKind.SWITCHOVER)[-1]
    assert (switchover["old"], switchover["new"]) == (old["id"], new["id"])
    assert alive(old["pid"]) and stack.members()[old["id"]]["pid"] == old["pid"]  # nothing fenced
    print(f"\nslow: switched over {event_time(switchover) - event_time(degraded):.3f} s after the decision")


def test_a_primary_whose_outputs_went_wrong_is_fenced_and_its_arena_verified(stack: ControllerStack) -> None:
    stack.wait_steady(timeout=120)
    old = stack.primary()
    with gateway_load(gateway_url(stack), RPS) as load:
        wait_until(lambda: len(load.records) >= 10, 60, "load through the gateway")
        os.kill(old["pid"], WRONG_SIGNAL)
        wait_until(lambda: not alive(old["pid"]), 30, "the wrong primary fenced")
        new = wait_until(lambda: (p := stack.primary())["id"] != old["id"] and p, 30, "a new primary")
        served = len(load.records)
        wait_until(lambda: len(load.records) >= served + 10, 60, "load served by the new primary")
    errors = [r.error for r in load.records if r.error and r.correct is not False]
    assert errors == [], errors[:3]  # answers may be wrong until it is fenced, never errors
    (wrong,) = [e for e in stack.events(EventKind.WRONG_OUTPUT) if e["member"] == old["id"]]
    assert "answered the canary" in wrong["message"], wrong
    assert stack.events(EventKind.FAILOVER)[-1]["new"] == new["id"]
    verified = wait_until(lambda: stack.events(EventKind.ARENA_VERIFIED), 120, "the arena verified")
    assert verified[-1]["ok"] is True, verified
