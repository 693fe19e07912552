"""Seeding: a new daemon fills its arena from a peer daemon serving the same weights, instead of from storage.

``seed_arena`` is the ``peer`` fill source (``cache.daemon``): it tries the peers ``SeedOptions.sources`` names
(a list, or a file the controller keeps current, re-read at every round) until one serves this fingerprint, then
copies the peer's arena over ``streams`` parallel channels (``cache.seedtransport``) straight into a new arena:
host memory directly, device memory through pinned buffers. A dropped stream reconnects and asks only for the
bytes it is missing; a peer that fails altogether leaves the missing ranges to the next peer serving the same
content hash. The arena's content hash is computed on it and compared with the peer's manifest BEFORE it is
returned, so nothing unverified is ever published. While it runs, progress (bytes, rate, resumes) is written
to a small JSON file beside the daemon's socket, for the controller and ``hotweights status``.

Contract (what the daemon sees): a ``Filled`` arena; SourceSkipped when no peer is named; SourceRefused with
one line naming each peer's refusal (wrong token, other weights, busy past ``wait_s``, digest mismatch).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hotweights.cache.backends.base import ArenaBackend, ExportedArena
from hotweights.cache.digest import fill_digests
from hotweights.cache.fingerprint import Fingerprint
from hotweights.cache.protocol import ProtocolError
from hotweights.cache.recovery import Filled, SourceRefused, SourceSkipped
from hotweights.cache.seedtransport import (
    MAX_CLIENTS,
    RATE_GBPS,
    STREAMS,
    WAIT_S,
    RangeSink,
    SeedBusy,
    SeedChannel,
    SeedRefused,
    SeedTransport,
    TcpTransport,
)
from hotweights.contract import read_token
from hotweights.errors import ConfigError
from hotweights.paths import write_json

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # the unit of work a stream asks for
PIECE_BYTES = 8 << 20  # the staging buffers' size on a device (both ends), and what a seed client acknowledges
READ_BYTES = 1 << 20  # a host arena's bytes are read (and their progress reported) in steps of this many
RECONNECTS = 5  # attempts of a stream to reconnect in a row without a byte moved, before it gives up
RETRY_S = 0.25  # between rounds over the peers while all are busy, and between reconnects
PROGRESS_EVERY_S = 0.2
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range's pages in, writable, in one call
LIBC = ctypes.CDLL(None, use_errno=True)


@dataclass(frozen=True)
class SeedOptions:
    """A daemon's seeding: where it serves its arena to peers, where it may fill from, and the limits."""

    listen: str = ""  # HOST:PORT this daemon serves its arena on once filled ("": not at all)
    sources: str = ""  # HOST:PORT[,HOST:PORT...], or @FILE holding one per line (re-read every round)
    token: str = ""  # the shared seeding token (both ends)
    streams: int = STREAMS
    max_clients: int = MAX_CLIENTS
    rate_gbps: float = RATE_GBPS
    wait_s: float = WAIT_S


def add_seed_arguments(parser: argparse.ArgumentParser) -> None:
    """``cache serve``'s seeding flags (docs/operations.md, Seeding)."""
    add = parser.add_argument
    add("--seed-listen", default="", metavar="HOST:PORT", help="serve the arena to peer daemons here once filled")
    add("--seed-from", default="", metavar="PEERS", help="peers to fill from (the 'peer' source): HOST:PORT[,...] "
        "or @FILE, one per line, re-read while waiting for a busy peer")  # fmt: skip
    add("--seed-token-file", default="", metavar="FILE", help="the shared seeding token (needed by both flags above)")
    add("--seed-streams", type=int, default=STREAMS, help=f"parallel streams of a copy (default {STREAMS})")
    add("--seed-max-clients", type=int, default=MAX_CLIENTS,
        help=f"peers this daemon copies to at once (default {MAX_CLIENTS})")  # fmt: skip
    add("--seed-rate-gbps", type=float, default=RATE_GBPS, help="cap on what seeding sends, GB/s (default: none)")
    add("--seed-wait-s", type=float, default=WAIT_S,
        help=f"how long to wait while every peer is busy and none is new, before the next fill source "
        f"(default {WAIT_S:g})")  # fmt: skip


