"""The weight cache daemon: run the load pipeline once into one arena, then serve attach requests.

Lifecycle: take the lock -> check the socket path (refuse a directory, a file, a live listener) -> bind the
seeding port (``--seed-listen``) -> fill the arena (``fill``: re-adopted, seeded from a peer, a snapshot, the
checkpoint) -> hash it -> freeze it (cpu-shm: no process can write it any more) -> bind the socket (0600, in a
0700 directory) -> write the ready marker -> publish the socket in the runtime dir if it lives elsewhere
(``paths.publish``) -> seed peers (``cache.seedserver``) -> serve until SIGTERM/SIGINT -> remove link, socket
and marker.
Each client gets its own thread and one deadline for each whole request, so a silent, trickling or
malformed client costs its own connection and nothing else. At most ``max_connections`` are open at
once: past that, the connection waiting longest for a request is shed to make room (attached
engines are never shed). An attached engine keeps its connection open (that is how ``status``
counts clients); the engine keeps working if the daemon dies, because the kernel or driver holds
the memory until the last mapping goes. On that connection an engine serving as a primary also deposits its KV
cache, which the daemon keeps for the engine's successor (``cache.kvdeposits``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from hotweights.cache import arena as arena_layout
from hotweights.cache.backends import get_backend
from hotweights.cache.backends.base import ArenaBackend, ExportedArena
from hotweights.cache.checkpoint import Checkpoint, read_checkpoint
from hotweights.cache.connection import close_all
from hotweights.cache.digest import fill_digests
from hotweights.cache.diskio import disk_read_bytes
from hotweights.cache.fingerprint import Fingerprint, compute_fingerprint, describe_differences
from hotweights.cache.kvdeposits import KV_OPS, KvDeposits
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.paths import DaemonPaths, check_socket_path_free, ensure_private_dir, publish, unpublish
from hotweights.cache.pipeline import check_spec, iter_processed, processed_config, processed_dtype
from hotweights.cache.protocol import (
    KV_RETAIN_S,
    PROTOCOL_VERSION,
    PeerClosed,
    ProtocolError,
    error_reply,
    is_our_version,
    recv_message,
    send_message,
)
from hotweights.cache.recovery import Filled, SourceRefused, SourceSkipped, readopt, write_record
from hotweights.cache.seeding import SeedOptions, seed_arena
from hotweights.cache.seedserver import SeedServer
from hotweights.cache.snapshot import load_snapshot
from hotweights.dtypes import ARENA_DTYPES
from hotweights.errors import BindingError, ConfigError, HotweightsError
from hotweights.layout import processed_tensors
from hotweights.limits import ACCEPT_BACKOFF_S
from hotweights.pidlock import LockHeld, PidLock

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0  # for each whole request from a client that has not attached
MAX_CONNECTIONS = 128  # open connections (attached engines included); one thread each
LISTEN_BACKLOG = 4096  # connections the kernel queues before accept (a connect storm must not refuse engines)
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the NUL
FILL_SOURCES = ("readopt", "peer", "snapshot", "disk")  # the order a daemon tries them in, unless told otherwise


@dataclass(frozen=True)
class ArenaSource:
    """What a daemon serves: its fingerprint, the tensors' layout, and how to produce them."""

    fingerprint: Fingerprint
    specs: Callable[[], dict[str, tuple[tuple[int, ...], torch.dtype]]]  # may do the slow part: called by load
    tensors: Callable[[], Iterator[tuple[str, torch.Tensor]]]
    device: torch.device
    aliases: Callable[[], dict[str, str]] = dict  # tied names: alias -> the canonical tensor's name
    direct_io: bool = False  # read checkpoint and snapshot with O_DIRECT: how bytes are read, not what is served


