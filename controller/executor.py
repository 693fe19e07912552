"""Slow actions off the HA loop: at most one background action per failover group (Patroni's AsyncExecutor).

The loop decides; an action (fence and promote, a switchover's drain, a standby's start) runs here
as a task of its group. While it runs, the loop leaves that group alone and reports the action "in
progress", but keeps deciding for every other group: a switchover that waits on a long drain in
group 0 never delays a failover in group 1. An action of a kind (say "elect") that failed holds
that kind back in its group with exponential backoff (``decide.backoff_s``), so no decision is retried in a
tight loop; a success of the kind clears it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from tenacity import wait_exponential

from hotweights.controller.decide import BACKOFF_FIRST_S, BACKOFF_MAX_S, backoff_s

log = logging.getLogger(__name__)

# ``decide.backoff_s`` as tenacity's wait, for the retries tenacity runs (the services' keepers).
BACKOFF = wait_exponential(multiplier=BACKOFF_FIRST_S, max=BACKOFF_MAX_S)


@dataclass(frozen=True)
class Outcome:
    """What an action reports: one sentence, and whether it did what it set out to do."""

    sentence: str
    ok: bool = True


@dataclass
class _Running:
    what: str
    task: asyncio.Task
    started_at: float


@dataclass
class _Failed:
    failures: int
    retry_at: float  # time.monotonic()
    sentence: str


class GroupExecutor:
    """Runs one action at a time per group; ``on_done`` (the loop's wakeup) runs after each one."""

    def __init__(self, on_done: Callable[[], None]) -> None:
        self.on_done = on_done
        self.running: dict[int, _Running] = {}
        self.failed: dict[tuple[int, str], _Failed] = {}  # (group, kind) -> its last failure

    def busy(self, group: int) -> str | None:
        """None when ``group`` is free, else what it is doing and for how long."""
        running = self.running.get(group)
        if running is None:
            return None
        return f"{running.what} (for {time.monotonic() - running.started_at:.1f} s)"

    def backing_off(self, group: int, kind: str | None = None) -> str | None:
        """None when ``group`` may act (an action of ``kind``; None: of any kind), else why it waits."""
        now = time.monotonic()
        waits = [
            f"{k} retried in {failed.retry_at - now:.1f} s (after: {failed.sentence})"
            for (g, k), failed in self.failed.items()
            if g == group and (kind is None or k == kind) and now < failed.retry_at
        ]
        return "; ".join(waits) or None

    def clear(self, group: int, kind: str) -> None:
        """Forget the failures of ``kind`` in ``group``: what they were about is over (a new primary serves)."""
        self.failed.pop((group, kind), None)

    def run(self, group: int, what: str, action: Awaitable[Outcome], kind: str | None = None) -> str:
        """Start ``action`` for ``group`` (which must be free); a failed outcome holds ``kind`` back (None:
        never, e.g. an operator's request). Returns the sentence that says what started."""
        assert group not in self.running, f"group {group} is already busy: {self.running[group].what}"
        task = asyncio.create_task(self._run(group, action, kind), name=f"group-{group}: {what}")
        self.running[group] = _Running(what, task, time.monotonic())
        return f"group {group}: {what}"

    async def _run(self, group: int, action: Awaitable[Outcome], kind: str | None) -> None:
        try:
            outcome = await action
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("unexpected error in a group %d action", group)
            outcome = Outcome(f"group {group}: caught an unexpected error in an action; report it as a BUG", False)
        finally:
            del self.running[group]
            self.on_done()
        log.info("group %d: %s", group, outcome.sentence)
        if kind is None:
            return
        if outcome.ok:
            self.failed.pop((group, kind), None)
        else:
            failures = self.failed[group, kind].failures + 1 if (group, kind) in self.failed else 1
            self.failed[group, kind] = _Failed(failures, time.monotonic() + backoff_s(failures), outcome.sentence)

    async def stop(self, timeout: float) -> list[str]:
        """Let the actions in progress finish (a failover half done is worse than a late exit) for up to
        ``timeout`` seconds, then cancel the rest; returns what was cancelled."""
        tasks = {r.task: r.what for r in self.running.values()}
        if not tasks:
            return []
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return [tasks[task] for task in pending]
