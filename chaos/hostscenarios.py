"""The faults of several hosts (``hotweights drill --hosts N --dcs etcd``), one class each, and the drill's
registry of every scenario (one host's, from ``scenarios`` and ``grayscenarios``, and these).

Each acts on the host of the primary, as the merged view of every host's controller shows it, then waits in
``settle`` until an engine of another host answers ``/primary`` 200 (etcd-restart: until any does), and only
then undoes what it can (a host or controller started again, a partition healed), so that the drill measures
the takeover itself and then waits for the cluster to be whole again. A round with no takeover within
``TAKEOVER_WAIT_S`` fails. On a stack of one host they are skipped with the reason.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, ClassVar

import httpx

from hotweights.chaos.grayscenarios import GRAY_SCENARIOS
from hotweights.chaos.hosts import HostsStack, SimulatedHost
from hotweights.chaos.scenarios import SCENARIOS as ONE_HOST_SCENARIOS
from hotweights.chaos.scenarios import KillPrimary, Round, Scenario
from hotweights.contract import Endpoint

if TYPE_CHECKING:
    from hotweights.chaos.clusterview import ClusterView

TAKEOVER_WAIT_S = 30.0  # far above a TTL: a takeover that takes this long is broken


class HostScenario(Scenario):
    fault: ClassVar[str]  # what the sentence of a missed takeover calls the fault
    host: SimulatedHost | None = None  # the host this round hurt

    def skip_reason(self, stack: object) -> str | None:
        return None if isinstance(stack, HostsStack) else "needs several hosts: hotweights drill --hosts N --dcs etcd"

    def primary_host(self, r: Round) -> SimulatedHost:
        primaries = r.view.primaries()
        if not primaries:
            raise RuntimeError("no primary in the hosts' GET /cluster")
        target = r.view.target(primaries[0]["id"])
        if target is not None:
            r.targets.append(target)
        self.host = stack_of(r).host(primaries[0]["id"])
        r.fault_at = time.time()
        return self.host

    async def await_takeover(self, r: Round) -> None:
        """Until an engine of another host serves as primary; the round's problem if none does in time."""
        assert self.host is not None
        others = [url for host in stack_of(r).hosts if host is not self.host for url in host.urls]
        if not await any_primary(others, TAKEOVER_WAIT_S):
            r.problem = f"no engine of another host became primary within {TAKEOVER_WAIT_S:g} s of the {self.fault}"

    def start_again(self) -> None:
        """Start the hurt host's controller again unless it runs (it starts or adopts the rest)."""
        if self.host is not None and self.host.controller is not None and self.host.controller.poll() is not None:
            self.host.start()


def stack_of(r: Round) -> HostsStack:
    assert isinstance(r.stack, HostsStack)
    return r.stack


async def any_primary(urls: list[str], timeout_s: float) -> bool:
    """Whether one of ``urls`` answers ``/primary`` 200 within ``timeout_s`` (each asked every 20 ms)."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=0.5, trust_env=False) as client:
        while time.monotonic() < deadline:
            for url in urls:
                try:
                    if (await client.get(url + Endpoint.PRIMARY)).status_code == 200:
                        return True
                except httpx.HTTPError:
                    pass
            await asyncio.sleep(0.02)
    return False


class KillHost(HostScenario):
    name = "kill-host"
    measures = (
        "SIGKILL every process of the primary's host: its leader key expires with its lease (TTL), another host "
        "takes over"
    )
    fault = "host's loss"

    async def inject(self, r: Round) -> None:
        await asyncio.to_thread(self.primary_host(r).kill)

    async def settle(self, r: Round) -> None:
        await self.await_takeover(r)
        self.start_again()

    async def cleanup(self, r: Round) -> None:
        self.start_again()


class ControllerLoss(HostScenario):
    name = "controller-loss"
    measures = (
        "SIGKILL the primary host's controller only: its primary serves until its lease runs out, another host "
        "takes over; the restarted controller adopts the engines still running"
    )
    fault = "controller's loss"

    async def inject(self, r: Round) -> None:
        controller = self.primary_host(r).controller
        assert controller is not None
        controller.kill()
        await asyncio.to_thread(controller.wait, 10)

    async def settle(self, r: Round) -> None:
        await self.await_takeover(r)
        self.start_again()

    async def cleanup(self, r: Round) -> None:
        self.start_again()

    def verify(self, r: Round, after: ClusterView) -> str | None:
        assert self.host is not None
        mine = f"{self.host.name}/"
        before = {k: v for k, v in r.view.engine_pids().items() if k.startswith(mine)}
        now = {k: v for k, v in after.engine_pids().items() if k.startswith(mine)}
        return None if before == now else f"engines were restarted instead of adopted: {before} -> {now}"


class PartitionHost(HostScenario):
    name = "partition-host"
    measures = (
        "cut the primary's host from etcd and from its peers (fault proxies): its primary stops serving by its "
        "lease, another host takes over when the key expires (bounded by the TTL); healed after the takeover"
    )
    fault = "partition"

    async def inject(self, r: Round) -> None:
        stack_of(r).partition(self.primary_host(r), cut=True)

    async def settle(self, r: Round) -> None:
        await self.await_takeover(r)
        await self.cleanup(r)

    async def cleanup(self, r: Round) -> None:
        if self.host is not None:
            stack_of(r).partition(self.host, cut=False)


class EtcdRestart(HostScenario):
    name = "etcd-restart"
    measures = (
        "SIGKILL etcd and start it again with its data: primaries whose lease outlives the outage keep serving, "
        "others demote themselves and the group re-elects"
    )

    async def inject(self, r: Round) -> None:
        r.fault_at = time.time()
        await asyncio.to_thread(stack_of(r).restart_etcd)

    async def settle(self, r: Round) -> None:
        urls = [url for host in stack_of(r).hosts for url in host.urls]
        if not await any_primary(urls, TAKEOVER_WAIT_S):
            r.problem = f"no engine became primary within {TAKEOVER_WAIT_S:g} s of etcd's restart"


HOST_SCENARIOS: dict[str, type[Scenario]] = {
    cls.name: cls for cls in (KillHost, PartitionHost, EtcdRestart, ControllerLoss)
}
# The default rounds of a drill on several hosts: these, and a primary engine's crash (cross-host failover).
HOST_DEFAULT = [*HOST_SCENARIOS, KillPrimary.name]
SCENARIOS: dict[str, type[Scenario]] = ONE_HOST_SCENARIOS | GRAY_SCENARIOS | HOST_SCENARIOS  # every scenario
