"""Leader keys in etcd (``[dcs]``): who may promote in each failover group, across hosts (Patroni's DCS).

Keys, under ``<prefix>/<cluster>/``:

- ``cluster``: ``{"cluster": <name>}``, written once; a prefix whose marker names another cluster (or is not
  ours at all) is refused at start-up, so two clusters never share leader keys.
- ``leader/<group>``: ``{"cluster", "group", "host", "member", "url"}``, attached to the writing controller's
  lease (``ttl_s``). Its mod revision is the fencing token passed with ``/promote`` and ``/lease``.

Contract (``EtcdLeadership``):

- ``claim`` is the only way to a promotion: one transaction that creates the key if absent, or rewrites it if
  its mod revision is still the one we wrote; it returns the promote body (token, lease) or the reason not
  to promote. A key held by another host, a key in doubt (unparseable, another cluster's) or etcd out of
  reach all refuse: no promotion on doubt.
- Every ``loop_wait_s`` the controller keeps its lease alive, re-reads the leader keys and renews each of
  its primaries' lease (``/lease``) for the time its etcd lease is certainly still valid, less one
  ``retry_timeout_s`` for delivery. A controller that cannot reach etcd renews nothing: its primaries demote
  themselves at most ``ttl_s - retry_timeout_s`` after its last successful keepalive, before the key expires
  and another host may win it.
- A controller restarted on the same host (``dcs.host``) re-takes the keys that name it and one of its
  engines while their lease lives: same lease, same fencing token, no re-election.
- A watch on the leader keys re-reads them and wakes the HA loop at once when any changes (a key deleted or
  expired: another host may take over without waiting a loop).

``Solo`` is the single-host policy: it never refuses and sends no token, so without ``[dcs]`` a promote is
exactly what it was. etcd is spoken to through its v3 JSON gateway (``/v3/...``, etcd 3.4+) with httpx.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from hotweights.contract import Endpoint
from hotweights.controller.config import ClusterConfig, DcsSection
from hotweights.controller.engineapi import EngineApi, EngineUnreachable
from hotweights.controller.seedplacement import SeedPlacement
from hotweights.errors import ConfigError

if TYPE_CHECKING:
    from hotweights.controller.stack import Layout

log = logging.getLogger(__name__)


class DcsError(Exception):
    """etcd did not answer (every endpoint), or answered with an error."""


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _unb64(text: str) -> str:
    return base64.b64decode(text).decode(errors="replace")


def _prefix_end(prefix: str) -> str:
    """The end of the key range that holds every key starting with ``prefix`` (etcd's ``range_end``)."""
    return prefix[:-1] + chr(ord(prefix[-1]) + 1)


class Etcd:
    """The etcd v3 JSON gateway: each call goes to the endpoint that answered last, then the others, all
    within one ``timeout_s``. Raises DcsError."""

    def __init__(self, urls: tuple[str, ...], timeout_s: float, client: httpx.AsyncClient) -> None:
        self.urls = [url.rstrip("/") for url in urls]
        self.timeout_s = timeout_s
        self.client = client

    async def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout_s
        errors = []
        for url in list(self.urls):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                response = await self.client.post(url + path, json=body, timeout=remaining)
                reply = response.json()
            except (httpx.HTTPError, ValueError) as exc:
                errors.append(f"{url}: {type(exc).__name__} {exc}".strip())
                continue
            if response.status_code != 200:
                raise DcsError(f"{url}{path} answered {response.status_code}: {reply.get('error', reply)}")
            self.urls.remove(url)
            self.urls.insert(0, url)  # sticky: the next call starts here
            return reply
        raise DcsError(f"etcd did not answer within {self.timeout_s:g} s ({'; '.join(errors) or 'no time left'})")

    async def grant(self, ttl_s: int) -> int:
        return int((await self.call("/v3/lease/grant", {"TTL": ttl_s}))["ID"])

    async def keepalive(self, lease: int) -> int:
        """The lease's TTL after this renewal; 0 when it has expired (or never existed)."""
        reply = await self.call("/v3/lease/keepalive", {"ID": lease})
        return int(reply.get("result", {}).get("TTL", 0))

    async def revoke(self, lease: int) -> None:
        await self.call("/v3/lease/revoke", {"ID": lease})

    async def get(self, key: str) -> dict[str, Any] | None:
        kvs = (await self.call("/v3/kv/range", {"key": _b64(key)})).get("kvs", [])
        return kvs[0] if kvs else None

    async def range_prefix(self, prefix: str) -> list[dict[str, Any]]:
        return (await self.call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))})).get(
            "kvs", []
        )

    async def put(self, key: str, value: str, lease: int) -> None:
        await self.call("/v3/kv/put", {"key": _b64(key), "value": _b64(value), "lease": lease})

    async def put_if(self, key: str, value: str, *, create_revision: int | None = None, mod_revision: int | None = None,
                     lease: int = 0) -> tuple[bool, int, dict[str, Any] | None]:  # fmt: skip
        """Put ``value`` at ``key`` if its create revision (0: absent) or its mod revision is as given; one
        transaction. Returns (done, the put's revision, the key as it is when not done)."""
        target, field, expected = ("CREATE", "create_revision", create_revision)
        if mod_revision is not None:
            target, field, expected = ("MOD", "mod_revision", mod_revision)
        body = {
            "compare": [{"key": _b64(key), "target": target, "result": "EQUAL", field: expected}],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value), "lease": lease}}],
            "failure": [{"request_range": {"key": _b64(key)}}],
        }
        reply = await self.call("/v3/kv/txn", body)
        if reply.get("succeeded"):
            return True, int(reply["header"]["revision"]), None
        kvs = reply["responses"][0]["response_range"].get("kvs", [])
        return False, 0, kvs[0] if kvs else None

    async def delete_if(self, key: str, mod_revision: int) -> bool:
        body = {
            "compare": [{"key": _b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": mod_revision}],
            "success": [{"request_delete_range": {"key": _b64(key)}}],
        }
        return bool((await self.call("/v3/kv/txn", body)).get("succeeded"))

    async def watch(self, prefix: str) -> AsyncIterator[None]:
        """Yields once the watch is created, then once per batch of changes under ``prefix``; reconnects
        (each time yielding again: changes may have been missed) until cancelled."""
        request = {"create_request": {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}}
        while True:
            for url in list(self.urls):
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    timeout = httpx.Timeout(None, connect=self.timeout_s)
                    async with self.client.stream("POST", url + "/v3/watch", json=request, timeout=timeout) as reply:
                        async for line in reply.aiter_lines():
                            result = json.loads(line).get("result", {}) if line.strip() else {}
                            if result.get("created") or result.get("events"):
                                yield
            await asyncio.sleep(self.timeout_s)


@dataclass(frozen=True)
class Leader:
    """A group's leader key as read: who holds it, and its revisions."""

    group: int
    host: str
    member: str
    url: str
    revision: int  # mod revision: the fencing token of the last promotion through it
    lease: int

    def describe(self) -> str:
        return f"host {self.host} ({self.member} at {self.url}, fencing token {self.revision})"

    def to_json(self) -> dict[str, Any]:
        return {"host": self.host, "member": self.member, "url": self.url, "fencing_token": self.revision}


class Keys:
    """Where a cluster's keys live, and how a leader key is read (a Leader, or why it is in doubt)."""

    def __init__(self, prefix: str, cluster: str) -> None:
        self.root = f"{prefix}/{cluster}/"
        self.cluster = cluster
        self.marker = self.root + "cluster"
        self.leaders = self.root + "leader/"

    def leader(self, group: int) -> str:
        return f"{self.leaders}{group}"

    def value(self, group: int, host: str, member: str, url: str) -> str:
        return json.dumps({"cluster": self.cluster, "group": group, "host": host, "member": member, "url": url})

    def parse(self, kv: dict[str, Any]) -> Leader | str:
        """The leader in ``kv``, or a sentence saying why the key is in doubt (never promote on doubt)."""
        key, raw = _unb64(kv.get("key", "")), _unb64(kv.get("value", ""))
        try:
            value = json.loads(raw)
            fields = (value["cluster"], value["group"], value["host"], value["member"], value["url"])
        except (ValueError, KeyError, TypeError):
            return f"leader key {key} holds {raw[:80]!r}, not a leader record of ours: delete it or fix dcs.prefix"
        if fields[0] != self.cluster or str(fields[1]) != key.rsplit("/", 1)[-1]:
            return f"leader key {key} was written by cluster {fields[0]!r} (group {fields[1]}), not {self.cluster!r}"
        return Leader(int(fields[1]), str(fields[2]), str(fields[3]), str(fields[4]), int(kv["mod_revision"]),
                      int(kv.get("lease", 0)))  # fmt: skip

    def group_of(self, kv: dict[str, Any]) -> int | None:
        suffix = _unb64(kv.get("key", "")).removeprefix(self.leaders)
        return int(suffix) if suffix.isdigit() else None


class Solo:
    """Single-host mode: this controller alone decides; promotes carry no token."""

    async def start(self, wake: Callable[[], None]) -> None:
        """Nothing to connect to."""

    async def stop(self, revoke: bool) -> None:
        """Nothing to release."""

    def refusal(self, group: int) -> str | None:
        return None

    async def claim(self, group: int, member: str, url: str) -> tuple[dict[str, Any] | None, str | None]:
        return None, None

    async def release(self, group: int) -> None:
        """Nothing held."""

    def describe(self) -> dict[str, Any]:
        return {"mode": "single-host"}


@dataclass
class Held:
    token: int
    member: str
    url: str


class EtcdLeadership(Solo):
    """Multi-host mode: this controller promotes in a group only while it holds the group's leader key."""

    def __init__(
        self, config: ClusterConfig, client: httpx.AsyncClient, engines: EngineApi, layout: Layout | None = None
    ) -> None:
        dcs: DcsSection = config.dcs
        self.config, self.dcs, self.source = config, dcs, config.source
        self.host = dcs.host_name
        self.keys = Keys(dcs.prefix, config.cluster.name)
        self.etcd = Etcd(dcs.etcd, dcs.retry_timeout_s, client)
        self.engines = engines
        self.lease: int | None = None
        self.valid_until = 0.0  # time.monotonic() before which our lease certainly lives
        self.error: str | None = "not connected yet"  # why etcd is out of reach; None: it answered last time
        self.leaders: dict[int, Leader | str] = {}  # per group, as last read: the leader, or the doubt
        self.held: dict[int, Held] = {}  # groups whose leader key we hold
        self.changed = asyncio.Event()  # the watch saw a change: refresh now
        self.lock = asyncio.Lock()  # one refresh or claim at a time (one lease, one view)
        self.wake: Callable[[], None] = lambda: None
        self.tasks: list[asyncio.Task] = []
        self.seeding = SeedPlacement(layout, self.host, self.keys.root) if layout and config.seeding.enabled else None

    # --- start and stop -----------------------------------------------------------------------

    async def start(self, wake: Callable[[], None]) -> None:
        """Check the cluster marker (ConfigError: etcd out of reach, or the prefix is another cluster's),
        take a lease, read the keys, then keep them in the background; ``wake`` wakes the HA loop."""
        self.wake = wake
        try:
            await self._check_marker()
            await self._retake()
            await self.refresh()
            await self._seed()  # the daemons about to start find their peers listed
        except DcsError as exc:
            raise ConfigError(f"{self.source}: dcs.etcd {list(self.dcs.etcd)}: {exc}; is etcd running?") from None
        self.tasks = [
            asyncio.create_task(self._keep(), name="dcs-keep"),
            asyncio.create_task(self._watch(), name="dcs-watch"),
        ]

    async def _check_marker(self) -> None:
        mine = json.dumps({"cluster": self.keys.cluster})
        done, _, kv = await self.etcd.put_if(self.keys.marker, mine, create_revision=0)
        if done:
            log.info("created %s in etcd", self.keys.marker)
            return
        found = _unb64(kv.get("value", "")) if kv else ""
        with contextlib.suppress(ValueError, AttributeError):
            if json.loads(found).get("cluster") == self.keys.cluster:
                return
        raise ConfigError(
            f"{self.source}: etcd key {self.keys.marker} holds {found[:80]!r}, not this cluster's marker: "
            "another cluster or program uses dcs.prefix; choose another prefix"
        )

    async def _retake(self) -> None:
        """A controller restarted on this host keeps the leader keys that name this host and one of its own
        engines, while the etcd lease they hang on still lives (Patroni: the key names us): it adopts that
        lease and the keys' fencing tokens, so its primary is renewed and no group re-elects."""
        own = {spec.url for spec in self.config.engines()}
        for kv in await self.etcd.range_prefix(self.keys.leaders):
            leader = self.keys.parse(kv)
            if not isinstance(leader, Leader) or leader.host != self.host or leader.url not in own:
                continue
            if self.lease is None and leader.lease and await self.etcd.keepalive(leader.lease) > 0:
                self.lease = leader.lease
            if leader.lease and leader.lease == self.lease:
                self.held[leader.group] = Held(leader.revision, leader.member, leader.url)
                log.info("re-took group %d's leader key for %s (fencing token %d): its lease %x still lives",
                         leader.group, leader.member, leader.revision, leader.lease)  # fmt: skip

    async def stop(self, revoke: bool) -> None:
        """Stop keeping the lease; ``revoke`` (the stack is stopped too): delete our keys at once, so another
        host takes over without waiting for the TTL."""
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if revoke and self.lease is not None:
            with contextlib.suppress(DcsError):
                await self.etcd.revoke(self.lease)

    # --- the background keeper ------------------------------------------------------------------

    async def _keep(self) -> None:
        while True:
            # asyncio.wait, not wait_for: on Python 3.11 a cancel (stop) landing as wait_for times out left
            # this task cancelling forever, and stop() with it (seen in tests/test_dcs.py).
            changed = asyncio.ensure_future(self.changed.wait())
            try:
                await asyncio.wait({changed}, timeout=self.dcs.loop_wait_s)
            finally:
                changed.cancel()
            self.changed.clear()
            try:
                await self.refresh()
                await self._seed()
            except DcsError as exc:
                self._unreachable(str(exc))
            self.wake()

    async def _watch(self) -> None:
        async for _ in self.etcd.watch(self.keys.leaders):
            self.changed.set()

    async def _seed(self) -> None:
        """Publish our daemons' seeding records and refresh their peer lists (``controller.seedplacement``), outside
        the lock a claim takes. Raises DcsError."""
        if self.seeding is None or self.lease is None:
            return
        lease = self.lease

        async def read(prefix: str) -> list[tuple[str, str]]:
            return [
                (_unb64(kv.get("key", "")), _unb64(kv.get("value", ""))) for kv in await self.etcd.range_prefix(prefix)
            ]

        await self.seeding.refresh(lambda key, value: self.etcd.put(key, value, lease), read, lease)

    def _unreachable(self, error: str) -> None:
        if self.error is None:
            log.warning("etcd out of reach: %s; not promoting, primaries lapse at their lease deadline", error)
        self.error = error

    async def refresh(self) -> None:
        """Keep the lease alive (a new one if it expired: every key held under it is gone), re-read the
        leader keys, renew our primaries' leases. Raises DcsError."""
        async with self.lock:
            await self._refresh()

    async def _refresh(self) -> None:
        sent = time.monotonic()
        if self.lease is None:
            self.lease = await self.etcd.grant(self.dcs.ttl_s)
        # One round trip's time, not two: a starved controller must still renew well inside its lease.
        ttl, kvs = await asyncio.gather(self.etcd.keepalive(self.lease), self.etcd.range_prefix(self.keys.leaders))
        if ttl <= 0:
            log.warning("our etcd lease %x expired: the leader keys held under it are gone", self.lease)
            self.lease, self.held = None, {}
            return await self._refresh()
        self.valid_until = sent + ttl
        leaders: dict[int, Leader | str] = {}
        for kv in kvs:
            if (group := self.keys.group_of(kv)) is not None:
                leaders[group] = self.keys.parse(kv)
        self.leaders = leaders
        for group, held in list(self.held.items()):
            leader = leaders.get(group)
            if not (isinstance(leader, Leader) and leader.revision == held.token and leader.lease == self.lease):
                log.warning("lost the leader key of group %d: %s", group, self._describe(leader))
                del self.held[group]
        if self.error is not None:
            log.info("etcd reachable again")
        self.error = None
        await asyncio.gather(*(self._renew(held) for held in self.held.values()))

    def _lease_s(self) -> float:
        """How long a primary may serve from now without another renewal."""
        return self.valid_until - time.monotonic() - self.dcs.retry_timeout_s

    async def _renew(self, held: Held) -> None:
        lease_s = self._lease_s()
        if lease_s <= 0:
            return
        body = {"fencing_token": held.token, "lease_s": round(lease_s, 3)}
        try:
            status, reply = await self.engines.post(held.url, Endpoint.LEASE, body, timeout=self.dcs.retry_timeout_s)
        except EngineUnreachable as exc:
            log.debug("renewing %s: %s", held.member, exc)
            return
        if status != 200:
            log.info("%s refused its lease renewal: %s", held.member, reply.get("message"))

    # --- what the HA loop asks -------------------------------------------------------------------

    def refusal(self, group: int) -> str | None:
        """Why this controller must not promote in ``group`` now (from the last read), or None."""
        if self.error is not None:
            return f"etcd is out of reach ({self.error}): not promoting"
        leader = self.leaders.get(group)
        if isinstance(leader, str):
            return leader
        if leader is not None and group not in self.held:
            return f"group {group} is led by {leader.describe()}"
        return None

    async def claim(self, group: int, member: str, url: str) -> tuple[dict[str, Any] | None, str | None]:
        """Win (or keep) the group's leader key for ``member`` in one transaction; returns the promote body
        (fencing token, lease) or the reason not to promote."""
        try:
            async with self.lock:
                return await self._claim(group, member, url)
        except DcsError as exc:
            self._unreachable(str(exc))
            return None, f"etcd is out of reach ({exc}): not promoting"

    async def _claim(self, group: int, member: str, url: str) -> tuple[dict[str, Any] | None, str | None]:
        await self._refresh()  # a fresh lease deadline, and a check that etcd answers now
        value, held = self.keys.value(group, self.host, member, url), self.held.get(group)
        expected = {"mod_revision": held.token} if held is not None else {"create_revision": 0}
        done, token, kv = await self.etcd.put_if(self.keys.leader(group), value, lease=self.lease or 0, **expected)
        if not done:
            self.held.pop(group, None)
            leader = self.keys.parse(kv) if kv else None
            self.leaders[group] = leader if leader is not None else "the leader key vanished meanwhile"
            return None, f"lost the race for group {group}'s leader key: {self._describe(leader)}"
        self.held[group] = Held(token, member, url)
        self.leaders[group] = Leader(group, self.host, member, url, token, self.lease or 0)
        lease_s = self._lease_s()
        if lease_s <= 0:
            return None, "our etcd lease is about to expire: not promoting"
        log.info("won group %d's leader key for %s (fencing token %d)", group, member, token)
        return {"fencing_token": token, "lease_s": round(lease_s, 3)}, None

    async def release(self, group: int) -> None:
        """Give up the group's leader key (our primary is gone and we have no standby to promote): another
        host may take over at once instead of after the TTL."""
        held = self.held.pop(group, None)
        if held is None:
            return
        with contextlib.suppress(DcsError):
            if await self.etcd.delete_if(self.keys.leader(group), held.token):
                log.info("released group %d's leader key: no standby here to promote", group)

    def _describe(self, leader: Leader | str | None) -> str:
        if leader is None:
            return "no leader key"
        return leader if isinstance(leader, str) else leader.describe()

    def describe(self) -> dict[str, Any]:
        return {
            "mode": "etcd",
            "host": self.host,
            "etcd_error": self.error,
            "lease": self.lease,
            "groups": {
                str(g): leader if isinstance(leader, str) else leader.to_json() for g, leader in self.leaders.items()
            },
            "held": sorted(self.held),
            "seeding": self.seeding.describe() if self.seeding is not None else None,
        }


def leadership(
    config: ClusterConfig, client: httpx.AsyncClient, engines: EngineApi, layout: Layout | None = None
) -> Solo:
    """The policy ``config`` asks for: etcd leader keys with ``[dcs]`` (and seeding with ``[seeding]``, which needs
    the ``layout``), else this controller alone."""
    return EtcdLeadership(config, client, engines, layout) if config.dcs.enabled else Solo()


class LeaderUrls:
    """What a gateway follows in multi-host mode: the engine URLs the leader keys name, re-read at every
    change etcd's watch reports (and at each (re)connect of the watch), so a gateway on any host learns
    of a primary on another at once and probes it."""

    def __init__(self, config: ClusterConfig, client: httpx.AsyncClient) -> None:
        self.keys = Keys(config.dcs.prefix, config.cluster.name)
        self.etcd = Etcd(config.dcs.etcd, config.dcs.retry_timeout_s, client)

    async def follow(self) -> AsyncIterator[list[str]]:
        async for _ in self.etcd.watch(self.keys.leaders):
            try:
                kvs = await self.etcd.range_prefix(self.keys.leaders)
            except DcsError as exc:
                log.warning("reading the leader keys: %s", exc)
                continue
            yield [leader.url for kv in kvs if isinstance(leader := self.keys.parse(kv), Leader)]
