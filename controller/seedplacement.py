"""Seeding in etcd mode (``[seeding]``): which peer a new host's daemon fills its arena from.

Every controller publishes, under its etcd lease, one record per daemon of its host (generation 0, each group and
rank): ``<prefix>/<cluster>/seeders/<group>/<rank>/<host>`` = a ``SeedRecord``: the daemon's seeding address,
whether it serves (with its fingerprint digest), or is seeding (from which peer, how far, how fast), or is filling
from elsewhere. A record goes with its host's lease: a lost host stops being a source at its TTL.

From the records last read, the controller writes each of its daemons' ``--seed-from @FILE`` file
(``DaemonPaths.seed_sources``): the peers ``choose_sources`` orders, best first. The daemon re-reads it while it
waits for a busy peer, so a host that has just finished seeding becomes a source for the hosts still waiting: the
copies fan out as a tree (``simulate_fanout``: N hosts in about log2(N) copy times with one client per source).
A daemon with no usable peer fills from its snapshot or checkpoint (``cache.daemon.FILL_SOURCES``).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import json
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hotweights.cache.connection import AttachRefused, DaemonUnavailable, hello
from hotweights.cache.paths import DaemonPaths

if TYPE_CHECKING:
    from hotweights.controller.stack import Layout

log = logging.getLogger(__name__)

READ_EVERY_S = 2.0  # every host's records re-read this often while all our daemons serve (N hosts: N/2 reads/s)


class SeedState(enum.StrEnum):
    SERVING = "serving"  # a source: the daemon serves its arena (and seeds peers)
    SEEDING = "seeding"  # copying from a peer (``source``)
    FILLING = "filling"  # starting, or filling from its snapshot or checkpoint


@dataclass(frozen=True)
class SeedRecord:
    """One daemon as its host's controller last saw it."""

    host: str
    group: int
    rank: int
    address: str  # its seeding listener, HOST:PORT
    state: SeedState
    fingerprint: str = ""  # the digest, once serving
    source: str = ""  # while seeding: the peer's address
    bytes_done: int = 0
    bytes_total: int = 0
    rate_gbps: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> SeedRecord:
        """ValueError (or KeyError, TypeError) for a record that is not one."""
        return cls(**{**value, "state": SeedState(value["state"])})


def loads(records: list[SeedRecord]) -> Counter[str]:
    """The copies in flight from each source, by its address."""
    return Counter(r.source for r in records if r.state is SeedState.SEEDING)


def choose_sources(records: list[SeedRecord], me: str, group: int, rank: int, max_clients: int) -> list[str]:
    """Pure: the peers a daemon of ``group`` and ``rank`` on host ``me`` should seed from, best first: every other
    host's daemon of that group and rank that serves, those with fewer than ``max_clients`` copies in flight first,
    then by fewest copies, ties broken by a hash of both host names (joiners reading the same records spread over
    the sources). Busy sources stay listed, last: the daemon waits for one rather than read the checkpoint."""
    serving = [r for r in records if (r.group, r.rank) == (group, rank) and r.host != me
               and r.state is SeedState.SERVING]  # fmt: skip
    copies = loads([r for r in records if r.host != me])

    def order(record: SeedRecord) -> tuple[bool, int, str]:
        spread = hashlib.sha256(f"{me}/{record.host}".encode()).hexdigest()
        return copies[record.address] >= max_clients, copies[record.address], spread

    return [r.address for r in sorted(serving, key=order)]


@dataclass(frozen=True)
class Fanout:
    """What ``simulate_fanout`` found: when each host was seeded (in copy times) and how the links were loaded."""

    hosts: int
    copy_times: float  # until the last host was seeded, in units of one copy at full link speed
    seeded_at: list[float]  # per copy time elapsed (1, 2, ...): hosts serving by then
    max_copies_per_source: int
    mean_uplink_load: float  # of the sources' uplinks, over the whole fan-out

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def simulate_fanout(hosts: int, max_clients: int = 1, sources: int = 1) -> Fanout:
    """Pure: ``hosts`` hosts, ``sources`` of them serving, the rest joining at once; each joiner takes the first
    free peer ``choose_sources`` lists (else waits); a source's uplink is shared by its copies, a copy at full
    speed takes one copy time, and a seeded host becomes a source. ValueError without a source."""
    if not 0 < sources <= hosts:
        raise ValueError(f"need 1 to {hosts} sources, found {sources}")
    records = {f"h{i}": SeedRecord(f"h{i}", 0, 0, f"h{i}", SeedState.SERVING) for i in range(sources)}
    waiting = [f"h{i}" for i in range(sources, hosts)]
    copies: dict[str, list[float]] = {}  # joiner -> [remaining fraction]
    now, busy_time, most, done = 0.0, 0.0, 0, {name: 0.0 for name in records}
    while waiting or copies:
        while waiting:  # the joiners in turn, each on the first free source listed, until none is free
            listed = list(records.values())
            first = next(iter(choose_sources(listed, waiting[0], 0, 0, max_clients)), "")
            if not first or loads(listed)[first] >= max_clients:
                break
            joiner = waiting.pop(0)
            records[joiner] = SeedRecord(joiner, 0, 0, joiner, SeedState.SEEDING, source=first)
            copies[joiner] = [1.0]
        listed = list(records.values())
        in_flight = loads(listed)
        shares = {j: 1 / in_flight[records[j].source] for j in copies}
        most = max(most, *in_flight.values())
        step = min(copies[j][0] / shares[j] for j in copies)
        serving = sum(r.state is SeedState.SERVING for r in listed)
        busy_time += step * len(in_flight) / serving
        now += step
        for joiner in list(copies):
            copies[joiner][0] -= step * shares[joiner]
            if copies[joiner][0] <= 1e-9:
                del copies[joiner]
                records[joiner] = SeedRecord(joiner, 0, 0, joiner, SeedState.SERVING)
                done[joiner] = now
    finished = sorted(done.values())
    marks = [sum(t <= k + 1e-9 for t in finished) for k in range(1, math.ceil(now) + 1)]
    return Fanout(hosts, round(now, 6), marks, most, round(busy_time / now, 3) if now else 0.0)