def pipeline_source(checkpoint: Checkpoint | Path, spec: LoadSpec, *, direct_io: bool = False) -> ArenaSource:
    """The normal source: the load pipeline's output for ``checkpoint`` and ``spec``. A directory is read in two
    steps: its JSON files now (the fingerprint, the spec's checks), its safetensors headers only once the arena
    is filled from the disk, so a daemon that re-adopts or restores a snapshot opens no shard. ``direct_io``
    (O_DIRECT reads) is left out of the fingerprint: the bytes produced are the same."""
    known = checkpoint if isinstance(checkpoint, Checkpoint) else read_checkpoint(checkpoint, headers=False)
    check_spec(known, spec)  # a ConfigError naming the flag, before the model is built
    config = processed_config(known, spec)
    specs = processed_tensors(config, processed_dtype(known, spec), spec.tp_size)
    full = (lambda: known) if isinstance(checkpoint, Checkpoint) else (lambda: read_checkpoint(known.path))
    return ArenaSource(
        fingerprint=compute_fingerprint(known, spec),
        specs=lambda: specs,
        tensors=lambda: iter_processed(full(), spec, progress=True, direct_io=direct_io),
        device=torch.device(spec.device),
        direct_io=direct_io,
    )


def load_arena(source: ArenaSource, backend: ArenaBackend, stopping: Callable[[], bool] = bool) -> Filled:
    """Run ``source`` once, copying each processed tensor into its place in a new arena, and hash it.
    Interrupted as soon as ``stopping()`` is true; BindingError for a tensor that does not fit its slot."""
    start = time.perf_counter()
    entries, nbytes = arena_layout.plan_layout(source.specs())
    device = source.device
    arena = backend.allocate(nbytes, device)
    try:
        _copy_tensors(source, arena, {entry.name: entry for entry in entries}, stopping)
        loaded = time.perf_counter()
        content_hash, keyed = fill_digests(arena.tensor, nbytes)
    except BaseException:
        arena.close()
        raise
    manifest = {
        "format": source.fingerprint.arena_format,
        "alignment": arena_layout.ALIGNMENT,
        "fingerprint": source.fingerprint.to_json(),
        "content_hash": content_hash,
        "used_bytes": nbytes,
        "arena_bytes": arena.nbytes,
        "device": str(device),
        "backend": backend.name,
        "tensors": [entry.to_json() for entry in entries],
        "aliases": source.aliases(),
    }
    hashed = time.perf_counter() - loaded
    detail = f"{len(entries)} tensors from the checkpoint in {loaded - start:.2f} s, hashed in {hashed:.2f} s"
    return Filled(arena, manifest, keyed, detail)


def _copy_tensors(
    source: ArenaSource,
    arena: ExportedArena,
    by_name: dict[str, arena_layout.TensorEntry],
    stopping: Callable[[], bool],
) -> None:
    """Copy every tensor ``source`` produces into its slot; each one exactly once, with its slot's shape and dtype."""
    if source.device.type == "cuda":
        arena.tensor.zero_()  # padding between tensors is hashed: make it deterministic
    filled: set[str] = set()
    for name, tensor in source.tensors():
        if stopping():
            raise Interrupted("stopped by a signal while loading")
        entry = by_name.get(name)
        if entry is None or tensor.shape != entry.shape or tensor.dtype != ARENA_DTYPES[entry.dtype]:
            # copy_ would broadcast or cast silently, and engines would compute with the result
            expected = f"{list(entry.shape)} {entry.dtype}" if entry else "no such tensor"
            raise BindingError(
                f"pipeline produced {name!r} as {list(tensor.shape)} {tensor.dtype}, the arena expects {expected}"
            )
        arena_layout.view(arena.tensor, entry).copy_(tensor)
        filled.add(name)
    if filled != by_name.keys():
        raise RuntimeError(f"pipeline did not produce {sorted(by_name.keys() - filled)[:3]}")
    if source.device.type == "cuda":
        torch.cuda.synchronize(source.device)


@dataclass
class Client:
    pid: int
    uid: int
    conn: socket.socket = field(repr=False)
    connected_at: float = field(default_factory=time.time)
    attached: bool = False


class AlreadyRunning(ConfigError):
    """Another daemon holds this socket's lock."""


class Interrupted(HotweightsError):
    """SIGTERM or SIGINT arrived before the daemon was serving."""


