"""Engine health checks and the small policies that judge them.

Healthy means "answered ``GET /health/ready`` with 200 within the timeout", not "the process
exists": a SIGSTOPped primary is alive and fails every check. A check is sent every interval whether
the last one has answered or not, so the checks of a hung engine overlap and the failure threshold is
reached about timeout + (threshold - 1) x interval after it stopped answering (not threshold x timeout);
a check refused at once is followed by the next at once. A
timeout that fired late because the controller itself was starved of CPU is not counted either way, nor
is a check that failed because the controller ran out of file descriptors, nor one unanswered while the engine's
process ran on the CPU (at least BUSY_CPU_SHARE of the wait) within BUSY_GRACE_S of its last healthy answer: an engine
saturated by its load (on a small host, its HTTP thread waiting for the interpreter behind its inference thread)
answers late, and failing it over would move the load, not end it; a stopped or deadlocked process runs nothing and is
counted at once, one spinning without answering is counted once BUSY_GRACE_S has passed (``busy_not_hung``).
Each engine process gets its own check task, so one hung engine never delays the checks of the
others. The reply body (role, state, pid) is kept: the engines, not the controller, are the truth
about who is primary.

Policies are tenacity-style callables over one observed member: None when all is well, else the
reason, and ``a | b`` gives the first reason found.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Protocol

import httpx

from hotweights.contract import Endpoint
from hotweights.controller.snapshot import HealthRecord
from hotweights.limits import is_out_of_descriptors
from hotweights.proctree import busy_not_hung, cpu_seconds, cpu_used

# A check that timed out counts only if this controller woke up on time for its deadline: later than this
# fraction of the timeout, our own event loop was starved (a saturated CPU), which says nothing of the engine.
STALL_FRACTION = 0.5


class HealthChecker:
    """One check task per tracked engine; ``on_change`` fires when a verdict may have changed."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        interval_s: float,
        timeout_s: float,
        threshold: int,
        on_change: Callable[[], None],
        observe_latency: Callable[[float], None],
    ) -> None:
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.threshold = threshold
        self.on_change = on_change
        self.observe_latency = observe_latency
        self.tasks: dict[str, asyncio.Task] = {}

    def track(self, key: str, url: str, pid: int) -> HealthRecord:
        """Check ``url`` from now on, into a fresh record (replacing whatever ``key`` had). An answer
        from another pid than ``pid`` (a stranger on the port) counts as a failed check."""
        self.untrack(key)
        record = HealthRecord()
        self.tasks[key] = asyncio.create_task(self._watch(url, pid, record), name=f"health-{key}")
        return record

    def untrack(self, key: str) -> None:
        task = self.tasks.pop(key, None)
        if task is not None:
            task.cancel()

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        self.tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _watch(self, url: str, pid: int, record: HealthRecord) -> None:
        """Send a check every ``interval_s``, each waiting up to ``timeout_s``, so while an engine hangs its checks
        overlap and ``threshold`` of them have failed about ``timeout_s + (threshold - 1) x interval_s`` after it
        stopped answering."""
        checks: set[asyncio.Task] = set()
        try:
            while True:
                task = asyncio.create_task(self._judge(url, pid, record))
                checks.add(task)
                task.add_done_callback(checks.discard)
                await asyncio.sleep(self.interval_s)
        finally:
            for task in checks:
                task.cancel()

    async def _judge(self, url: str, pid: int, record: HealthRecord) -> None:
        """One check, ``on_change`` when the verdict may have changed; one that failed below the threshold before
        the next was due (a refused connection) is repeated at once."""
        while True:
            was_ok = record.ok
            start = time.monotonic()
            counted = await self.check(url, pid, record)
            if record.ok != was_ok or record.consecutive_failures == self.threshold:
                self.on_change()
            quick = time.monotonic() - start < self.interval_s
            if not (counted and quick and 0 < record.consecutive_failures < self.threshold):
                return

    async def check(self, url: str, pid: int, record: HealthRecord) -> bool:
        """One check of ``url`` into ``record``; whether it counted (a check overtaken by a later one's answer,
        or failed by this controller's own fault, changes no verdict)."""
        start = time.monotonic()
        ok, status, error, body = await self._ask(url, pid, start, record.ok_at)
        latency = time.monotonic() - start
        if start < record.sent_at:  # a later check has answered already: this one says nothing newer
            return False
        if ok is None:  # we could not wait on time (a starved CPU): the engine is neither judged ok nor failed
            record.latency_ms, record.error = round(latency * 1000, 3), error
            return False
        self.observe_latency(latency)
        if body is not None:
            record.body, record.body_at = body, start
        record.checked_at, record.sent_at, record.status_code, record.error = time.time(), start, status, error
        record.latency_ms, record.ok = round(latency * 1000, 3), ok
        if ok:
            record.consecutive_failures, record.failing_since, record.ever_ok, record.ok_at = 0, None, True, start
        elif record.ever_ok:  # an engine that is starting refuses checks: not a failure yet
            record.consecutive_failures += 1
            record.failing_since = record.failing_since or start
        return True

    async def _ask(
        self, url: str, pid: int, start: float, ok_at: float | None
    ) -> tuple[bool | None, int | None, str | None, dict | None]:
        """(ok, status code, error, the engine's body when it is ours to keep) of one ``GET /health/ready`` sent at
        ``start`` (the last healthy answer's sent at ``ok_at``); ok is None when the failure was this controller's own
        (starved of CPU, out of descriptors) or the engine was busy, not hung (module docstring)."""
        cpu_before = cpu_seconds(pid)
        try:
            response = await self.client.get(url + Endpoint.READY, timeout=self.timeout_s)
        except httpx.TimeoutException:
            error = f"no answer within {self.timeout_s * 1000:g} ms"
            waited = time.monotonic() - start
            if (stalled := waited - self.timeout_s) > self.timeout_s * STALL_FRACTION:
                return (
                    None,
                    None,
                    f"{error}, but this controller was itself {stalled * 1000:.0f} ms late: not counted",
                    None,
                )
            used = cpu_used(pid, cpu_before)
            if busy_not_hung(used, waited, None if ok_at is None else start - ok_at):
                return (
                    None,
                    None,
                    f"{error}, but its process ran {used * 1000:.0f} ms on the CPU meanwhile: busy, not counted",
                    None,
                )
            return False, None, error, None
        except httpx.HTTPError as exc:  # any other failure: a check that raised would end this engine's checks
            error = f"{type(exc).__name__}: {exc}"
            if is_out_of_descriptors(exc):  # our own shortage: it says nothing of the engine
                return None, None, f"{error}: this controller is out of file descriptors, not counted", None
            return False, None, error, None
        body = {}
        with contextlib.suppress(ValueError):
            body = response.json()
        if not isinstance(body, dict):  # not an engine's reply (a stranger on the port)
            body = {"pid": None}
        if body.get("pid", pid) != pid:
            return False, response.status_code, f"answered by pid {body.get('pid')}, not by ours ({pid})", None
        ok = response.status_code == 200
        return ok, response.status_code, None if ok else body.get("reason", f"status {response.status_code}"), body


