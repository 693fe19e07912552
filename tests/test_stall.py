"""Progress-based health: an engine with work pending that stops making progress reports itself unhealthy within a
bound derived from its own step times (``standby.progress``), the controller fails over from it, and a stuck engine
that does not end on SIGTERM is SIGKILLed after the supervisor's bound."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from hotweights.cache.loadspec import LoadSpec
from hotweights.chaos.clusterview import event_time
from hotweights.contract import Endpoint
from hotweights.controller import supervisor
from hotweights.ports import free_port
from hotweights.spawn import hotweights_command
from hotweights.standby.decoder import Decoder, Launched
from hotweights.standby.model import KVCache, Transformer
from hotweights.standby.progress import (
    FREEZE_SIGNAL,
    STALL_FLOOR_S,
    padded,
)
from hotweights.standby.scheduler import Finish, SamplingParams, Scheduler, Sequence
from hotweights.standby.weights import load_model
from hotweights.waiting import wait_until
from tests.controllerhelpers import ControllerStack, gateway_load, split_brain_watch

RPS = 10  # the target's load: completions a second through the gateway
SLOW_PREFILL_S = 1.5  # a prefill the slow device takes beyond the floor
KV_TOKENS = 128


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Transformer:
    return load_model(tiny_model, LoadSpec()).model


class HangingDecoder(Decoder):
    """A real decoder whose decode steps' results, once ``hang`` is set, wait for ``release`` (a kernel that does not
    return, until the test lets it)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.hang, self.release = threading.Event(), threading.Event()

    def finish(self, step: Launched) -> tuple[torch.Tensor, list[int]]:
        if self.hang.is_set():
            self.release.wait(60)
        return super().finish(step)


class SlowDevice(Decoder):
    """A real decoder on a device whose prefills of a whole KV slot take SLOW_PREFILL_S (beyond the floor)."""

    def prefill(self, first: int, prompts: list[list[int]]) -> torch.Tensor:
        if padded(self.lengths, max(map(len, prompts))) == self.lengths[-1]:
            time.sleep(SLOW_PREFILL_S)  # the device's time, not a wait for anything
        return super().prefill(first, prompts)


def scheduled(decoder: Decoder) -> Scheduler:
    decoder.warm_up()
    scheduler = Scheduler()
    scheduler.attach_kv(decoder)
    scheduler.start()
    return scheduler


def test_a_hung_decode_step_makes_the_worker_stalled_after_its_bound_and_progress_clears_it(
    model: Transformer,
) -> None:
    decoder = HangingDecoder(model, KVCache.allocate(model.config, model.tp, 2, KV_TOKENS, model.device, model.dtype))
    scheduler = scheduled(decoder)
    try:
        tokens: list[int] = []
        done = threading.Event()
        sink = lambda event: done.set() if isinstance(event, Finish) else tokens.append(event)  # noqa: E731
        scheduler.submit(Sequence([5, 9, 13], SamplingParams(KV_TOKENS - 8), sink))
        wait_until(lambda: tokens, 30, "a first token")
        decoder.hang.set()
        hung = time.monotonic()
        reason = wait_until(scheduler.stall_refusal, STALL_FLOOR_S + 10, "the stall reported")
        assert time.monotonic() - hung >= STALL_FLOOR_S * 0.9  # the last step ended at most a step before the hang
        assert "1 sequence(s) pending, in a decode step of 1 row(s)" in reason, reason
        decoder.hang.clear()
        decoder.release.set()
        assert done.wait(30)
        assert scheduler.stall_refusal() is None  # nothing pending
    finally:
        decoder.release.set()
        scheduler.stop(10)


def test_a_long_prefill_is_allowed_the_time_its_shape_took_at_warm_up(model: Transformer) -> None:
    decoder = SlowDevice(model, KVCache.allocate(model.config, model.tp, 2, KV_TOKENS, model.device, model.dtype))
    scheduler = scheduled(decoder)
    assert decoder.prefill_times[1, KV_TOKENS] >= SLOW_PREFILL_S
    try:
        done = threading.Event()
        sink = lambda event: done.set() if isinstance(event, Finish) else None  # noqa: E731
        scheduler.submit(Sequence(list(range(2, KV_TOKENS - 10)), SamplingParams(4), sink))
        refusals = []
        while not done.wait(0.02):  # the health checks' view, all through the slow prefill
            refusals.append(scheduler.stall_refusal())
        assert len(refusals) > SLOW_PREFILL_S / 0.05 and not any(refusals), [r for r in refusals if r][:1]
    finally:
        scheduler.stop(10)


