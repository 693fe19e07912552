"""The keepers of a cluster's services (its cache daemons and gateway workers): each started, and respawned
after an exit, until it serves, with backoff (each failed start told to ``controller.startfailures``, which may
end the retries); each serving one probed every SERVICE_PROBE_S in the background, and one that leaves too many
probes unanswered in a row (hung: alive, answering nothing) killed, so that it is respawned."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from hotweights.controller.cluster import Cluster, ServiceFailed, filled
from hotweights.controller.events import EventLog
from hotweights.controller.executor import BACKOFF
from hotweights.controller.metrics import ControllerMetrics
from hotweights.controller.snapshot import Snapshot
from hotweights.controller.startfailures import StartFailures
from hotweights.eventkinds import EventKind
from hotweights.state import ServiceKind
from hotweights.stats import ms

SERVICE_PROBE_S = 1.0  # how often a serving daemon or gateway must answer its probe
SERVICE_HUNG_PROBES = 5  # probes in a row it may leave unanswered before it is killed and respawned
# A gateway worker sooner: the requests it accepted wait on it, while its peers accept every new connection on
# the shared socket; a wrong kill costs only its own requests.
GATEWAY_HUNG_PROBES = 2


class ServiceKeepers:
    """One keeper per service being (re)started, one liveness probe per serving service."""

    def __init__(
        self,
        cluster: Cluster,
        events: EventLog,
        metrics: ControllerMetrics,
        wakeup: Callable[[], None],
        stopping: Callable[[], bool],
        failures: StartFailures,
    ) -> None:
        self.cluster = cluster
        self.failures = failures
        self.events = events
        self.metrics = metrics
        self.wakeup = wakeup  # the HA loop's: run a cycle now
        self.stopping = stopping  # the controller is stopping: start nothing, kill nothing
        self.liveness: dict[str, asyncio.Task] = {}  # the probe in flight (or last done) per service
        self.unanswered: dict[str, int] = {}  # probes in a row each service left unanswered

    def process(self, snap: Snapshot) -> str | None:
        """Each cycle: a serving service's liveness probed in the background; one that exited (or never
        started) respawned by a keeper; what was done, in a sentence, or None."""
        actions = []
        for view in snap.services:
            if view.serving and not view.restarting:
                self._check_liveness(view.id)
                continue
            if view.restarting or self.stopping():
                continue
            if view.pid is not None and not view.alive:
                self.events.record(EventKind.EXIT, f"{view.id} {view.exit_reason}", service=view.id, group=view.group)
                actions.append(f"{view.id} {view.exit_reason}: respawning it")
                if view.kind == ServiceKind.DAEMON:
                    self.metrics.daemon_restarts.labels(str(view.group)).inc()
            elif view.alive:
                actions.append(f"waiting for {view.id} (pid {view.pid}) to serve")
            else:
                actions.append(f"starting {view.id}")
            self.cluster.respawn(view.id, partial(self.keep, view.id))
        return "; ".join(actions) if actions else None

    def forget(self, service_id: str) -> None:
        """Stop probing a service that is being removed."""
        if task := self.liveness.pop(service_id, None):
            task.cancel()
        self.unanswered.pop(service_id, None)

    def _check_liveness(self, service_id: str) -> None:
        """Probe a serving service every SERVICE_PROBE_S in the background (a hung one is alive but
        answers nothing: new standbys could not attach, or clients would wait on the gateway)."""
        task = self.liveness.get(service_id)
        if task is None or task.done():
            self.liveness[service_id] = asyncio.create_task(self._liveness(service_id), name=f"live-{service_id}")

    async def _liveness(self, service_id: str) -> None:
        started = time.monotonic()
        if await self.cluster.probe(service_id):
            self.unanswered[service_id] = 0
        else:
            missed = self.unanswered[service_id] = self.unanswered.get(service_id, 0) + 1
            if missed >= self._hung_after(service_id) and not self.stopping():
                self.unanswered[service_id] = 0
                message = f"{service_id} answered none of {missed} probes {SERVICE_PROBE_S:g} s apart: killing it"
                self.events.record(EventKind.HUNG, message, service=service_id)
                await self.cluster.fence_service(service_id)
                self.wakeup()
                return
        await asyncio.sleep(max(0.0, SERVICE_PROBE_S - (time.monotonic() - started)))

    async def _failure(self, service_id: str, error: BaseException | None) -> str:
        """Why a start of the service failed, in one line: the gateway's port held by another process (named),
        else ``error`` (how it ended) and the last line of its log."""
        gateway = self.cluster.services[service_id].kind == ServiceKind.GATEWAY
        config = self.cluster.config.gateway
        if gateway and (held := await self.failures.port_held(config.host, config.port)):
            return held
        return self.failures.ended(str(error), self.cluster.layout.log_dir / f"{service_id}.log")

    def _hung_after(self, service_id: str) -> int:
        """Probes in a row a service may leave unanswered before it is judged hung."""
        gateway = self.cluster.services[service_id].kind == ServiceKind.GATEWAY
        return GATEWAY_HUNG_PROBES if gateway else SERVICE_HUNG_PROBES

    async def keep(self, service_id: str) -> None:
        """(Re)start a service until it serves, backing off between failed attempts."""
        start = time.monotonic()

        async def failed(state: RetryCallState) -> None:
            reason = await self._failure(service_id, state.outcome.exception() if state.outcome else None)
            delay = state.next_action.sleep if state.next_action else 0.0
            self.events.record(EventKind.START_FAILED, f"{reason}; retrying in {delay:.1f} s", service=service_id)
            self.failures.failed(service_id, reason)

        retrying = AsyncRetrying(wait=BACKOFF, retry=retry_if_exception_type(ServiceFailed), before_sleep=failed)
        async for attempt in retrying:
            with attempt:
                await self.cluster.start_service(service_id)
        self.failures.started(service_id)
        service = self.cluster.services[service_id]
        duration_ms = ms(time.monotonic() - start)
        fill = await self.cluster.fill_report(service_id) if service.kind == ServiceKind.DAEMON else {}
        spare = " (its spare, imports done)" if service.from_spare else ""
        message = f"{service_id} (pid {service.process.pid}){spare} serving after {duration_ms} ms{filled(fill)}"
        self.events.record(
            EventKind.RESPAWN if service.restarts else EventKind.START, message, service=service_id,
            group=service.group, duration_ms=duration_ms, attempts=retrying.statistics.get("attempt_number", 1),
            spare=service.from_spare,
            **({"fill_source": fill.get("source"), "fill_ms": ms(fill.get("seconds", 0.0))} if fill else {}),
        )  # fmt: skip
        self.wakeup()
