"""KV caches that engines deposit with their daemon, so that a successor can continue their sequences.

An engine attached to this daemon's arena may deposit, on its attach connection, the KV cache it computes
with (its pool of blocks) and the ledger of its slots (which token ids each slot's keys and values hold, in which
blocks: ``standby.kvshare``): two
exported allocations, the KV cache on the arena's backend and device, the ledger in host memory (cpu-shm).
The daemon maps both, so their memory outlives the engine, and hands their fds to any other attached engine
that asks (``kv_sources``): a newly promoted primary copies the slots that hold a migrated request's tokens
instead of computing them again.

Requests, each on an attached connection (others are refused with ``forbidden``)::

  {"op": "kv_deposit", "layout": {...}, "kv": handle, "ledger": handle} + 2 fds  -> {"id"}
  {"op": "kv_withdraw"}                                                          -> {}
  {"op": "kv_hand_over"}                                                         -> {}
  {"op": "kv_sources"}                        -> {"sources": [{"id", "alive", "layout", "kv", "ledger"}]} + fds
  {"op": "kv_release", "id": ID}                                                 -> {}

An engine deposits while it serves as a primary and withdraws when it stops, or hands its deposit over when it
stops with requests cut mid-way (a switchover's old primary: ``standby.scheduler``), for its successor to continue
them from. ``kv_sources`` lists the other engines' deposits, those of closed connections and handed over ones
first, newest first, at most MAX_SOURCES (two fds each: KV cache, ledger). A deposit lives while its engine's
connection is open (until withdrawn, or replaced by the engine's next deposit), then ``retain_s`` more
(``cache serve --kv-retain-s``, KV_RETAIN_S), the failover that needs it; a handed over one is no longer its
engine's (neither a withdrawal nor a next deposit drops it) and is retained as if its connection had closed. At
most MAX_RETAINED deposits of closed connections are kept (the newest), and ``kv_release`` (an engine done
adopting from it) drops one at once.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from hotweights.cache.backends import get_backend
from hotweights.cache.backends.base import ArenaBackend, BackendUnavailable, ImportedArena
from hotweights.cache.protocol import KV_RETAIN_S, MAX_FDS, error_reply
from hotweights.dtypes import ARENA_DTYPES

log = logging.getLogger(__name__)

MAX_RETAINED = 1  # deposits of closed connections kept at once: the last failed primary's (an older one is of no use
# to a failover that has already happened, and its memory, a whole KV pool, is what the next spare allocates)
MAX_SOURCES = MAX_FDS // 2  # deposits one ``kv_sources`` reply carries
LEDGER_BACKEND = "cpu-shm"
LEDGER_FIELDS = 3  # int64 per slot ahead of its token ids
KV_OPS = ("kv_deposit", "kv_withdraw", "kv_hand_over", "kv_sources", "kv_release")


@dataclass(frozen=True)
class KvLayout:
    """Where keys and values lie in a deposited allocation: two tensors of ``shape`` (layers, blocks, block size, kv
    heads, head dim) and ``dtype``, keys at byte 0 and values at ``v_offset``; the ledger's ``slots`` of up to
    ``positions`` positions each (``standby.kvshare.SlotLedger``: which blocks and tokens each slot holds)."""

    dtype: str
    shape: tuple[int, int, int, int, int]
    v_offset: int
    slots: int
    positions: int

    @property
    def block_size(self) -> int:
        return self.shape[2]

    @property
    def tensor_bytes(self) -> int:
        return math.prod(self.shape) * ARENA_DTYPES[self.dtype].itemsize

    @property
    def ledger_bytes(self) -> int:
        return ledger_nbytes(self.slots, self.positions, self.block_size)

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "v_offset": self.v_offset,
            "slots": self.slots,
            "positions": self.positions,
        }

    @classmethod
    def from_json(cls, value: object, kv_bytes: int) -> KvLayout:
        """Strict: a known dtype, five positive int dims, keys and values apart and inside ``kv_bytes``, positive
        slots and positions; ValueError naming the field."""
        if not isinstance(value, dict):
            raise ValueError("layout must be an object")
        dtype, shape, v_offset = value.get("dtype"), value.get("shape"), value.get("v_offset")
        if dtype not in ARENA_DTYPES:
            raise ValueError(f"layout dtype {str(dtype)[:40]!r} is not one of {sorted(ARENA_DTYPES)}")
        if not (isinstance(shape, list) and len(shape) == 5 and all(type(d) is int and d > 0 for d in shape)):
            raise ValueError(f"layout shape {str(shape)[:80]} must be five positive ints")
        for name in ("slots", "positions"):
            if type(value.get(name)) is not int or value[name] <= 0:
                raise ValueError(f"layout {name} {str(value.get(name))[:40]} must be a positive int")
        layout = cls(dtype, tuple(shape), v_offset, value["slots"], value["positions"])  # type: ignore[arg-type]
        size = layout.tensor_bytes
        if type(v_offset) is not int or v_offset < size or v_offset % ARENA_DTYPES[dtype].itemsize:
            raise ValueError(f"layout v_offset {str(v_offset)[:40]} must be an aligned int >= the keys' {size} bytes")
        if v_offset + size > kv_bytes:
            raise ValueError(f"layout needs {v_offset + size} bytes, the KV allocation holds {kv_bytes}")
        return layout


def ledger_nbytes(slots: int, positions: int, block_size: int) -> int:
    """The ledger of ``slots`` slots of ``positions`` tokens in blocks of ``block_size``: LEDGER_FIELDS int64 per slot
    (generation, length, prefilled), then int32 token ids, then each slot's int32 block table
    (``standby.kvshare.SlotLedger``)."""
    return 8 * LEDGER_FIELDS * slots + 4 * slots * positions + 4 * slots * -(-positions // block_size)


@dataclass
class Deposit:
    """One engine's KV cache and ledger, mapped here (``imported``) and handed on by ``fds``."""

    id: str
    owner: int | None  # the depositing connection's key; None once handed over
    layout: KvLayout
    handles: tuple[dict[str, Any], dict[str, Any]]  # KV cache, ledger
    fds: tuple[int, int]
    imported: tuple[ImportedArena, ImportedArena] = field(repr=False)
    deposited_at: float = field(default_factory=time.monotonic)
    closed_at: float | None = None  # when its connection closed

    def describe(self) -> dict[str, Any]:
        kv, ledger = self.handles
        alive = self.closed_at is None
        return {"id": self.id, "alive": alive, "layout": self.layout.to_json(), "kv": kv, "ledger": ledger}

    def close(self) -> None:
        for arena in self.imported:
            arena.close()
        for fd in self.fds:
            os.close(fd)