class SeedPlacement:
    """This host's side of seeding in etcd mode (module docstring). ``refresh`` runs in each DCS refresh."""

    def __init__(self, layout: Layout, host: str, root: str) -> None:
        self.layout, self.host = layout, host
        self.config = layout.config.seeding
        self.prefix = f"{root}seeders/"
        self.records: list[SeedRecord] = []  # every host's, as last read
        self.published: dict[str, tuple[str, int]] = {}  # our keys: the value put and the lease it was put under
        self.read_at = -math.inf  # time.monotonic() of the last read of every host's records
        self.daemons = [(g, r) for g, group in enumerate(layout.config.groups) for r in range(group.tp_size)]

    def key(self, record: SeedRecord) -> str:
        return f"{self.prefix}{record.group}/{record.rank}/{record.host}"

    async def refresh(
        self,
        put: Callable[[str, str], Awaitable[None]],
        read: Callable[[str], Awaitable[list[tuple[str, str]]]],
        lease: int,
    ) -> None:
        """Publish our daemons' records that changed (``put``: under ``lease``, which a new lease changes), read
        everyone's (``read``: key, value pairs under a prefix; while every daemon of ours serves, only every
        READ_EVERY_S, for the status), write each of our daemons' sources file. Raises what ``put`` and ``read``
        raise."""
        mine = await asyncio.gather(*(asyncio.to_thread(self.observe, g, r) for g, r in self.daemons))
        changed = {self.key(r): json.dumps(r.to_json()) for r in mine}
        changed = {key: value for key, value in changed.items() if self.published.get(key) != (value, lease)}
        await asyncio.gather(*(put(key, value) for key, value in changed.items()))
        self.published |= {key: (value, lease) for key, value in changed.items()}
        waiting = any(record.state is not SeedState.SERVING for record in mine)
        if not waiting and time.monotonic() - self.read_at < READ_EVERY_S:
            return
        self.read_at = time.monotonic()
        records = []
        for key, value in await read(self.prefix):
            try:
                records.append(SeedRecord.from_json(json.loads(value)))
            except (ValueError, KeyError, TypeError):
                log.warning("seeding record %s is not one of ours: %.80s", key, value)
        self.records = records
        for group, rank in self.daemons:
            self.write_sources(group, rank)

    def observe(self, group: int, rank: int) -> SeedRecord:
        """Our daemon of ``group`` and ``rank`` now: serving (it answers), seeding (its progress file says so, from
        a live process), else filling."""
        paths = DaemonPaths(self.layout.socket(group, rank))
        address = self.layout.seed_address(group, rank)
        base = SeedRecord(self.host, group, rank, address, SeedState.FILLING)
        with contextlib.suppress(DaemonUnavailable, AttachRefused):
            reply = hello(paths.socket, timeout=0.5)
            return SeedRecord(self.host, group, rank, address, SeedState.SERVING, str(reply["fingerprint_digest"]))
        try:
            progress = json.loads(paths.seeding.read_text())
            alive = Path(f"/proc/{int(progress['pid'])}").exists()
        except (OSError, ValueError, KeyError, TypeError):
            return base
        if not alive or progress.get("state") not in ("seeding", "verifying"):
            return base
        return SeedRecord(self.host, group, rank, address, SeedState.SEEDING, source=str(progress["source"]),
                          bytes_done=int(progress["bytes_done"]), bytes_total=int(progress["bytes_total"]),
                          rate_gbps=float(progress["rate_gbps"]))  # fmt: skip

    def write_sources(self, group: int, rank: int) -> None:
        """The daemon's ``--seed-from @FILE``: ``choose_sources`` over the records last read, one per line."""
        chosen = choose_sources(self.records, self.host, group, rank, self.config.max_clients)
        path = DaemonPaths(self.layout.socket(group, rank)).seed_sources
        text = "".join(f"{address}\n" for address in chosen)
        with contextlib.suppress(FileNotFoundError):
            if path.read_text() == text:
                return
        tmp = path.with_name(f".{path.name}.tmp")
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp.write_text(text)
        tmp.replace(path)

    def describe(self) -> list[dict[str, Any]]:
        """Every host's daemons, as last read (``hotweights status``)."""
        ordered = sorted(self.records, key=lambda r: (r.group, r.rank, r.host))
        return [record.to_json() for record in ordered]


def copy_times_bound(hosts: int) -> int:
    """The fan-out's target: every host seeded within ceil(log2(hosts)) + 2 copy times."""
    return math.ceil(math.log2(hosts)) + 2 if hosts > 1 else 0
