"""KV caches that outlive their engine: a new primary continues a failed one's sequences from its keys and values.

A migrated request (``gateway.migration``) reaches the next primary as its prompt plus the tokens generated so far.
Computing their keys and values again costs a prefill and, with a batch-invariant decoder, one decode step per generated
token (``standby.scheduler``): over a second for 64 streams of ~128 tokens on ``xl``. The failed primary had them all.
So an engine that serves from a daemon's arena allocates its KV cache (its pool of blocks, ``standby.kvpool``) as the
arena is allocated (``cache.backends``: exported, on the same device) and, while it is a primary, deposits it with the
daemon together with its ``SlotLedger`` (``cache.kvdeposits``), whose memory the daemon then keeps after the engine
dies. The next primary, given a continuation, looks for a deposited slot that holds the request's tokens
(``KvShare.find``), copies the blocks that hold them into blocks of its own sequence
(``KvShare.copy``) and decodes from there: the continuation's first token costs one decode step.

The ledger says, per slot, which token ids its keys and values hold (``length`` of them, ``prefilled`` of those by the
slot's prefill), which blocks of the pool they lie in (the slot's row of the block table) and a generation, bumped
whenever the slot is given up. The owner writes it after the device finished the work it records (``Scheduler``), and
gives a slot up (``reset``) before anything may overwrite it (its blocks go back to the pool only then), so a reader
that finds the same even generation before and after its copy copied keys and values that match the
ledger's tokens, whatever the owner (alive, hung or dead) did meanwhile. A slot is taken only for a request
whose tokens it holds, which are the tokens the request itself sends: nothing a client sends selects another
client's keys and values. With a batch-invariant decoder a slot is taken only when it was prefilled with
the same prompt (``prefilled`` equal), so the continuation computes exactly what the uninterrupted run did.

A planned change hands over as a failure does. A primary that stops serving (a switchover's drain) keeps the
slots of the requests cut from it meanwhile (the gateway cuts their streams to continue them on the next
primary), ledger and all (``Scheduler.keep_cut``), and once demoted hands its deposit over instead of withdrawing
it (``KvShare.hand_over``): the daemon keeps it as a failed engine's, and the next primary adopts those slots.

Not shared: tensor-parallel engines, engines without a daemon, and cuda-ipc arenas (whose memory dies with its
exporter). A daemon that is gone leaves an engine serving as before, replaying instead of adopting.
"""

from __future__ import annotations

import logging
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from hotweights.cache.arena import ALIGNMENT
from hotweights.cache.backends import get_backend
from hotweights.cache.backends.base import KV_NAME, LEDGER_NAME, BackendUnavailable, ExportedArena, ImportedArena
from hotweights.cache.client import Attachment
from hotweights.cache.connection import DaemonUnavailable, close_all
from hotweights.cache.kvdeposits import LEDGER_BACKEND, LEDGER_FIELDS, MAX_SOURCES, KvLayout
from hotweights.dtypes import ARENA_DTYPES
from hotweights.standby.kvpool import blocks_for
from hotweights.standby.model import KVCache

log = logging.getLogger(__name__)

REFRESH_S = 0.2  # how old the list of deposits may be when a continuation looks for its slot
IDLE_S = 2.0  # sources unused this long are unmapped (and a failed engine's released)
REQUEST_TIMEOUT_S = 0.5  # for each reply of the daemon (one that stops answering costs the inference thread this once)