class NoSource(ConfigError):
    """Every fill source the daemon was allowed refused (e.g. ``--fill-from snapshot`` and a stale snapshot)."""


class CacheDaemon:
    """Owns one arena for one source and serves it on one socket."""

    def __init__(
        self,
        source: ArenaSource,
        paths: DaemonPaths,
        *,
        backend: str,
        allowed_uids: frozenset[int],
        request_timeout: float = REQUEST_TIMEOUT_S,
        max_connections: int = MAX_CONNECTIONS,
        fill_from: tuple[str, ...] = FILL_SOURCES,
        snapshot: Path | None = None,
        kv_retain_s: float = KV_RETAIN_S,
        seed: SeedOptions = SeedOptions(),  # noqa: B008 (frozen)
    ) -> None:
        if len(os.fsencode(paths.socket)) > MAX_SOCKET_PATH:
            raise ConfigError(f"socket path {paths.socket} is longer than {MAX_SOCKET_PATH} bytes")
        self.source = source
        self.paths = paths
        self.backend = get_backend(backend)
        self.allowed_uids = allowed_uids
        self.request_timeout = request_timeout
        self.max_connections = max_connections
        self.fingerprint = source.fingerprint
        self.started_at = time.time()
        self.arena: ExportedArena | None = None
        self.manifest: dict[str, Any] = {}
        self.fill_from = fill_from
        self.snapshot = snapshot
        self.fill_report: dict[str, Any] = {}
        self._fillers: dict[str, Callable[[], Filled]] = {
            "readopt": self._readopt,
            "peer": self._fill_from_peer,
            "snapshot": self._fill_from_snapshot,
            "disk": self.load,
        }
        self.seed, self.seeder = seed, None  # SeedServer once bound (--seed-listen)
        self.clients: dict[int, Client] = {}
        self.kv = KvDeposits(self.backend, source.device, kv_retain_s)
        self._clients_lock = threading.Lock()
        self._should_exit = threading.Event()
        self._lock = PidLock(paths.lock)
        self._listener: socket.socket | None = None
        self._published: Path | None = None  # our link in the runtime dir, if we made one
        self._handlers: dict[str, Callable[[dict[str, Any]], tuple[dict[str, Any], list[int]]]] = {
            "hello": self.handle_hello,
            "attach": self.handle_attach,
            "status": self.handle_status,
        }

    # -- lifecycle ---------------------------------------------------------------------------

    def run(self) -> None:
        """Load, serve until asked to stop, clean up. Signals only set a flag."""
        ensure_private_dir(self.paths.socket.parent, shared=self.admits_other_uids)
        if self.admits_other_uids and self.source.device.type == "cuda":
            log.warning(
                "uid(s) %s may attach to this %s arena: on CUDA an importer that asks the driver for read-write "
                "access gets it (docs/operations.md), so allow only uids you trust with the weights",
                sorted(self.allowed_uids - {os.getuid()}), self.backend.name,
            )  # fmt: skip
        self._take_lock()
        try:
            check_socket_path_free(self.paths.socket)  # before the (slow) load, not after it
            self.seeder = SeedServer.bind(self.seed) if self.seed.listen else None
            self.fill()
            self._bind()
            self._write_ready()
            self._published = publish(self.paths, self.source.device, self.fingerprint.digest())
            if self.seeder is not None:
                self.seeder.serve(self.fingerprint, self.manifest, self.arena.tensor)
            log.info(
                "serving %d tensors (%.2f GB, %s) on %s; fingerprint %s",
                len(self.manifest["tensors"]),
                self.arena.nbytes / 1e9,
                self.backend.name,
                self.paths.socket,
                self.fingerprint.digest(),
            )
            self._accept_loop()
        finally:
            self._cleanup()

    @property
    def admits_other_uids(self) -> bool:
        return bool(self.allowed_uids - {os.getuid()})

    def request_exit(self, *_: object) -> None:
        self._should_exit.set()

    def fill(self) -> None:
        """Fill the arena from the first source of ``fill_from`` that passes its checks: re-adoption from a live
        engine, a processed snapshot, the checkpoint. ``fill_report`` (in ``status``) says which and how long;
        NoSource when none could."""
        passed_over = []
        read_before = disk_read_bytes()
        for name in self.fill_from:
            start = time.perf_counter()
            try:
                filled = self._fillers[name]()
            except SourceRefused as exc:
                skipped = isinstance(exc, SourceSkipped)
                log.log(logging.INFO if skipped else logging.WARNING, "not filled from %s: %s", name, exc)
                passed_over.append(f"{name}: {exc}")
                continue
            self._serve_filled(name, filled, time.perf_counter() - start, disk_read_bytes() - read_before, passed_over)
            return
        raise NoSource(f"nothing to serve, every source in {list(self.fill_from)} refused: {'; '.join(passed_over)}")

    def _serve_filled(self, name: str, filled: Filled, seconds: float, read: int, passed_over: list[str]) -> None:
        """Freeze ``filled`` (``ExportedArena.freeze``), serve it, record it for a successor (a failure to record
        only costs that). A new allocation gets a new ``arena_id``; a re-adopted one keeps the recorded one."""
        filled.arena.freeze()
        if name != "readopt":
            filled = replace(filled, manifest=filled.manifest | {"arena_id": secrets.token_hex(16)})
        self.arena, self.manifest = filled.arena, filled.manifest
        self.fill_report = {
            "source": name,
            "seconds": round(seconds, 4),
            "disk_read_bytes": read,
            "detail": filled.detail,
            "passed_over": passed_over,
        }
        log.info("filled from %s in %.1f ms, %d bytes read from disk: %s", name, seconds * 1e3, read, filled.detail)
        if self.backend.adoptable:
            try:
                write_record(self.paths.record, filled)
            except OSError as exc:
                log.warning("cannot record the arena in %s (a successor will load again): %s", self.paths.record, exc)

    def _readopt(self) -> Filled:
        return readopt(self.paths.record, self.fingerprint, self.backend, self.source.device, self.allowed_uids)

    def _fill_from_peer(self) -> Filled:
        return seed_arena(self.seed, self.fingerprint, self.backend, self.source.device, self.paths.seeding)

    def _fill_from_snapshot(self) -> Filled:
        if self.snapshot is None:
            raise SourceSkipped("no --snapshot given")
        source = self.source
        return load_snapshot(self.snapshot, self.fingerprint, self.backend, source.device, direct_io=source.direct_io)

    def load(self) -> Filled:
        """Run the load pipeline (the checkpoint's bytes from disk) into a new arena."""
        return load_arena(self.source, self.backend, self._should_exit.is_set)

    def _take_lock(self) -> None:
        try:
            self._lock.acquire()
        except LockHeld as held:
            raise AlreadyRunning(
                f"another daemon (pid {held.holder}) is starting or serving {self.paths.socket}; "
                "stop it first or pass a different --socket"
            ) from None

    def _bind(self) -> None:
        """We hold the lock, so a leftover socket nobody listens on, or a marker, is stale: remove and
        bind fresh. Anything else at the socket path is refused (``check_socket_path_free``)."""
        check_socket_path_free(self.paths.socket)
        for stale in (self.paths.socket, self.paths.ready):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        # Other allowed uids need to open the socket; SO_PEERCRED then decides who may talk to us.
        old_umask = os.umask(0o111 if self.admits_other_uids else 0o177)
        try:
            listener.bind(str(self.paths.socket))
        finally:
            os.umask(old_umask)
        listener.listen(LISTEN_BACKLOG)
        listener.settimeout(0.2)
        self._listener = listener

    def _write_ready(self) -> None:
        marker = {
            "pid": os.getpid(),
            "socket": str(self.paths.socket),
            "fingerprint_digest": self.fingerprint.digest(),
            "started_at": self.started_at,
        }
        tmp = self.paths.ready.with_suffix(".ready.tmp")
        tmp.write_text(json.dumps(marker))
        tmp.replace(self.paths.ready)

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._should_exit.is_set():
            self.kv.expire()
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:  # EMFILE, ENFILE, ECONNABORTED...: keep serving, retry shortly
                log.warning("accept on %s failed: %s", self.paths.socket, exc)
                self._should_exit.wait(ACCEPT_BACKOFF_S)
                continue
            client = self._admit(conn)
            if client is not None:
                threading.Thread(target=self._serve_connection, args=(client,), daemon=True).start()

    def _admit(self, conn: socket.socket) -> Client | None:
        """Register ``conn``; at the cap, shed the connection that has waited longest for a request (or,
        when every slot is an attached engine, refuse this one). None when ``conn`` is not served."""
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        client = Client(pid=pid, uid=uid, conn=conn)
        with self._clients_lock:
            if len(self.clients) >= self.max_connections:
                waiting = [c for c in self.clients.values() if not c.attached]
                if not waiting:
                    log.warning("refused pid %d: all %d connections are attached engines", pid, self.max_connections)
                    self._reply(conn, error_reply("busy", f"all {self.max_connections} connections are in use"))
                    conn.close()
                    return None
                slowest = min(waiting, key=lambda c: c.connected_at)
                log.warning(
                    "%d connections open: shedding pid %d, waiting %.1f s",
                    len(self.clients),
                    slowest.pid,
                    time.time() - slowest.connected_at,
                )
                del self.clients[id(slowest.conn)]
                with contextlib.suppress(OSError):
                    slowest.conn.shutdown(socket.SHUT_RDWR)  # its thread sees EOF and ends
            self.clients[id(conn)] = client
        return client

    def _cleanup(self) -> None:
        """Close and remove what we made; a path we never bound (maybe someone else's) is left alone."""
        unpublish(self._published, self.paths.socket)
        if self.seeder is not None:
            self.seeder.close()
        if self._listener is not None:
            self._listener.close()
            for path in (self.paths.ready, self.paths.socket):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        self.kv.close()
        if self.arena is not None:
            self.arena.close()
        self._lock.release()
        log.info("stopped; socket and ready marker removed" if self._listener is not None else "stopped")

    # -- one connection ----------------------------------------------------------------------

    def _serve_connection(self, client: Client) -> None:
        conn = client.conn
        try:
            with conn:
                if client.uid not in self.allowed_uids:
                    log.warning("refused connection from pid %d: uid %d is not allowed", client.pid, client.uid)
                    with contextlib.suppress(ProtocolError, OSError):  # read its request, so it sees our reply
                        recv_message(conn, deadline=time.monotonic() + self.request_timeout)
                    self._reply(conn, error_reply("forbidden", f"uid {client.uid} may not use this cache"))
                    return
                self._converse(conn, client)
        finally:
            self.kv.connection_closed(id(conn))
            with self._clients_lock:
                if self.clients.get(id(conn)) is client:
                    del self.clients[id(conn)]

    def _converse(self, conn: socket.socket, client: Client) -> None:
        """Answer requests until the peer leaves or errs. Each whole request has a deadline, except
        that an attached engine may stay silent for its whole life."""
        while not self._should_exit.is_set():
            conn.settimeout(None)
            deadline = None if client.attached else time.monotonic() + self.request_timeout
            try:
                request, fds = recv_message(conn, max_fds=2 if client.attached else 0, deadline=deadline)
            except PeerClosed:
                return
            except TimeoutError:
                self._reply(conn, error_reply("bad_message", f"no request within {self.request_timeout:.0f} s"))
                return
            except (ProtocolError, OSError) as exc:
                self._reply(conn, error_reply("bad_message", str(exc)))
                return
            kv = request.get("op") in KV_OPS
            if kv:
                reply, fds = self._kv(client, request, fds)
            else:
                close_all(fds)
                reply, fds = self._dispatch(request)
            sent = self._reply(conn, reply, fds)
            if kv:
                close_all(fds)  # duplicates, ours once sent
            if not sent or not (reply["ok"] or kv):
                return  # a refused KV request leaves the engine attached
            if request.get("op") == "attach":
                client.attached = True
                log.info("pid %d attached", client.pid)

    def _kv(self, client: Client, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        """A KV deposit request (``cache.kvdeposits``): only from an attached engine, which passed the fingerprint."""
        if not client.attached:
            close_all(fds)
            return error_reply("forbidden", f"{request['op']} needs an attached connection"), []
        return self.kv.handle(id(client.conn), request, fds)

    def _dispatch(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        op = request.get("op")
        handler = self._handlers.get(op) if isinstance(op, str) else None
        if handler is None:
            return error_reply("unknown_op", f"unknown op {op!r}; expected one of {sorted(self._handlers)}"), []
        try:
            return handler(request)
        except Exception:  # a bug must cost one connection, not the daemon
            log.exception("handler for %r failed: this is a bug, please report it", op)
            return error_reply("bad_message", f"internal error handling {op!r}"), []

    def _reply(self, conn: socket.socket, reply: dict[str, Any], fds: list[int] | None = None) -> bool:
        try:
            send_message(conn, reply, fds or [], deadline=time.monotonic() + self.request_timeout)
            return True
        except OSError as exc:
            log.debug("could not reply: %s", exc)
            return False

    # -- requests ----------------------------------------------------------------------------

    def handle_hello(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        if not is_our_version(request.get("version")):
            return _version_mismatch(request), []
        return {
            "ok": True,
            "version": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "fingerprint_digest": self.fingerprint.digest(),
        }, []

    def handle_attach(self, request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        if not is_our_version(request.get("version")):
            return _version_mismatch(request), []
        try:
            expected = Fingerprint.from_json(request.get("fingerprint"))
        except ValueError as exc:
            return error_reply("bad_message", f"attach: {exc}"), []
        differences = self.fingerprint.differences(expected)
        if differences:
            return error_reply(
                "fingerprint_mismatch",
                f"refusing attach: {describe_differences(differences)}",
                differences=[list(d) for d in differences],
            ), []
        assert self.arena is not None
        handle, fds = self.arena.export()
        return {"ok": True, "version": PROTOCOL_VERSION, "manifest": self.manifest, "handle": handle}, fds

    def handle_status(self, _request: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        with self._clients_lock:
            clients = [
                {
                    "pid": c.pid,
                    "uid": c.uid,
                    "attached": c.attached,
                    "connected_s": round(time.time() - c.connected_at, 3),
                }
                for c in self.clients.values()
            ]
        status = {
            "pid": os.getpid(),
            "socket": str(self.paths.socket),
            "fingerprint": self.fingerprint.to_json(),
            "fingerprint_digest": self.fingerprint.digest(),
            "backend": self.backend.name,
            "device": self.manifest["device"],
            "bytes": self.manifest["used_bytes"],
            "arena_bytes": self.manifest["arena_bytes"],
            "tensors": len(self.manifest["tensors"]),
            "content_hash": self.manifest["content_hash"],
            "arena_id": self.manifest.get("arena_id"),
            "uptime_s": round(time.time() - self.started_at, 3),
            "fill": self.fill_report,
            "clients": clients,
            "kv_deposits": self.kv.status(),
            "seeding": self.seeder.status() if self.seeder is not None else None,
        }
        return {"ok": True, "status": status}, []


def _version_mismatch(request: dict[str, Any]) -> dict[str, Any]:
    return error_reply(
        "version_mismatch", f"daemon speaks protocol {PROTOCOL_VERSION}, client sent {request.get('version')!r}"
    )


def serve(
    source: ArenaSource, paths: DaemonPaths, *, backend: str, allowed_uids: frozenset[int], **options: Any
) -> None:
    """Run a daemon for ``source`` in this process until SIGTERM or SIGINT; ``options``: CacheDaemon's."""
    daemon = CacheDaemon(source, paths, backend=backend, allowed_uids=allowed_uids, **options)
    previous = {sig: signal.signal(sig, daemon.request_exit) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        daemon.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
