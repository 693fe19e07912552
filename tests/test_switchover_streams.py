"""A planned switchover is as invisible to streams in flight as a failover: the old primary keeps the slots of the
streams the gateway cut from it and hands them over (``standby.kvshare``), the new primary continues each from its
keys and values, and every text is the uncut run's.

A real stack (``hotweights up``: controller, daemon, two batch-invariant engines, the gateway), greedy streams
through the gateway, ``POST /switchover`` once each has some text.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from hotweights.contract import Endpoint
from tests.cachehelpers import wait_until
from tests.controllerhelpers import ControllerStack
from tests.test_migration import Case, running, uncut

STREAMS = 4
MAX_TOKENS = 200  # with the prompt, within the stack's 256 KV positions per slot
CUT_AFTER = 8  # chunks each stream has when the switchover begins
ADOPTED = "hotweights_engine_kv_adopted_sequences"


def adopted(url: str) -> float:
    """Sequences the engine at ``url`` started from another engine's deposited KV cache."""
    text = httpx.get(url + Endpoint.METRICS, timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(ADOPTED + " "))


@pytest.mark.timeout(300)
def test_a_switchover_continues_every_stream_from_the_old_primarys_kv_cache(tiny_model: Path) -> None:
    stack = ControllerStack(
        tiny_model, engines=2, max_batch=STREAMS, drain_timeout_s=30.0, engine_extra="batch_invariant = true\n"
    )
    try:
        stack.start_controller("up")
        members = stack.wait_steady()
        gateway = f"http://127.0.0.1:{stack.config.gateway.port}"
        old = stack.primary()
        (new,) = [m for m in members.values() if m["id"] != old["id"]]
        greedy = {"max_tokens": MAX_TOKENS, "temperature": 0.0}
        streamed = {"stream": True, "stream_options": {"include_usage": True}}
        made = [Case(Endpoint.COMPLETIONS, greedy | {"prompt": f"Stream {i} goes on"}) for i in range(STREAMS)]
        with httpx.Client(base_url=gateway, timeout=120) as client:
            for case in made:  # the uncut run, one at a time
                case.expected = uncut(client.post(case.path, json=case.request).json())
                case.request |= streamed
        with running(gateway, made):
            wait_until(lambda: all(c.chunks >= CUT_AFTER or c.outcome for c in made), 60, "every stream under way")
            switched = stack.client.post("/switchover", json={})
        assert switched.status_code == 200, switched.text
        assert (switched.json()["new_primary"], switched.json()["kv_slots_handed_over"]) == (new["id"], STREAMS)
        assert [case.outcome for case in made] == ["done"] * STREAMS
        assert [case.got for case in made] == [case.expected for case in made]
        assert all(len(case.ids) == 1 for case in made)
        assert adopted(new["url"]) == STREAMS, "a stream was not continued from the old primary's KV cache"
    finally:
        stack.close()