class SlotLedger:
    """Which token ids each slot's keys and values hold, and in which blocks of the pool, in shared host memory
    (module docstring; ``cache.kvdeposits.ledger_nbytes``)."""

    def __init__(self, data: torch.Tensor, layout: KvLayout) -> None:
        slots, positions = layout.slots, layout.positions
        header = data[: 8 * LEDGER_FIELDS * slots].view(torch.int64).view(LEDGER_FIELDS, slots)
        self.generation, self.length, self.prefilled = header
        start = 8 * LEDGER_FIELDS * slots
        self.tokens = data[start : start + 4 * slots * positions].view(torch.int32).view(slots, positions)
        start += 4 * slots * positions
        self.table = data[start : layout.ledger_bytes].view(torch.int32).view(slots, -1)  # (slots, blocks a slot has)

    def reset(self, slot: int) -> None:
        """Give ``slot`` up: its keys and values may be overwritten from now on."""
        self.generation[slot] += 1  # odd while it changes: an owner killed here leaves it unusable
        self.length[slot] = 0
        self.generation[slot] += 1

    def reset_all(self) -> None:
        for slot in range(len(self.length)):
            self.reset(slot)

    def record(self, slot: int, ids: list[int], prefilled: int, blocks: list[int]) -> None:
        """``slot``'s keys and values now hold ``ids``, the first ``prefilled`` of them computed by one prefill, in
        ``blocks`` of the pool (in order)."""
        self.tokens[slot, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        self.table[slot, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.prefilled[slot] = prefilled
        self.length[slot] = len(ids)  # last: a reader trusts no token beyond it

    def append(self, slots: list[int], positions: list[int], tokens: list[int]) -> None:
        """A decode step wrote ``tokens[i]`` at ``positions[i]`` of ``slots[i]``."""
        rows, cols = torch.tensor(slots), torch.tensor(positions)
        self.tokens[rows, cols] = torch.tensor(tokens, dtype=torch.int32)
        self.length[rows] = cols + 1

    def best(self, ids: torch.Tensor, least: int, prefilled: int | None) -> tuple[int, int, int, int] | None:
        """(slot, tokens held, generation, tokens prefilled) of the slot holding the longest prefix of ``ids``
        (int32), at least ``least`` tokens and at most all but the last (whose logits the continuation needs),
        prefilled from ``prefilled`` tokens when that is given; None when no slot does."""
        generation, first = self.generation.clone(), self.prefilled.clone()
        length = self.length.clone().clamp(0, len(ids) - 1)
        width = int(length.max()) if len(length) else 0
        if width < max(least, 1):
            return None
        same = (self.tokens[:, :width] == ids[:width]).to(torch.int32).cumprod(1).sum(1)
        held = torch.minimum(same, length)
        usable = (held >= least) & (generation % 2 == 0)
        if prefilled is not None:
            usable &= first == prefilled
        if not bool(usable.any()):
            return None
        slot = int(torch.where(usable, held, -1).argmax())
        return slot, int(held[slot]), int(generation[slot]), int(first[slot])


class SharedKv:
    """An engine's KV cache and ledger in exported memory (module docstring)."""

    def __init__(self, kv_arena: ExportedArena, ledger_arena: ExportedArena, layout: KvLayout) -> None:
        self.arenas = (kv_arena, ledger_arena)
        self.layout = layout
        self.kv = _mapped_kv(kv_arena.tensor, layout)
        self.ledger = SlotLedger(ledger_arena.tensor, layout)

    def close(self) -> None:
        for arena in self.arenas:
            arena.close()


@dataclass
class Source:
    """Another engine's deposit, mapped here."""

    id: str
    alive: bool
    kv: KVCache
    ledger: SlotLedger
    arenas: tuple[ImportedArena, ImportedArena]
    used: bool = False

    def close(self) -> None:
        del self.kv, self.ledger
        for arena in self.arenas:
            arena.close()


@dataclass(frozen=True)
class Match:
    source: Source
    slot: int
    length: int  # tokens held
    generation: int
    prefilled: int  # of them, computed by the slot's prefill


class KvShare:
    """One engine's link to its daemon's deposits: allocates shareable KV caches, deposits and withdraws the one
    it serves from, and finds and copies other engines' slots. ``find``, ``copy`` and ``idle`` run on the
    inference thread only."""

    def __init__(self, attachment: Attachment, device: torch.device) -> None:
        self.attachment = attachment
        self.device = device
        self.backend = get_backend(attachment.backend)
        self.deposited = False  # whether the daemon may hold this engine's KV cache
        self._changes = ThreadPoolExecutor(1, thread_name_prefix="hw-kv-deposits")
        self._sources: dict[str, Source] = {}
        self._listed_at = -math.inf
        self._used_at = -math.inf

    @classmethod
    def for_engine(cls, attachment: Attachment | None, device: torch.device, tp_size: int) -> KvShare | None:
        """The engine's share, or None where its KV cache cannot outlive it (module docstring)."""
        if attachment is None or tp_size > 1:
            return None
        try:
            share = cls(attachment, device)
        except BackendUnavailable:
            return None
        return share if share.backend.adoptable else None

    def allocate(
        self, shape: tuple[int, int, int, int, int], slots: int, positions: int, dtype: torch.dtype
    ) -> SharedKv:
        """A zeroed KV pool of ``shape`` (layers, blocks, block size, kv heads, head dim) for ``slots`` slots of up to
        ``positions`` positions, and an empty ledger."""
        name = str(dtype).removeprefix("torch.")
        size = math.prod(shape) * dtype.itemsize
        layout = KvLayout(name, shape, -(-size // ALIGNMENT) * ALIGNMENT, slots, positions)
        kv_arena = self.backend.allocate(layout.v_offset + size, self.device, KV_NAME)
        try:
            ledger_bytes = layout.ledger_bytes
            ledger_arena = get_backend(LEDGER_BACKEND).allocate(ledger_bytes, torch.device("cpu"), LEDGER_NAME)
        except BaseException:
            kv_arena.close()
            raise
        shared = SharedKv(kv_arena, ledger_arena, layout)
        shared.kv.k.zero_()  # a device allocation is not zeroed, and 0 * NaN stays NaN (``KVCache.allocate``)
        shared.kv.v.zero_()
        return shared

    def deposit(self, shared: SharedKv) -> Future[None]:
        """Deposit ``shared`` with the daemon (replacing this engine's earlier deposit), on a thread of its own
        (deposits and withdrawals in order), so that a promote never waits for the daemon; a failure is logged."""
        return self._changes.submit(self._deposit, shared)

    def withdraw(self) -> Future[None]:
        """Take this engine's deposit back (it stops serving from it, or stops): nothing to keep for a successor.
        On the deposits' thread, as ``deposit``."""
        return self._changes.submit(self._withdraw)

    def hand_over(self) -> Future[None]:
        """Leave this engine's deposit to a successor (it stops serving from it with requests cut mid-way: a
        switchover's): the daemon keeps it as a failed engine's; this engine writes that memory again only once a
        next promote has given up every slot of its ledger (``Scheduler.attach_kv``). On the deposits' thread, as
        ``deposit``."""
        return self._changes.submit(self._hand_over)

    def _deposit(self, shared: SharedKv) -> None:
        (kv_handle, kv_fds), (ledger_handle, ledger_fds) = (arena.export() for arena in shared.arenas)
        message = {"op": "kv_deposit", "layout": shared.layout.to_json(), "kv": kv_handle, "ledger": ledger_handle}
        reply, _ = self._request(message, (*kv_fds, *ledger_fds))
        self.deposited = reply is not None or self.attachment.waits_for_reply

    def _withdraw(self) -> None:
        if self.deposited:
            self._request({"op": "kv_withdraw"})
            self.deposited = False

    def _hand_over(self) -> None:
        if self.deposited:
            self._request({"op": "kv_hand_over"})
            self.deposited = False

    def find(self, ids: list[int], least: int, prefilled: int | None, own: KVCache) -> Match | None:
        """The deposited slot that holds the longest prefix of ``ids`` (``SlotLedger.best``) in a layout ``own``
        can take; None when none does."""
        self._used_at = time.monotonic()
        if self._used_at - self._listed_at > REFRESH_S:
            self._refresh()
        wanted = torch.tensor(ids, dtype=torch.int32)
        found = None
        for source in self._sources.values():
            if not _compatible(source.kv, own):
                continue
            best = source.ledger.best(wanted, least, prefilled)
            if best is not None and (found is None or best[1] > found.length):
                found = Match(source, *best)
        return found

    @property
    def sources(self) -> int:
        """The deposits mapped here now."""
        return len(self._sources)

    def copy(self, match: Match, own: KVCache, blocks: list[int]) -> bool:
        """Copy ``match``'s keys and values, block by block, into ``blocks`` of ``own`` (at least as many as they
        fill); False when its owner gave the slot up meanwhile (``blocks`` then hold nothing usable)."""
        source, n = match.source, blocks_for(match.length)
        held = source.ledger.table[match.slot, :n].tolist()
        if not all(0 < block < source.kv.blocks for block in held):  # a slot given up and reused as it was read
            return False
        read, written = (torch.tensor(b, dtype=torch.long, device=own.k.device) for b in (held, blocks[:n]))
        own.k.index_copy_(1, written, source.kv.k.index_select(1, read))
        own.v.index_copy_(1, written, source.kv.v.index_select(1, read))
        if own.k.device.type == "cuda":
            torch.cuda.synchronize(own.k.device)
        source.used = True
        return int(source.ledger.generation[match.slot]) == match.generation

    def idle(self) -> None:
        """Unmap the sources once no continuation looked for a slot for IDLE_S, and release the failed engines'
        deposits among those used: their memory is then free."""
        if not self._sources or time.monotonic() - self._used_at < IDLE_S:
            return
        for source in self._sources.values():
            source.close()
            if source.used and not source.alive:
                self._request({"op": "kv_release", "id": source.id})
        self._sources.clear()

    def _refresh(self) -> None:
        """Map the deposits the daemon lists now; unmap those it no longer does."""
        self._listed_at = time.monotonic()
        reply, fds = self._request({"op": "kv_sources"}, max_fds=2 * MAX_SOURCES)
        listed = reply.get("sources") if reply else None
        if not isinstance(listed, list) or len(fds) != 2 * len(listed):
            close_all(fds)
            return
        keep = set()
        for i, entry in enumerate(listed):
            pair = fds[2 * i : 2 * i + 2]
            source_id = entry.get("id") if isinstance(entry, dict) else None
            if source_id in self._sources:
                close_all(pair)
            else:
                source = self._mapped(entry, pair)
                if source is None:
                    continue
                self._sources[source.id] = source
            keep.add(source_id)
            self._sources[source_id].alive = bool(entry.get("alive"))
        for gone in set(self._sources) - keep:
            self._sources.pop(gone).close()

    def _mapped(self, entry: dict, fds: list[int]) -> Source | None:
        """``entry``'s deposit mapped here; None (logged, ``fds`` closed) when it cannot be."""
        imported: list[ImportedArena] = []
        began = time.monotonic()
        try:
            kv_handle, ledger_handle = entry["kv"], entry["ledger"]
            layout = KvLayout.from_json(entry["layout"], kv_handle["nbytes"])
            if ledger_handle.get("backend") != LEDGER_BACKEND or kv_handle.get("backend") != self.backend.name:
                raise ValueError(f"backends {kv_handle.get('backend')!r} and {ledger_handle.get('backend')!r}")
            imported.append(self.backend.import_arena(kv_handle, [fds[0]], self.device))
            imported.append(get_backend(LEDGER_BACKEND).import_arena(ledger_handle, [fds[1]], torch.device("cpu")))
            if imported[1].nbytes < layout.ledger_bytes:
                raise ValueError(f"a ledger of {imported[1].nbytes} bytes for {layout.shape}")
        except (KeyError, TypeError, ValueError, BackendUnavailable) as exc:
            for arena in imported:
                arena.close()
            close_all(fds[len(imported) :])
            log.warning("a KV deposit the daemon listed cannot be used: %s", exc)
            return None
        ledger = SlotLedger(imported[1].tensor, layout)
        kv = _mapped_kv(imported[0].tensor, layout)
        log.info(
            "mapped KV deposit %s (%s, %.2f GB) in %.1f ms",
            entry["id"],
            "its engine alive" if entry.get("alive") else "its engine gone",
            imported[0].nbytes / 1e9,
            (time.monotonic() - began) * 1000,
        )
        return Source(entry["id"], bool(entry.get("alive")), kv, ledger, (imported[0], imported[1]))

    def _request(self, message: dict, fds: tuple[int, ...] = (), max_fds: int = 0) -> tuple[dict | None, list[int]]:
        """The daemon's reply, or (None, []) when it refused or is gone (logged)."""
        try:
            reply, received = self.attachment.call(message, fds, max_fds, REQUEST_TIMEOUT_S)
        except DaemonUnavailable as exc:
            log.warning("%s: %s", message["op"], exc)
            return None, []
        if not reply["ok"]:
            log.warning("%s refused: %s", message["op"], reply.get("message"))
            close_all(received)
            return None, []
        return reply, received


def _mapped_kv(data: torch.Tensor, layout: KvLayout) -> KVCache:
    """The KV pool ``layout`` describes in the bytes ``data``, with a table of its own (every entry null)."""
    dtype, size = ARENA_DTYPES[layout.dtype], layout.tensor_bytes
    k = data[:size].view(dtype).view(layout.shape)
    v = data[layout.v_offset : layout.v_offset + size].view(dtype).view(layout.shape)
    return KVCache.over(k, v, layout.slots, layout.positions)


def _compatible(source: KVCache, own: KVCache) -> bool:
    """Whether a slot of ``source`` can be copied into ``own``: the same dtype, device, layers, block size, heads
    and head dim (the pools' blocks, slots and positions may differ)."""
    a, b = source.k, own.k
    return a.dtype == b.dtype and a.device == b.device and a.shape[0] == b.shape[0] and a.shape[2:] == b.shape[2:]
