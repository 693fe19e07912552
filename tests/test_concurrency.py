"""A client's burst through ``hotweights up`` with its defaults is served, not refused: ``bench/concurrency.py`` (the
tiny model on CPU) at its target, 32 concurrent streams of 64 tokens, twice, after one completion has timed the
primary (so that admission judges each stream by its expected start, not by knowing nothing yet)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.cachehelpers import bench_result

BENCH = Path(__file__).resolve().parent.parent / "bench" / "concurrency.py"


@pytest.mark.timeout(600)
def test_32_concurrent_streams_through_hotweights_up_are_all_served() -> None:
    result = bench_result([sys.executable, str(BENCH), "--streams", "32", "--max-tokens", "64"], timeout=540)
    assert [b["answers"] for b in result["bursts"]] == [{"200": 32}] * 2, result
    assert result["refused"] == 0 and result["errors"] == 0, result
    assert all(b["tokens"] > 32 for b in result["bursts"]), result
