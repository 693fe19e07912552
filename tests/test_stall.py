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
from hotweights.standby.decoder import Decoder
from hotweights.standby.model import KVCache, Transformer
from hotweights.standby.progress import (
    FREEZE_SIGNAL,
    STALL_FACTOR,
    STALL_FLOOR_S,
    Progress,
    Step,
    expected_prefill_s,
    padded,
    stall_bound_s,
    stall_refusal,
)
from hotweights.standby.scheduler import Finish, SamplingParams, Scheduler, Sequence
from hotweights.standby.weights import load_model
from hotweights.waiting import wait_until
from tests.controllerhelpers import ControllerStack, gateway_load, split_brain_watch

RPS = 10  # the target's load: completions a second through the gateway
SLOW_PREFILL_S = 1.5  # a prefill the slow device takes beyond the floor
KV_TOKENS = 128


def step(expected_s: float | None, what: str = "a decode step of 1 row(s)") -> Step:
    return Step(what, 100.0, expected_s)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("progress", "now", "stalled"),
    [
        (Progress(0, 0.0, None, 0.01), 100.0, None),  # nothing pending: idle, never stalled
        (Progress(2, 100.0, None, 0.01), 100.9, None),  # between operations: the floor
        (Progress(2, 100.0, None, 0.01), 101.1, "no progress for 1.1 s with 2 sequence(s) pending (its bound: 1.0 s)"),
        (Progress(1, 100.0, None, 0.5), 104.9, None),  # slow steps: ten of them
        (Progress(1, 100.0, None, 0.5), 105.1, "no progress for 5.1 s with 1 sequence(s) pending (its bound: 5.0 s)"),
        (Progress(1, 100.0, step(1.0), 0.01), 109.9, None),  # the step in flight expects a second
        (Progress(1, 100.0, step(1.0), 0.01), 110.5, "in a decode step of 1 row(s) for 10.5 s (its bound: 10.0"),
        (Progress(1, 100.0, step(0.01, "a prefill of 1 x 16 tokens"), 0.01), 101.2, "in a prefill of 1 x 16 tokens"),
        (Progress(1, 100.0, step(None, "a prefill of 1 x 4096 tokens"), 0.01), 900.0, None),  # nothing to expect by
    ],
)
def test_a_worker_with_work_pending_and_no_progress_past_its_bound_is_stalled(
    progress: Progress, now: float, stalled: str | None
) -> None:
    reason = stall_refusal(progress, now)
    assert reason == stalled if stalled is None else stalled in reason


@pytest.mark.unit
@pytest.mark.parametrize(
    ("progress", "bound"),
    [
        (Progress(1, 0.0, None, 0.0), None),  # nothing measured yet: nothing to expect by
        (Progress(1, 0.0, None, 1.0), STALL_FACTOR),
        (Progress(1, 0.0, step(0.001), 1.0), STALL_FLOOR_S),  # the step in flight, not the average, counts
        (Progress(1, 0.0, step(None), 1.0), None),
    ],
)
def test_the_bound_is_a_multiple_of_the_expected_time_above_a_floor(progress: Progress, bound: float | None) -> None:
    assert stall_bound_s(progress) == bound


@pytest.mark.unit
@pytest.mark.parametrize(
    ("measured", "shape", "expected"),
    [
        ({}, (1, 16), None),
        ({(1, 64): 0.5, (1, 16): 0.001}, (1, 64), 0.5),  # its own time, however the others scale
        ({(1, 16): 0.01}, (1, 32), 0.04),  # twice the tokens, four times the attention
        ({(1, 16): 0.01, (1, 1024): 0.1}, (1, 2048), 0.4),  # the least bound: from the nearest
        ({(4, 16): 0.02}, (1, 64), 0.08),  # as many tokens, four times the attention
        ({(1, 64): 0.02}, (4, 16), 0.02),  # as many tokens, less attention: never below the measured time
        ({(1, 1024): 0.1}, (1, 16), 0.1),  # a smaller shape: the larger one's time bounds it
    ],
)
def test_a_prefill_is_expected_to_take_its_shapes_time_or_a_measured_one_scaled_up(
    measured: dict[tuple[int, int], float], shape: tuple[int, int], expected: float | None
) -> None:
    assert expected_prefill_s(measured, shape) == pytest.approx(expected)


@pytest.mark.unit
@pytest.mark.parametrize(("longest", "length"), [(1, 16), (16, 16), (17, 32), (64, 64), (65, 65)])
def test_a_prompt_is_padded_to_the_prefill_length_that_holds_it(longest: int, length: int) -> None:
    assert padded([16, 32, 64], longest) == length


@pytest.fixture(scope="module")
def model(tiny_model: Path) -> Transformer:
    return load_model(tiny_model, LoadSpec()).model


class HangingDecoder(Decoder):
    """A real decoder whose decode steps, once ``hang`` is set, wait for ``release`` (a kernel that does not
    return, until the test lets it)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.hang, self.release = threading.Event(), threading.Event()

    def decode(self, tokens: list[int], positions: list[int]) -> tuple[torch.Tensor, list[int]]:
        if self.hang.is_set():
            self.release.wait(60)
        return super().decode(tokens, positions)


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
