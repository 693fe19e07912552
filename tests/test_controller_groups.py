"""Two failover groups under one controller: the actions of one group never wait for the other's."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

import httpx

from tests.controllerhelpers import ControllerStack, wait_until


def test_a_held_drain_in_one_group_does_not_delay_failover_in_another(tiny_model: Path) -> None:
    """Group 0's primary is stopped, so a drain requested there hangs; meanwhile group 1's primary is
    SIGKILLed. Group 1 must fail over while group 0's drain is still held open."""
    # A high failure threshold: the stopped primary of group 0 must stay its primary (not fail over) for
    # the whole test, so that the only thing going on in group 0 is the held drain.
    stack = ControllerStack(
        tiny_model, engines=2, groups=2, failure_threshold=10_000, drain_timeout_s=30.0, group_extra="max_engines = 2\n"
    )
    try:
        stack.start_controller()
        stack.wait_steady()
        held, victim = stack.primary(0), stack.primary(1)
        drained: list[httpx.Response] = []
        drain = threading.Thread(
            target=lambda: drained.append(stack.client.post(f"/engines/{held['id']}/drain", json={"timeout_s": 60}))
        )
        os.kill(held["pid"], signal.SIGSTOP)
        try:
            drain.start()
            wait_until(lambda: "group 0: drain (requested)" in stack.logs(), 30, "group 0's drain to start")
            os.kill(victim["pid"], signal.SIGKILL)
            failover = wait_until(
                lambda: next((e for e in stack.events("failover") if e["old"] == victim["id"]), None),
                30,
                "group 1's failover",
            )
            still_held = drain.is_alive() and not drained
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(held["pid"], signal.SIGCONT)
        assert still_held, "group 0's drain ended before group 1 failed over: the test proved nothing"
        assert failover["group"] == 1 and failover["new"] != victim["id"]
        print(f"\ngroup 1 failed over in {failover['total_ms']} ms while group 0's drain was held")
        drain.join(timeout=90)
        assert drained and drained[0].status_code == 200, drained and drained[0].text
        resumed = stack.client.post(f"/engines/{held['id']}/promote")
        assert resumed.status_code == 200, resumed.text
        members = stack.wait_steady()
        assert stack.primary(0)["id"] == held["id"] and members[held["id"]]["pid"] == held["pid"]
        refused = stack.client.post("/engines", json={"group": 1})  # max_engines bounds what a client may add
        assert refused.status_code == 409 and "max_engines is 2" in refused.json()["detail"], refused.text
    finally:
        stack.close()
