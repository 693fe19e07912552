"""An engine under multi-host fencing (``standby.fencing``): stale tokens refused, a newer leader's token and a
lapsed lease both demote the primary. One real engine; no controller, no etcd."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from hotweights.contract import Endpoint
from tests.cachehelpers import wait_until
from tests.enginehelpers import EngineProcess

TOKEN = "fencing-test-token"
FLAGS = ("--kv-cache-tokens", "256", "--max-batch", "2", "--role", "standby")


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> EngineProcess:
    with EngineProcess(tiny_model, *FLAGS, token=TOKEN) as engine:
        yield engine


def primary_status(engine: EngineProcess) -> int:
    return engine.client.get(Endpoint.PRIMARY).status_code


def test_stale_and_missing_tokens_are_refused_and_a_newer_one_demotes(engine: EngineProcess) -> None:
    promoted = engine.post(Endpoint.PROMOTE, json={"fencing_token": 10, "lease_s": 60.0})
    assert promoted.status_code == 200, promoted.text
    assert primary_status(engine) == 200
    assert engine.post(Endpoint.LEASE, json={"fencing_token": 10, "lease_s": 60.0}).status_code == 200

    stale = engine.post(Endpoint.LEASE, json={"fencing_token": 9, "lease_s": 60.0})
    assert stale.status_code == 409 and "stale fencing token 9" in stale.json()["message"]
    assert engine.post(Endpoint.PROMOTE, json={"fencing_token": 9}).status_code == 409
    assert engine.post(Endpoint.PROMOTE).json()["message"] == "already primary"  # a resume keeps its lease
    assert primary_status(engine) == 200  # refusals change nothing

    newer = engine.post(Endpoint.LEASE, json={"fencing_token": 11, "lease_s": 60.0})
    assert newer.status_code == 200 and "demoting" in newer.json()["message"]
    assert primary_status(engine) == 503  # at once: no request is admitted after the answer
    wait_until(lambda: engine.client.get(Endpoint.STANDBY).status_code == 200, 30, "the demote to finish")
    refused = engine.post(Endpoint.PROMOTE, json={"fencing_token": 10, "lease_s": 60.0})
    assert refused.status_code == 409, refused.text
    untokened = engine.post(Endpoint.PROMOTE)
    assert untokened.status_code == 409 and "must carry one" in untokened.json()["message"]


def test_a_primary_whose_lease_lapses_demotes_itself(engine: EngineProcess) -> None:
    lease_s = 0.5
    start = time.monotonic()
    promoted = engine.post(Endpoint.PROMOTE, json={"fencing_token": 20, "lease_s": lease_s})
    assert promoted.status_code == 200, promoted.text
    assert primary_status(engine) == 200
    wait_until(lambda: primary_status(engine) == 503, 30, "the lease to lapse", interval=0.01)
    assert time.monotonic() - start >= lease_s  # not before its deadline
    wait_until(lambda: engine.client.get(Endpoint.STANDBY).status_code == 200, 30, "the demote to finish")
    assert "lease ran out" in engine.logs()


def test_renewals_keep_a_primary_serving_past_its_first_deadline(engine: EngineProcess) -> None:
    promoted = engine.post(Endpoint.PROMOTE, json={"fencing_token": 30, "lease_s": 1.0})
    assert promoted.status_code == 200, promoted.text
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline:  # renewals 0.2 s apart, each for 1 s: it never lapses
        assert engine.post(Endpoint.LEASE, json={"fencing_token": 30, "lease_s": 1.0}).status_code == 200
        assert primary_status(engine) == 200
        time.sleep(0.2)
    assert engine.post(Endpoint.DEMOTE).status_code == 200


@pytest.mark.parametrize(
    "body",
    [{"fencing_token": 0, "lease_s": 1.0}, {"fencing_token": 5, "lease_s": 0}, {"fencing_token": "5", "lease_s": 1.0},
     {"fencing_token": True, "lease_s": 1.0}, {"lease_s": 1.0}, {"fencing_token": 5, "lease_s": 1.0, "x": 1}],
)  # fmt: skip
def test_hostile_lease_bodies_are_400(engine: EngineProcess, body: dict) -> None:
    assert engine.post(Endpoint.LEASE, json=body).status_code == 400