def seed_options(args: argparse.Namespace) -> SeedOptions:
    """The flags as SeedOptions; ConfigError in one line for a missing token or a value out of range."""
    if not (args.seed_listen or args.seed_from):
        return SeedOptions()
    if not args.seed_token_file:
        raise ConfigError("--seed-listen and --seed-from need --seed-token-file (the token every host shares)")
    bounds = [("--seed-streams", args.seed_streams, 1), ("--seed-max-clients", args.seed_max_clients, 1),
              ("--seed-rate-gbps", args.seed_rate_gbps, 0), ("--seed-wait-s", args.seed_wait_s, 0)]  # fmt: skip
    for flag, value, low in bounds:
        if not value >= low:
            raise ConfigError(f"{flag} must be >= {low}, found {value}")
    token = read_token(Path(args.seed_token_file), "--seed-token-file")
    return SeedOptions(args.seed_listen, args.seed_from, token, args.seed_streams, args.seed_max_clients,
                       args.seed_rate_gbps, args.seed_wait_s)  # fmt: skip


def read_sources(spec: str) -> list[str]:
    """The peers ``spec`` names now; a missing file names none."""
    if not spec.startswith("@"):
        return [part.strip() for part in spec.split(",") if part.strip()]
    try:
        text = Path(spec[1:]).read_text()
    except FileNotFoundError:
        return []
    return [line.strip() for line in text.splitlines() if line.strip()]


class Progress:
    """What the copy has done so far, written to ``path`` at most every PROGRESS_EVERY_S (and at each state)."""

    def __init__(self, path: Path | None, total: int) -> None:
        self.path, self.total = path, total
        self.done = self.resumes = 0
        self.source, self.state = "", "seeding"
        self.started = time.monotonic()
        self.copied_at: float | None = None  # wall clock when the last byte landed (before the check)
        self.copied_s: float | None = None
        self._written = 0.0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            due = time.monotonic() - self._written >= PROGRESS_EVERY_S
        if due:
            self.write()

    def rate_gbps(self) -> float:
        """Bytes moved over the copy's time so far (to its last byte, once it is copied)."""
        end = self.started + self.copied_s if self.copied_s is not None else time.monotonic()
        return self.done / 1e9 / max(end - self.started, 1e-9)

    def copied(self) -> None:
        """The last byte landed: the copy's time and wall-clock end are fixed."""
        self.copied_s, self.copied_at = time.monotonic() - self.started, time.time()

    def to_json(self) -> dict[str, Any]:
        return {"state": self.state, "source": self.source, "bytes_done": self.done, "bytes_total": self.total,
                "rate_gbps": round(self.rate_gbps(), 3), "resumes": self.resumes, "pid": os.getpid(),
                "copied_at": self.copied_at}  # fmt: skip

    def write(self, state: str | None = None) -> None:
        with self._lock:
            self.state = state or self.state
            self._written = time.monotonic()
            if self.path is not None:
                with contextlib.suppress(OSError):  # progress is for the operator: never fail the copy for it
                    write_json(self.path, self.to_json())


class HostSink(RangeSink):
    """Bytes straight into a host arena (cpu-shm): the socket reads into the arena's own pages."""

    def __init__(self, arena: torch.Tensor) -> None:
        self.view = memoryview(arena.numpy())

    def receive(self, start: int, end: int, read_into: Callable[[memoryview], int]) -> int:
        position = start
        while position < end:  # a step at a time, so that progress moves while a range lands
            position += read_into(self.view[position : min(position + READ_BYTES, end)])
        return end - start

    def close(self) -> None:
        self.view.release()


