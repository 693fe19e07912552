"""Writes to the state dir that survive its failing: a full disk (ENOSPC), EIO, a read-only remount.

What the controller keeps in memory is the truth; ``state.json`` and ``events.jsonl`` are its copies. A write
that fails never fails what made it (a failover's role change, its events): the latest state and every event not
yet written stay in memory (``controller.events`` bounds those) and are written by the next write, or by the
retry every ``RETRY_S`` while one is pending, so the files are whole and current again once the disk takes
writes. ``StateDirHealth`` logs one line when the directory starts failing (or fails differently), one when
every pending write is done, and exports the gauge ``hotweights_controller_state_dir_failing``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from hotweights.controller.metrics import ControllerMetrics
from hotweights.state import ClusterState, write_state

log = logging.getLogger(__name__)

RETRY_S = 1.0  # while a write is pending, every pending write is tried again this often


class StateDirHealth:
    """Whether the writes to one state dir succeed. Its writers report each failed and each successful write,
    and register a ``flush`` (write what is pending, True when nothing is) for the retry. ``metrics``: the
    controller's (None in the gateway, whose event log reports here too)."""

    def __init__(self, state_dir: Path | None, metrics: ControllerMetrics | None = None) -> None:
        self.state_dir = state_dir
        self.metrics = metrics
        self.failing: dict[str, str] = {}  # file name -> the error its last write met
        self.since: float | None = None  # time.monotonic() of the first failure of the spell
        self.flushes: list[Callable[[], bool]] = []
        self.retry: asyncio.TimerHandle | None = None

    @property
    def is_failing(self) -> bool:
        return bool(self.failing)

    def watch(self, flush: Callable[[], bool]) -> None:
        self.flushes.append(flush)

    def failed(self, path: Path, exc: OSError) -> None:
        """A write to ``path`` failed: one warning when the spell starts or its error changes, the retry armed."""
        error = exc.strerror or str(exc)
        if error not in self.failing.values():
            log.warning(
                "cannot write %s (%s): what it should hold is kept in memory and written once the state dir takes "
                "writes again (tried every %g s); nothing else waits for it",
                path,
                error,
                RETRY_S,
            )
        if self.since is None:
            self.since = time.monotonic()
        self.failing[path.name] = error
        if self.metrics is not None:
            self.metrics.state_dir_failing.set(1)
            self.metrics.state_dir_write_failures.labels(path.name).inc()
        self._arm()

    def written(self, path: Path) -> None:
        """A write to ``path`` succeeded; the spell ends, in one line, once no file has a write pending."""
        if self.failing.pop(path.name, None) is None or self.failing:
            return
        assert self.since is not None
        log.info(
            "the state dir %s takes writes again after %.1f s: what was kept in memory is written",
            self.state_dir or path.parent,
            time.monotonic() - self.since,
        )
        self.since = None
        if self.metrics is not None:
            self.metrics.state_dir_failing.set(0)

    def events_held(self, held: int, dropped: int = 0) -> None:
        """The event log holds ``held`` events for the file; ``dropped`` more were just dropped (the memory bound)."""
        if self.metrics is not None:
            self.metrics.events_held.set(held)
            self.metrics.events_dropped.inc(dropped)

    def _arm(self) -> None:
        """Retry in RETRY_S, on the running event loop (none: the next write retries)."""
        if self.retry is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self.retry = loop.call_later(RETRY_S, self._retry)

    def _retry(self) -> None:
        self.retry = None
        if not all([flush() for flush in self.flushes]):  # every one, even after a failure
            self._arm()


class StateWriter:
    """``state.json``'s writer: ``save`` writes the state at once (atomically: ``write_state``); when that fails,
    the latest state is kept and written by the next ``save`` or the retry. Never raises OSError."""

    def __init__(self, path: Path, health: StateDirHealth) -> None:
        self.path = path
        self.health = health
        self.pending: ClusterState | None = None
        health.watch(self.flush)

    def save(self, state: ClusterState) -> None:
        self.pending = state
        self.flush()

    def flush(self) -> bool:
        """Write the pending state, if any; True when none is pending any more."""
        if self.pending is None:
            return True
        try:
            write_state(self.path, self.pending)
        except OSError as exc:
            self.health.failed(self.path, exc)
            return False
        self.pending = None
        self.health.written(self.path)
        return True