def get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=5)


def test_a_frozen_engine_is_unhealthy_within_its_bound_and_killed_when_sigterm_cannot_end_it(
    tmp_path: Path, tiny_model: Path
) -> None:
    """The engine's inference thread frozen (FREEZE_SIGNAL) with a completion in flight: ready and primary turn 503
    with the reason after the floor, live stays 200 (the HTTP server answers). Its SIGTERM cannot finish that
    completion: the supervisor's stop SIGKILLs it after its bound, and nothing of it is left."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = hotweights_command("engine", "--model", str(tiny_model), "--port", str(port), "--role", "primary")

    async def run() -> None:
        watcher = supervisor.Supervisor(tmp_path, lambda _: None)
        engine = watcher.spawn("engine", [*command, "--kv-cache-tokens", str(KV_TOKENS)])
        try:
            await asyncio.to_thread(wait_until, lambda: get(url + Endpoint.READY).status_code == 200, 120, "ready")
            async with httpx.AsyncClient(timeout=60) as client:
                body = {"prompt": "The weather", "max_tokens": KV_TOKENS - 16, "stream": True}
                async with client.stream("POST", url + Endpoint.COMPLETIONS, json=body) as stream:
                    await anext(stream.aiter_lines())  # generating
                    os.kill(engine.pid, FREEZE_SIGNAL)
                    frozen = time.monotonic()
                    ready = await asyncio.to_thread(
                        wait_until, lambda: (r := get(url + Endpoint.READY)).status_code == 503 and r, 30, "503"
                    )
                    assert time.monotonic() - frozen >= STALL_FLOOR_S * 0.9
                    assert "has made no progress for" in ready.json()["reason"], ready.json()
                    assert get(url + Endpoint.PRIMARY).status_code == 503
                    assert get(url + Endpoint.LIVE).status_code == 200  # its HTTP server answers
                    stopping = time.monotonic()
                    how = await watcher.stop(engine, timeout=1.0)
            assert how == "killed after ignoring SIGTERM for 1 s", how
            assert time.monotonic() - stopping < 1.0 + supervisor.FENCE_TIMEOUT_S
            assert not engine.alive and supervisor.session_members(engine.pid) == []
        finally:
            await watcher.fence(engine)

    asyncio.run(run())


def test_a_stalled_primary_is_failed_over_within_its_bound_with_no_client_error(tiny_model: Path) -> None:
    stack = ControllerStack(tiny_model, max_batch=4)  # the shipped engine.max_batch
    try:
        stack.start_controller("up")
        members = stack.wait_steady(timeout=180)
        old = stack.primary()
        gateway = f"http://127.0.0.1:{stack.config.gateway.port}"
        with gateway_load(gateway, RPS) as load, split_brain_watch([m["url"] for m in members.values()]) as detector:
            wait_until(lambda: len(load.records) >= 10, 60, "load through the gateway")
            frozen = time.time()
            os.kill(old["pid"], FREEZE_SIGNAL)
            new = wait_until(lambda: (p := stack.primary())["id"] != old["id"] and p, 30, "a new primary")
            served = len(load.records)
            wait_until(lambda: len(load.records) >= served + 10, 60, "load served by the new primary")
        errors = [r.error for r in load.records if r.error]
        assert errors == [] and all(r.correct for r in load.records), errors[:3]
        assert detector.samples == [], f"split brain: {detector.samples}"
        (detect,) = [e for e in stack.events("detect") if e["member"] == old["id"]]
        assert "has made no progress for" in detect["message"], detect
        failover = stack.events("failover")[-1]
        assert failover["old"] == old["id"] and failover["new"] == new["id"]
        first = min(r.end for r in load.records if r.start >= frozen and r.ok)
        print(f"\nstall: failover {event_time(failover) - frozen:.3f} s, first success {first - frozen:.3f} s after")
        # the floor, then (on two cores shared with the whole stack) checks every 100 ms, a fence and a promotion
        assert event_time(failover) - frozen < STALL_FLOOR_S + 2.0
    finally:
        stack.close()