class Observed(Protocol):
    alive: bool
    exit_reason: str | None
    exiting_at: float | None  # every thread seen exiting, not reaped yet (a watched primary)
    stopped_s: float | None  # seen stopped this long (a watched primary; None: running)
    health: HealthRecord
    age_s: float  # seconds since its process started
    start_timeout_s: float  # how long it may take to become ready


class Policy:
    """A judgement of one member: None when it is fine, else the reason."""

    def __call__(self, member: Observed) -> str | None:
        raise NotImplementedError

    def __or__(self, other: Policy) -> Policy:
        return first_reason(self, other)


class first_reason(Policy):  # lower case, like the tenacity combinators it imitates
    def __init__(self, *policies: Policy) -> None:
        self.policies = policies

    def __call__(self, member: Observed) -> str | None:
        return next((reason for policy in self.policies if (reason := policy(member))), None)


class process_exited(Policy):
    """Exited, or (a watched primary) every thread has begun to exit: either way it never answers again."""

    def __call__(self, member: Observed) -> str | None:
        if not member.alive:
            return member.exit_reason or "exited"
        return "is exiting (every thread has begun to exit)" if member.exiting_at is not None else None


class process_stopped(Policy):
    """A watched primary whose process has been stopped (SIGSTOP, a tracer) for ``for_s``: it answers nothing until
    it is continued, so it fails now rather than once its health checks have timed out (``timeout_ms`` and a second
    check later)."""

    def __init__(self, for_s: float) -> None:
        self.for_s = for_s

    def __call__(self, member: Observed) -> str | None:
        stopped = member.stopped_s
        if stopped is None or stopped < self.for_s:
            return None
        return f"is stopped (SIGSTOP or a tracer: its process has not run for {stopped * 1000:.0f} ms)"


class checks_failed(Policy):
    """Only once it has been healthy: a starting engine refuses connections until it is warm."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold

    def __call__(self, member: Observed) -> str | None:
        health = member.health
        if health.ever_ok and health.consecutive_failures >= self.threshold:
            return f"failed {health.consecutive_failures} health checks in a row ({health.error})"
        return None


class not_ready_within(Policy):
    """A member that has never been healthy ``start_timeout_s`` after its start."""

    def __call__(self, member: Observed) -> str | None:
        if not member.health.ever_ok and member.age_s > member.start_timeout_s:
            return f"not ready {member.start_timeout_s:g} s after it started ({member.health.error})"
        return None
