"""Co-located batch engines (``[[groups]] batch_port``): low-priority work on an online group's device and arena.

A group's batch engine (``g<N>-batch``) is a reference engine on a port of its own, for its own clients, that
maps the group's current weight generation as the group's engines do. It is none of the group's members: the
gateway, HAProxy's configuration and failover never route online traffic to it or promote it.

It serves while its group is settled: a serving primary, every other slot a ready standby, the daemons serving,
no rollout queued, no spare engine still attaching and warming up. Before the group starts an engine (a
replacement after a fence, a rollout's restart, an added engine) and before a switchover (whose new primary
allocates a KV cache while the old one still holds its own), it yields: a demote that drains it for at most
``batch_yield_timeout_s``, cancels what still runs (503, or an SSE error event) and releases its KV cache; one
that does not answer in time is killed. A failover needs no yield: the fenced primary's KV cache goes before the
promoted standby allocates its own. While it is away, it answers 503 with ``Retry-After`` (a standby's refusal).
Once the group is settled again, and the device has the bytes of its last KV cache free, a promote brings it
back: ``back_ms`` runs from the moment the group settled to the promote's answer.

What a batch engine keeps while it yields: its process (imports, attach, warm-up: a return takes a promote,
not a start) and its CUDA context. It runs without CUDA graphs, which would keep its KV cache reserved.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hotweights.contract import Endpoint, Role
from hotweights.controller.config import EngineSpec
from hotweights.controller.devices import free_bytes
from hotweights.controller.engineapi import EngineApi, EngineUnreachable
from hotweights.controller.events import EventLog
from hotweights.controller.supervisor import Process, Supervisor, evict_orphans
from hotweights.eventkinds import EventKind
from hotweights.stats import ms

log = logging.getLogger(__name__)

RETRY_S = 10.0  # after a batch engine exited before it served, before it is started again
RETURN_RETRY_S = 1.0  # after a return that found too little memory free, or whose promote failed
READY_POLL_S = 0.05  # how often a starting batch engine's /standby is asked
YIELD_MARGIN_S = 5.0  # beyond the drain: a demote not answered by then is a hung engine, killed


@dataclass
class BatchEngine:
    spec: EngineSpec
    start_timeout_s: float
    yield_timeout_s: float
    process: Process | None = None
    generation: int = 0  # the weight generation its process maps
    serving: bool = False  # promoted by us, and not yielded since
    role_unknown: bool = False  # adopted from a previous controller: a yield demotes it, a return promotes it
    away: bool = False  # yielded, not back yet
    task: asyncio.Task | None = None  # its start or return in progress
    settled_at: float | None = None  # time.monotonic() its group was first seen settled, since it last was not
    failed_at: float = -RETRY_S  # time.monotonic() of its last exit before serving
    next_return_at: float = 0.0  # time.monotonic() before which no return is tried (one just failed)
    kv_cache_bytes: int = 0  # its last promote's: the device memory a return needs free
    yields: int = 0
    back_ms: float | None = None  # its last return after a yield
    reason: str = "not started yet"  # why it does not serve now

    def to_json(self) -> dict[str, Any]:
        alive = bool(self.process and self.process.alive)
        return {
            "id": self.spec.id,
            "group": self.spec.group,
            "url": self.spec.url,
            "pid": self.process.pid if alive and self.process else None,
            "generation": self.generation,
            "serving": self.serving and alive,
            "reason": None if self.serving and alive else self.reason,
            "yields": self.yields,
            "back_ms": self.back_ms,
            "kv_cache_bytes": self.kv_cache_bytes,
        }


class BatchEngines:
    """The batch engine of each group that has one. ``tend`` runs on the HA loop and never waits; ``make_room``
    is awaited by the action that needs the memory."""

    def __init__(
        self,
        supervisor: Supervisor,
        engines: EngineApi,
        events: EventLog,
        command: Callable[[EngineSpec], list[str]],
        environment: Callable[[int], dict[str, str] | None],
        generation: Callable[[int], int],
        record: Callable[[], None],
    ) -> None:
        self.supervisor = supervisor
        self.engines = engines
        self.events = events
        self.command = command  # the batch engine's command line for its group's current generation
        self.environment = environment
        self.generation = generation  # a group's current weight generation: what a batch engine started now maps
        self.record = record  # writes state.json: each process started is recorded, so a new controller adopts it
        self.batches: dict[int, BatchEngine] = {}

    def add(self, spec: EngineSpec, start_timeout_s: float, yield_timeout_s: float) -> None:
        self.batches[spec.group] = BatchEngine(spec, start_timeout_s, yield_timeout_s)

    def adopt(self, group: int, process: Process, generation: int) -> None:
        """A batch engine a previous controller started, in a role we do not know: the next return promotes it,
        a yield before that demotes it (both idempotent)."""
        batch = self.batches[group]
        batch.process, batch.generation, batch.role_unknown = process, generation, True
        batch.reason = "adopted from the previous controller"

    def processes(self) -> dict[str, Process | None]:
        return {batch.spec.id: batch.process for batch in self.batches.values()}

    def tend(self, group: int, settled: bool) -> None:
        """Start, restart (on the group's current generation and settings) or bring back the group's batch engine
        while the group is ``settled``; note when it is not."""
        batch = self.batches.get(group)
        if batch is None or (batch.task is not None and not batch.task.done()):
            return
        if batch.task is not None and not batch.task.cancelled() and (error := batch.task.exception()):
            log.error("batch engine %s: %s", batch.spec.id, error, exc_info=error)
            batch.reason, batch.failed_at = f"its last start or return failed: {error}", time.monotonic()
        batch.task = None
        if not settled:
            batch.settled_at = None
            return
        now = time.monotonic()
        batch.settled_at = batch.settled_at or now
        if batch.process is None or not batch.process.alive:
            if batch.process is not None:
                self._exited(batch)
            if now - batch.failed_at >= RETRY_S:
                batch.task = asyncio.create_task(self._start(batch), name=f"start-{batch.spec.id}")
        elif batch.process.identity.command != tuple(self.command(batch.spec)):
            batch.task = asyncio.create_task(self._replace(batch), name=f"replace-{batch.spec.id}")
        elif not batch.serving and now >= batch.next_return_at:
            batch.task = asyncio.create_task(self._return(batch), name=f"return-{batch.spec.id}")

    def _exited(self, batch: BatchEngine) -> None:
        assert batch.process is not None
        message = f"batch engine {batch.spec.id} (pid {batch.process.pid}) {batch.process.exit_reason}"
        if not batch.serving:
            batch.failed_at = time.monotonic()
            message += f" before it served; starting it again in {RETRY_S:g} s"
        self.events.record(EventKind.BATCH_EXIT, message, member=batch.spec.id, group=batch.spec.group)
        batch.process, batch.serving, batch.reason = None, False, message

    async def _start(self, batch: BatchEngine) -> None:
        """Spawn it as a standby, wait until it is ready, then bring it in."""
        for message in await asyncio.to_thread(evict_orphans, batch.spec.port, batch.spec.id):
            log.warning("%s", message)
        started = time.monotonic()
        batch.process = self.supervisor.spawn(
            batch.spec.id, self.command(batch.spec), self.environment(batch.spec.group)
        )
        batch.generation, batch.reason = self.generation(batch.spec.group), "starting"
        self.record()
        while not await self.engines.is_standby(batch.spec.url):
            if not batch.process.alive:
                return  # the next tend records the exit
            if time.monotonic() - started > batch.start_timeout_s:
                await self.supervisor.fence(batch.process)
                batch.reason = f"not ready {batch.start_timeout_s:g} s after its start: killed"
                return
            await asyncio.sleep(READY_POLL_S)
        await self._return(batch)

    async def _replace(self, batch: BatchEngine) -> None:
        """Its command is no longer what its group runs (a model update's generation, a rollout's settings):
        stop it (its requests get its yield timeout) and start it again."""
        assert batch.process is not None
        how = await self.supervisor.stop(batch.process, batch.yield_timeout_s)
        message = f"batch engine {batch.spec.id} (pid {batch.process.pid}) {how}: its group's engines changed"
        self.events.record(EventKind.BATCH_RESTART, message, member=batch.spec.id, group=batch.spec.group)
        batch.serving, batch.role_unknown = False, False
        await self._start(batch)

    async def _return(self, batch: BatchEngine) -> None:
        """Promote it once the device has its last KV cache's bytes free; record how long it was away."""
        batch.next_return_at = time.monotonic() + RETURN_RETRY_S  # unless it succeeds
        if batch.kv_cache_bytes:
            free = await asyncio.to_thread(free_bytes, batch.spec.device)
            if free is not None and free < batch.kv_cache_bytes:
                batch.reason = f"waiting for {batch.kv_cache_bytes} bytes free on {batch.spec.device} ({free} free)"
                return
        sent = time.monotonic()
        try:
            status, body = await self.engines.post(batch.spec.url, Endpoint.PROMOTE)
        except EngineUnreachable as exc:
            batch.reason = f"promote failed: {exc}"
            return
        if status != 200:
            batch.reason = f"promote refused ({status}): {body.get('message')}"
            return
        batch.next_return_at = 0.0
        batch.kv_cache_bytes = int(body.get("kv_cache_bytes") or batch.kv_cache_bytes)
        returned = batch.away and batch.settled_at is not None
        if returned:
            assert batch.settled_at is not None
            batch.back_ms = ms(time.monotonic() - batch.settled_at)
        batch.serving, batch.role_unknown, batch.away, batch.reason = True, False, False, ""
        what = f"back {batch.back_ms} ms after its group settled" if returned else "serving"
        self.events.record(
            EventKind.BATCH_RETURN, f"batch engine {batch.spec.id} {what}: {body.get('message')}", member=batch.spec.id,
            group=batch.spec.group, back_ms=batch.back_ms if returned else None,
            promote_ms=ms(time.monotonic() - sent),
        )  # fmt: skip

    async def make_room(self, group: int, why: str) -> str:
        """Make the group's batch engine give its KV cache back before ``why`` (an engine start, a switchover):
        its start or return in progress is stopped, then a demote drains it for at most its yield timeout; one
        that does not answer is killed. What was done ("" when there was nothing to yield)."""
        batch = self.batches.get(group)
        if batch is None:
            return ""
        batch.settled_at = None
        interrupted = batch.task is not None and not batch.task.done()
        if interrupted and batch.task is not None:
            batch.task.cancel()
            await asyncio.gather(batch.task, return_exceptions=True)
        if batch.process is None or not batch.process.alive or not (batch.serving or batch.role_unknown or interrupted):
            return ""
        start = time.monotonic()
        body = {"timeout_s": batch.yield_timeout_s}
        try:
            status, reply = await self.engines.post(
                batch.spec.url, Endpoint.DEMOTE, body, timeout=batch.yield_timeout_s + YIELD_MARGIN_S
            )
            done = status == 200 and reply.get("role") == Role.STANDBY
            how = str(reply.get("message"))
        except EngineUnreachable as exc:
            done, how = False, str(exc)
        if not done and await self.supervisor.fence(batch.process):
            batch.process = None  # killed on purpose (not a failed start): it starts again once the group settles
            how = f"killed: its demote did not succeed ({how})"
        elif not done:
            how = f"still alive after SIGKILL: its demote did not succeed ({how})"
        batch.serving, batch.role_unknown, batch.away, batch.yields = False, False, True, batch.yields + 1
        batch.reason = f"yielded for {why}"
        sentence = f"batch engine {batch.spec.id} yielded for {why} in {ms(time.monotonic() - start)} ms: {how}"
        self.events.record(
            EventKind.BATCH_YIELD, sentence, member=batch.spec.id, group=group, yield_ms=ms(time.monotonic() - start)
        )
        return sentence

    def describe(self) -> list[dict[str, Any]]:
        return [batch.to_json() for batch in self.batches.values()]

    async def stop_all(self, timeout: float) -> list[str]:
        """Stop every batch engine (its clients' requests get ``timeout`` to finish)."""
        await self._cancel_tasks()
        live = [batch for batch in self.batches.values() if batch.process and batch.process.alive]
        results = await asyncio.gather(*(self.supervisor.stop(b.process, timeout) for b in live if b.process))
        return [f"{batch.spec.id}: {how}" for batch, how in zip(live, results, strict=True)]

    async def _cancel_tasks(self) -> None:
        tasks = [batch.task for batch in self.batches.values() if batch.task and not batch.task.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def release(self) -> None:
        """Leave every batch engine running, unwatched (a controller that leaves the data path up)."""
        await self._cancel_tasks()
        for batch in self.batches.values():
            if batch.process is not None:
                self.supervisor.forget(batch.process)
