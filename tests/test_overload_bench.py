"""Overload on CPU at CI's scale: ``bench/overload.py`` (the tiny model, one engine behind the gateway's workers,
admission by expected wait with a queue budget of a second, which a second of load reaches) at 1x and 5x its measured
capacity for a second each. Every answer is a completion or a refusal (429 with the reason), nothing else; at 5x
most are refused and some still served. Its latency targets are the benchmark's
to report, on the GPU (``docs/benchmarks.md``, Overload), not a timed test's. ``bench/refusal_cost.py`` likewise:
a flood an engine answers itself is refused, and the figures are there."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.cachehelpers import bench_result

BENCH = Path(__file__).resolve().parent.parent / "bench" / "overload.py"
REFUSAL_COST = BENCH.with_name("refusal_cost.py")


@pytest.mark.timeout(300)
def test_overload_answers_every_request_with_a_completion_or_a_refusal() -> None:
    command = [sys.executable, str(BENCH), "--seconds", "1", "--quiet-requests", "10", "--loads", "1,5"]
    # Four sequences at once, not the automatic 32 of today's CPU default: at 32 a 5x burst on two cores can leave
    # the engine answering the gateway's probes late, the gateway without a primary for a while (1 of 5 runs failed
    # so), which the benchmark, not this test, reports (docs/benchmarks.md, Overload).
    command += ["--queue-budget", "1", "--max-batch", "4"]
    result = bench_result(command, timeout=240)
    assert result["errors"] == 0, result["loads"]
    at5 = result["loads"]["5x"]
    # 5x for 1 s with a 1 s budget: the engine admits what starts within its budget, about two seconds of its
    # capacity, so about half is refused (28 of 56 in one run): a quarter at least
    assert at5["admitted"] > 0 and at5["refused"] >= at5["sent"] // 4, at5
    assert at5["admitted"] + at5["refused"] == at5["sent"]
    assert result["loads"]["1x"]["admitted"] > 0
    means = at5["engine_mean_ms"]  # queue_wait only where some request waited (a slow machine's refuses them all)
    assert {"first_token", "service", "queued"} <= set(means) <= {"queue_wait", "first_token", "service", "queued"}
    assert ("queue_wait" in means) == (means["queued"] > 0), means


@pytest.mark.timeout(300)
def test_refusal_cost_floods_an_engine_that_refuses() -> None:
    command = [sys.executable, str(REFUSAL_COST), "--rates", "100", "--requests", "2", "--max-tokens", "16"]
    result = bench_result(command, timeout=240)
    flood = result["100/s"]
    assert flood["flood_answers"].get("429", 0) > 0, flood
    assert set(flood["flood_answers"]) <= {"200", "429"}, flood
    assert flood["slowdown"] > 0 and result["ms_per_token_alone"] > 0
