"""The controller's side of its gateway workers: the listening socket every worker inherits, and a client per
worker over the worker's own Unix socket (its health probe, the wake-up after a role change)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterable

import httpx

from hotweights.contract import GATEWAY_BACKLOG, Endpoint
from hotweights.controller.config import ClusterConfig
from hotweights.controller.stack import Layout
from hotweights.standby.serving import bind_port


class GatewayWorkers:
    """The gateway's port, held for its workers, and one client per worker (by service id)."""

    def __init__(self, config: ClusterConfig, layout: Layout, probe_timeout_s: float) -> None:
        self.config = config
        self.layout = layout
        self.probe_timeout_s = probe_timeout_s
        self.listener: socket.socket | None = None
        self.clients: dict[str, httpx.AsyncClient] = {}
        self.pushes: set[asyncio.Task] = set()  # wakes sent

    def listening(self) -> socket.socket:
        """The gateway's listening socket: bound and listening from the first worker's start until the
        controller stops, and inherited by every worker. While no worker accepts (one respawning), the
        kernel queues connections instead of refusing them. SO_REUSEPORT lets a restarted controller bind
        beside the workers an earlier one started (they keep its socket). Raises PortUnavailable."""
        if self.listener is None:
            gateway = self.config.gateway
            sock = bind_port(gateway.host, gateway.port, reuse_port=True)
            sock.listen(GATEWAY_BACKLOG)
            self.listener = sock
        return self.listener

    def wake(self, worker_ids: Iterable[str]) -> None:
        """Tell each serving worker to probe the engines now (a role just changed), in the background; a
        worker that misses it finds out at its next probe anyway."""
        for worker_id in worker_ids:
            task = asyncio.create_task(self._wake(worker_id), name=f"wake-{worker_id}")
            self.pushes.add(task)
            task.add_done_callback(self.pushes.discard)

    async def _wake(self, worker_id: str) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.client(worker_id).post(Endpoint.GATEWAY_WAKE, timeout=self.probe_timeout_s)

    async def answers(self, worker_id: str) -> bool:
        """Whether the worker answers its health page on its own socket, not the shared port (any worker
        answers there): an HTTP answer, not a connect, since the kernel accepts connections for a stopped
        process too."""
        try:
            response = await self.client(worker_id).get(Endpoint.GATEWAY_HEALTH, timeout=self.probe_timeout_s)
            return response.status_code == 200
        except httpx.HTTPError:
            return False

    def client(self, worker_id: str) -> httpx.AsyncClient:
        """The client for one worker, over its own Unix socket: made once (making one costs tens of ms of
        CPU, on the event loop), with no pooled connection (a respawned worker is a new socket)."""
        client = self.clients.get(worker_id)
        if client is None:
            path = str(self.layout.gateway_probe_socket(worker_id))
            transport = httpx.AsyncHTTPTransport(uds=path, limits=httpx.Limits(max_keepalive_connections=0))
            token = self.config.token()
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            client = httpx.AsyncClient(transport=transport, base_url="http://gateway", headers=headers, trust_env=False)
            self.clients[worker_id] = client
        return client

    async def close(self) -> None:
        """Our copy of the listening socket and every client: workers that still run keep serving on theirs."""
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        for client in self.clients.values():
            await client.aclose()
        self.clients.clear()
