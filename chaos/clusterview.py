"""The drill's view of a cluster: the controller's REST API, the load balancer's metrics, who to hurt.

Only documented interfaces are used (``GET /cluster``, ``GET /events``, ``POST /switchover``, the
gateway's ``/metrics``), so the drill judges the controller from the outside, as an operator would.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx

from hotweights.chaos.faults import Target
from hotweights.contract import Role, State


@dataclass(frozen=True)
class ClusterView:
    """One ``GET /cluster`` answer."""

    members: list[dict[str, Any]]
    services: list[dict[str, Any]]
    spares: list[dict[str, Any]] = field(default_factory=list)
    batch: list[dict[str, Any]] = field(default_factory=list)  # co-located batch engines
    daemon_spares: list[dict[str, Any]] = field(default_factory=list)

    def primaries(self) -> list[dict[str, Any]]:
        return [m for m in self.members if m["role"] == Role.PRIMARY and m["pid"] is not None]

    def ready_standbys(self) -> list[dict[str, Any]]:
        return [
            m
            for m in self.members
            if m["role"] == Role.STANDBY and m["state"] == State.READY and m["status"] == "healthy"
        ]

    def incomplete(self) -> str | None:
        """None when every group has one healthy primary, every other engine is a ready standby, every spare
        (engine or daemon) the controller wants is ready, every batch engine and daemon and the gateway serve;
        else what is still missing."""
        missing = []
        for group in sorted({m["group"] for m in self.members}):
            members = [m for m in self.members if m["group"] == group]
            healthy = [m for m in members if m["status"] == "healthy" and m["state"] == State.READY]
            primaries = [m for m in healthy if m["role"] == Role.PRIMARY]
            if len(primaries) != 1 or len(healthy) != len(members):
                states = ", ".join(f"{m['id']} {m['role']} {m['status']}" for m in members)
                missing.append(f"group {group}: {states}")
        missing += [f"{s['id']} not serving" for s in self.services if not (s["alive"] and s["serving"])]
        missing += [f"a spare engine of group {s['group']} not ready" for s in self.spares if not s["ready"]]
        missing += [f"the spare daemon for {s['service']} not ready" for s in self.daemon_spares if not s["ready"]]
        missing += [f"batch engine {b['id']} not serving ({b['reason']})" for b in self.batch if not b["serving"]]
        return "; ".join(missing) or None

    def target(self, name: str) -> Target | None:
        """The live process of a member or service, with its identity taken now."""
        for entry in self.members + self.services:
            if entry["id"] == name and entry["pid"]:
                return Target.of(name, entry["pid"])
        return None

    def engine_pids(self) -> dict[str, int | None]:
        return {m["id"]: m["pid"] for m in self.members}

    def service(self, kind: str) -> dict[str, Any] | None:
        return next((s for s in self.services if s["kind"] == kind), None)


EVENT_TIME_RESOLUTION_S = 0.001  # an event's ISO time carries milliseconds, truncated (``controller.events``)


def event_time(event: dict[str, Any]) -> float:
    """When ``event`` was recorded, to EVENT_TIME_RESOLUTION_S: up to that much before the true instant."""
    return datetime.fromisoformat(event["time"]).timestamp()


def since_ms(earlier: float, event_at: float) -> float:
    """Milliseconds from ``earlier`` (a precise ``time.time()``) to an ``event_time`` recorded after it: an event of
    the same millisecond reads up to EVENT_TIME_RESOLUTION_S before it, which is 0, not a negative duration."""
    elapsed = event_at - earlier
    return 0.0 if -EVENT_TIME_RESOLUTION_S <= elapsed < 0 else elapsed * 1000


class ControlApi:
    def __init__(self, url: str, token: str | None, timeout_s: float = 2.0) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.client = httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout_s)

    async def cluster(self) -> ClusterView | None:
        """None while the controller does not answer (killed, restarting)."""
        try:
            response = await self.client.get("/cluster")
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        body = response.json()
        return ClusterView(body["members"], body["services"], body["spares"], body["batch"], body["daemon_spares"])

    async def events(self, since: float) -> list[dict[str, Any]]:
        """Events recorded at or after ``since`` (time.time()); [] while the controller does not answer."""
        try:
            response = await self.client.get("/events", params={"limit": 1000})
            events = response.json()["events"] if response.status_code == 200 else []
        except (httpx.HTTPError, ValueError, KeyError):
            return []
        return [e for e in events if event_time(e) >= since - EVENT_TIME_RESOLUTION_S]

    async def post(self, path: str, timeout_s: float, body: dict[str, Any] | None = None) -> httpx.Response:
        """POST ``path`` (a planned operation: a switchover, a rollout), with ``body`` (default empty)."""
        return await self.client.post(path, json=body or {}, timeout=timeout_s)

    async def wait_complete(self, timeout_s: float) -> str | None:
        """Poll until the cluster is whole again; None when it is, else the last thing that was missing."""
        deadline = time.monotonic() + timeout_s
        missing = "the controller does not answer"
        while time.monotonic() < deadline:
            view = await self.cluster()
            missing = "the controller does not answer" if view is None else view.incomplete()
            if missing is None:
                return None
            await asyncio.sleep(0.05)
        return missing

    async def aclose(self) -> None:
        await self.client.aclose()


async def lb_retries(client: httpx.AsyncClient, lb_url: str) -> float | None:
    """The gateway's count of requests it re-sent after an upstream failed; None for another LB."""
    try:
        response = await client.get(f"{lb_url}/metrics", timeout=2.0)
    except httpx.HTTPError:
        return None
    for line in response.text.splitlines():
        if line.startswith("hotweights_gateway_retries_total "):
            return float(line.split()[1])
    return None