class DeviceSink(RangeSink):
    """Bytes into a device arena through two pinned buffers: one fills from the socket while the other's
    copy to the device runs on this sink's stream."""

    def __init__(self, arena: torch.Tensor) -> None:
        from hotweights.cache.loader import aligned_host_buffer

        self.arena = arena
        self.stream = torch.cuda.Stream(arena.device)
        self.buffers = [aligned_host_buffer(PIECE_BYTES, pinned=True) for _ in range(2)]
        self.views = [memoryview(buffer.numpy()) for buffer in self.buffers]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def receive(self, start: int, end: int, read_into: Callable[[memoryview], int]) -> int:
        position = start
        while position < end:
            length = min(PIECE_BYTES, end - position)
            slot = self.turn
            self.turn ^= 1
            if (event := self.events[slot]) is not None:
                event.synchronize()  # its last copy to the device is done: the buffer may be refilled
            got = 0
            try:
                while got < length:
                    got += read_into(self.views[slot][got:length])
            finally:
                self._to_device(slot, position, got)  # what arrived is placed, even when the stream broke
            position += length
        return end - start

    def _to_device(self, slot: int, position: int, nbytes: int) -> None:
        if nbytes == 0:
            return
        with torch.cuda.stream(self.stream):
            self.arena[position : position + nbytes].copy_(self.buffers[slot][:nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.events[slot] = event

    def close(self) -> None:
        self.stream.synchronize()
        for view in self.views:
            view.release()


def new_sink(arena: torch.Tensor) -> HostSink | DeviceSink:
    return DeviceSink(arena) if arena.device.type == "cuda" else HostSink(arena)


class Copy:
    """One arena being filled: the ranges still missing, shared by every stream (and by the next peer)."""

    def __init__(self, arena: ExportedArena, manifest: dict[str, Any], progress: Progress) -> None:
        self.arena, self.manifest, self.progress = arena, manifest, progress
        used = manifest["used_bytes"]
        self.missing = [(start, min(start + CHUNK_BYTES, used)) for start in range(0, used, CHUNK_BYTES)]
        self.lock = threading.Lock()
        self.errors: list[str] = []

    def __len__(self) -> int:
        return self.manifest["used_bytes"]

    def take(self) -> tuple[int, int] | None:
        with self.lock:
            return self.missing.pop(0) if self.missing else None

    def give_back(self, start: int, end: int) -> None:
        with self.lock:
            self.missing.insert(0, (start, end))

    def run(self, first: SeedChannel, open_: Callable[[], SeedChannel], streams: int) -> None:
        """Copy every missing range over ``streams`` channels (``first`` already open, ``open_`` opens more to the
        same peer); returns when none is missing, or when every stream gave up (the caller tries another peer)."""
        channels = [first] + [None] * (streams - 1)
        workers = [threading.Thread(target=self._stream, args=(channel, open_), name=f"seed-{i}", daemon=True)
                   for i, channel in enumerate(channels)]  # fmt: skip
        if self.arena.tensor.device.type == "cpu":
            workers.append(threading.Thread(target=self._populate, args=(list(self.missing),), daemon=True))
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()

    def _populate(self, ranges: list[tuple[int, int]]) -> None:
        """Allocate a host arena's pages ahead of the streams, in the order they take ranges (a shared memory page's
        first write costs more than the bytes it receives; done here, it overlaps the network)."""
        base = self.arena.tensor.data_ptr()
        for start, end in ranges:
            if LIBC.madvise(ctypes.c_void_p(base + start), ctypes.c_size_t(end - start), MADV_POPULATE_WRITE):
                return  # an older kernel (before 5.14): the streams fault the pages in themselves

    def _stream(self, channel: SeedChannel | None, open_: Callable[[], SeedChannel]) -> None:
        """Take ranges until none is left; a broken channel is reopened (the range's rest given back first)."""
        sink = new_sink(self.arena.tensor)
        failures = 0
        try:
            while (work := self.take()) is not None:
                start, end = work
                moved = [0]
                try:
                    channel = channel or open_()
                    channel.read_range(start, end, sink, lambda n, moved=moved: self._moved(moved, n))
                    failures = 0
                except (OSError, ProtocolError, SeedBusy, SeedRefused) as exc:
                    self.give_back(start + moved[0], end)
                    if channel is not None:
                        channel.close()
                        channel = None
                    failures = 0 if moved[0] else failures + 1
                    if isinstance(exc, SeedRefused) or failures >= RECONNECTS:
                        self.errors.append(str(exc))
                        return
                    self.progress.resumes += 1
                    time.sleep(RETRY_S * failures)  # backoff before reconnecting (nothing to wait on: a peer)
        finally:
            sink.close()
            if channel is not None:
                channel.close()

    def _moved(self, moved: list[int], n: int) -> None:
        moved[0] += n
        self.progress.add(n)


def seed_arena(
    options: SeedOptions,
    fingerprint: Fingerprint,
    backend: ArenaBackend,
    device: torch.device,
    progress_path: Path | None = None,
    transport: SeedTransport | None = None,
) -> Filled:
    """A new arena filled from a peer (module docstring); SourceSkipped when no peer is named, SourceRefused
    naming every peer's refusal when none served it. Rounds over the peers repeat while one is only busy (or
    broke off after moving bytes), until ``options.wait_s`` passed without a new peer listed (in a fan-out, the
    peers seeded meanwhile)."""
    if not read_sources(options.sources):
        raise SourceSkipped(f"no seeding peer named ({options.sources or 'no --seed-from'})")
    peers = Peers(transport or TcpTransport(), options, fingerprint, secrets.token_hex(8))
    start = waiting_since = time.monotonic()
    known: set[str] = set()
    copy: Copy | None = None
    try:
        while True:
            listed = read_sources(options.sources)
            if not known.issuperset(listed):
                known.update(listed)
                waiting_since = time.monotonic()
            for address in listed:
                copy = peers.copy_from(address, copy, lambda m: _new_copy(m, backend, device, progress_path))
                if copy is not None and not copy.missing:
                    return _verified(copy, backend, device, time.monotonic() - start)
            if not peers.worth_waiting() or time.monotonic() - waiting_since > options.wait_s:
                break
            time.sleep(RETRY_S)  # every peer is busy copying to others: one frees up within a copy time
    except BaseException:
        if copy is not None:
            copy.arena.close()
        raise
    if copy is not None:
        copy.progress.write("failed")
        copy.arena.close()
    raise SourceRefused("; ".join(f"{address}: {reason}" for address, (_, reason) in peers.refusals.items()))


def _new_copy(manifest: dict[str, Any], backend: ArenaBackend, device: torch.device, path: Path | None) -> Copy:
    used = manifest["used_bytes"]
    return Copy(backend.allocate(used, device), manifest, Progress(path, used))


class Peers:
    """The peers tried by one ``seed_arena``, and why each did not (or not yet) serve."""

    def __init__(self, transport: SeedTransport, options: SeedOptions, fingerprint: Fingerprint, session: str) -> None:
        self.transport, self.options, self.fingerprint, self.session = transport, options, fingerprint, session
        self.refusals: dict[str, tuple[bool, str]] = {}  # address -> (worth retrying, why)

    def worth_waiting(self) -> bool:
        return any(retry for retry, _ in self.refusals.values())

    def open(self, address: str, copy: Copy | None) -> tuple[SeedChannel, dict[str, Any]]:
        """An authenticated channel to ``address`` and its manifest (checked against ours and ``copy``'s)."""
        channel = self.transport.connect(address)
        try:
            manifest = channel.open(self.options.token, self.fingerprint.to_json(), self.session, self.options.listen)
            _check_manifest(manifest, self.fingerprint, copy)
        except BaseException:
            channel.close()
            raise
        return channel, manifest

    def copy_from(self, address: str, copy: Copy | None, new: Callable[[dict[str, Any]], Copy]) -> Copy | None:
        """Copy what is missing from ``address`` (``new`` makes the Copy on the first peer that serves); the
        Copy, None while no peer served. A refusal is recorded and logged once."""
        try:
            channel, manifest = self.open(address, copy)
        except (OSError, ProtocolError, SeedBusy, SeedRefused) as exc:
            self._refused(address, isinstance(exc, SeedBusy), str(exc))
            return copy
        copy = copy or new(manifest)
        self.refusals.pop(address, None)
        copy.progress.source = address
        copy.progress.write("seeding")
        log.info("seeding %d bytes from %s over %d streams", len(copy), address, self.options.streams)
        copy.run(channel, lambda: self.open(address, copy)[0], self.options.streams)
        if copy.missing:
            self._refused(address, True, f"the copy broke off: {'; '.join(copy.errors[-2:])}")
        return copy

    def _refused(self, address: str, retry: bool, reason: str) -> None:
        if self.refusals.get(address, (None, ""))[1] != reason:
            log.warning("not seeding from %s: %s", address, reason)
        self.refusals[address] = (retry, reason)


def _check_manifest(manifest: dict[str, Any], fingerprint: Fingerprint, copy: Copy | None) -> None:
    """SeedRefused unless the peer's arena is of our fingerprint (and, mid-copy, of the same content)."""
    if manifest.get("fingerprint") != fingerprint.to_json():
        raise SeedRefused("its manifest is of another fingerprint")
    if copy is not None and manifest.get("content_hash") != copy.manifest["content_hash"]:
        raise SeedRefused(f"it serves content {manifest.get('content_hash')}, the copy began from "
                          f"{copy.manifest['content_hash']}")  # fmt: skip


def _verified(copy: Copy, backend: ArenaBackend, device: torch.device, seconds: float) -> Filled:
    """The copied arena once its content hash is the manifest's; SourceRefused otherwise."""
    copy.progress.copied()
    copy.progress.write("verifying")
    used, expected = copy.manifest["used_bytes"], copy.manifest["content_hash"]
    started = time.perf_counter()
    content_hash, keyed = fill_digests(copy.arena.tensor, used)
    hashed = time.perf_counter() - started
    if content_hash != expected:  # seed_arena frees the arena
        copy.progress.write("failed")
        raise SourceRefused(f"seeded bytes from {copy.progress.source} hash to {content_hash}, its manifest says "
                            f"{expected}: refused, nothing served")  # fmt: skip
    copy.progress.write("done")
    manifest = copy.manifest | {"arena_bytes": copy.arena.nbytes, "backend": backend.name, "device": str(device)}
    rate, resumes = copy.progress.rate_gbps(), copy.progress.resumes
    detail = (f"seeded from {copy.progress.source}: {used / 1e9:.3f} GB in {seconds:.2f} s ({rate:.2f} GB/s, "
              f"{resumes} resumed), verified in {hashed:.2f} s")  # fmt: skip
    return Filled(copy.arena, manifest, keyed, detail)