class KvDeposits:
    """The daemon's deposits; thread-safe (one thread per connection calls ``handle``)."""

    def __init__(self, backend: ArenaBackend, device: torch.device, retain_s: float = KV_RETAIN_S) -> None:
        """``retain_s``: how long a deposit outlives its engine's connection (KV_RETAIN_S by default)."""
        self.backend = backend
        self.device = device
        self.retain_s = retain_s
        self._deposits: dict[str, Deposit] = {}
        self._lock = threading.Lock()

    def handle(self, owner: int, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        """Answer one of KV_OPS from the attached connection ``owner``; takes ownership of ``fds``. The reply's
        fds are duplicates, the caller's to close once sent (a deposit may be dropped meanwhile)."""
        op = request["op"]
        if op != "kv_deposit":
            for fd in fds:
                os.close(fd)
            if fds:
                return error_reply("bad_message", f"{op} carries no file descriptors, {len(fds)} were sent"), []
        if op == "kv_deposit":
            return self._deposit(owner, request, fds), []
        if op == "kv_sources":
            return self._sources(owner)
        with self._lock:
            if op == "kv_withdraw":
                self._drop([d for d in self._deposits.values() if d.owner == owner])
            elif op == "kv_hand_over":
                self._hand_over(owner)
            else:
                self._drop([d for d in self._deposits.values() if d.id == request.get("id") and d.closed_at])
        return {"ok": True}, []

    def connection_closed(self, owner: int) -> None:
        """``owner``'s deposit is retained for ``retain_s`` from now (``expire``)."""
        with self._lock:
            for deposit in self._deposits.values():
                if deposit.owner == owner:
                    deposit.closed_at = time.monotonic()
        self.expire()

    def _hand_over(self, owner: int) -> None:
        """Under the lock: ``owner``'s deposit is retained as a closed connection's is, and no longer its."""
        for deposit in self._deposits.values():
            if deposit.owner == owner:
                deposit.owner, deposit.closed_at = None, time.monotonic()
                log.info("KV deposit %s handed over", deposit.id)

    def expire(self) -> None:
        """Drop the deposits of closed connections older than ``retain_s``, and all but the MAX_RETAINED newest."""
        now = time.monotonic()
        with self._lock:
            closed = sorted((d for d in self._deposits.values() if d.closed_at), key=lambda d: -d.closed_at)
            self._drop([d for i, d in enumerate(closed) if i >= MAX_RETAINED or now - d.closed_at >= self.retain_s])

    def status(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {"id": d.id, "alive": d.closed_at is None, "bytes": 2 * d.layout.tensor_bytes, "slots": d.layout.slots}
                for d in self._deposits.values()
            ]

    def close(self) -> None:
        with self._lock:
            self._drop(list(self._deposits.values()))

    def _drop(self, deposits: list[Deposit]) -> None:
        """Under the lock."""
        for deposit in deposits:
            del self._deposits[deposit.id]
            deposit.close()
            log.info("KV deposit %s dropped", deposit.id)

    def _deposit(self, owner: int, request: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        try:
            deposit = self._checked(owner, request, fds)
        except (ValueError, BackendUnavailable) as exc:
            return error_reply("bad_message", f"kv_deposit: {exc}")
        with self._lock:
            self._drop([d for d in self._deposits.values() if d.owner == owner])
            self._deposits[deposit.id] = deposit
        log.info("KV deposit %s: %d slots of %d positions", deposit.id, deposit.layout.slots, deposit.layout.positions)
        return {"ok": True, "id": deposit.id}

    def _checked(self, owner: int, request: dict[str, Any], fds: list[int]) -> Deposit:
        """The deposit ``request`` describes, both allocations mapped; ValueError (``fds`` closed) naming the fault."""
        imported: list[ImportedArena] = []
        try:
            if len(fds) != 2:
                raise ValueError(f"expected 2 file descriptors (KV cache, ledger), received {len(fds)}")
            kv, ledger = request.get("kv"), request.get("ledger")
            if not (isinstance(kv, dict) and isinstance(ledger, dict)):
                raise ValueError("'kv' and 'ledger' must be backend handles")
            if not self.backend.adoptable:
                raise ValueError(f"{self.backend.name} allocations die with their exporter: nothing to keep")
            if kv.get("backend") != self.backend.name or ledger.get("backend") != LEDGER_BACKEND:
                raise ValueError(f"backends {kv.get('backend')!r}, {ledger.get('backend')!r}: "
                                 f"expected {self.backend.name!r}, {LEDGER_BACKEND!r}")  # fmt: skip
            layout = KvLayout.from_json(request.get("layout"), _nbytes(kv))
            if _nbytes(ledger) < layout.ledger_bytes:
                raise ValueError(f"the ledger's {ledger.get('nbytes')} bytes are too few for {layout.shape}")
            kept = tuple(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0) for fd in fds)
            imported.append(self.backend.import_arena(kv, [kept[0]], self.device))
            imported.append(get_backend(LEDGER_BACKEND).import_arena(ledger, [kept[1]], torch.device("cpu")))
        except BaseException:
            for arena in imported:
                arena.close()
            for fd in fds:
                os.close(fd)
            raise
        handles = (kv, ledger)
        return Deposit(secrets.token_hex(8), owner, layout, handles, (fds[0], fds[1]), (imported[0], imported[1]))

    def _sources(self, owner: int) -> tuple[dict[str, Any], list[int]]:
        self.expire()
        with self._lock:
            others = [d for d in self._deposits.values() if d.owner != owner]
            newest = sorted(others, key=_relevance)[:MAX_SOURCES]
            fds = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0) for d in newest for fd in d.fds]
            return {"ok": True, "sources": [d.describe() for d in newest]}, fds


def _relevance(deposit: Deposit) -> tuple[bool, float]:
    """Sort key: the deposits of closed connections first (the failed primaries), then live ones (a hung
    primary, the primaries of other groups), the newest first in each."""
    return deposit.closed_at is None, -(deposit.closed_at or deposit.deposited_at)


def _nbytes(handle: dict[str, Any]) -> int:
    nbytes = handle.get("nbytes")
    if type(nbytes) is not int or nbytes <= 0:
        raise ValueError(f"handle nbytes {str(nbytes)[:40]} must be a positive int")
    return nbytes
