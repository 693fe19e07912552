"""Waiting for a condition that another process brings about, seen from outside (benchmarks and tests)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

import httpx

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], timeout: float = 60.0, what: str = "condition", interval: float = 0.02) -> T:
    """Poll until ``predicate()`` is truthy and return its value; transport errors (a server not listening yet)
    count as not yet, anything else it raises propagates. TimeoutError naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.TransportError):
            if value := predicate():
                return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
