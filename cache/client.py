"""The engine's side of the weight cache: attach to a daemon's arena and get zero-copy views.

An engine believes a daemon only after checking, before it maps a byte (docs/operations.md, "Trust
model"): the socket and its directory are owned by a trusted uid (ours or root) and nobody else can
write the directory; the peer's SO_PEERCRED uid is trusted; the reply is well-typed (``ok`` a bool,
``version`` our int); the manifest's fingerprint equals ours field by field; every manifest row fits
(known dtype, non-negative dims, aligned offset, nbytes == numel * itemsize, inside the arena, no
overlaps); the handle's size equals the manifest's; the backend checks the fd itself (cpu-shm: a
memfd with the shrink, grow, write and seal seals, of exactly that size). Every exchange has one
whole-reply deadline.

What happens when the cache cannot be used is the caller's choice (``standby.weights``):

| situation                                         | raised here       | with --weight-cache-fallback disk |
| ------------------------------------------------- | ----------------- | --------------------------------- |
| no daemon on the socket, no reply by the deadline | DaemonUnavailable | loads from disk, warns loudly     |
| malformed reply (``ok`` not a bool, bad frame)    | DaemonUnavailable | loads from disk, warns loudly     |
| untrusted socket, directory or peer uid           | AttachRefused     | loads from disk, warns loudly     |
| another fingerprint (daemon's or manifest's)      | AttachRefused     | loads from disk, warns loudly     |
| another protocol version                          | AttachRefused     | loads from disk, warns loudly     |
| bad manifest, wrong fd type, size or seals        | AttachRefused     | loads from disk, warns loudly     |

The attach connection stays open for the engine's life, so the daemon can list its clients. If the
daemon dies, the mapping stays valid (the kernel or driver refcounts the memory) and nothing here
reacts: an engine must never kill itself because its daemon went away.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hotweights.cache import arena as arena_layout
from hotweights.cache.arena import TensorEntry
from hotweights.cache.backends import get_backend
from hotweights.cache.backends.base import BackendUnavailable, ImportedArena
from hotweights.cache.digest import content_hash
from hotweights.cache.fingerprint import Fingerprint, describe_differences
from hotweights.cache.handover import HandoverOffer, offer_path
from hotweights.cache.protocol import (
    MAX_FDS,
    PROTOCOL_VERSION,
    ProtocolError,
    check_version,
    recv_message,
    reply_ok,
    send_message,
)
from hotweights.errors import HotweightsError

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0  # one deadline for connect, request and the whole reply
CONNECT_RETRY_FIRST_S = 0.005  # the first pause after a refused connect; doubles up to CONNECT_RETRY_MAX_S
CONNECT_RETRY_MAX_S = 0.2


class DaemonUnavailable(HotweightsError):
    """No daemon answers on the socket, or it answered with something unusable."""


class AttachRefused(HotweightsError):
    """The daemon refused, or we refuse the daemon: ``differences`` lists (field, daemon's value,
    engine's value) when fingerprints differ."""

    def __init__(self, message: str, differences: list[tuple[str, Any, Any]] | None = None) -> None:
        super().__init__(message)
        self.differences = differences or []


@dataclass
class Attachment:
    """Zero-copy views of the daemon's arena. Keep it alive as long as the tensors are used."""

    tensors: dict[str, torch.Tensor]
    manifest: dict[str, Any]
    arena: ImportedArena
    seconds: float
    _conn: socket.socket | None = field(default=None, repr=False)
    handover: HandoverOffer | None = field(default=None, repr=False)  # offers the arena to a successor daemon
    parts: dict[str, float] = field(default_factory=dict)  # ms of the attach's steps: reply, map, offer
    socket_path: Path | None = None  # the daemon's

    @property
    def content_hash(self) -> str:
        return self.manifest["content_hash"]

    def still_served(self, timeout: float = CONNECT_TIMEOUT_S) -> bool:
        """Whether the daemon on our socket serves the very allocation we map (the same ``arena_id``: one
        re-adopted from us or our peers is, a new fill is not). DaemonUnavailable or AttachRefused when no daemon
        we trust answers."""
        assert self.socket_path is not None
        arena = self.manifest.get("arena_id")
        status = request(self.socket_path, {"op": "status"}, timeout)["status"]
        return arena is not None and status.get("arena_id") == arena

    def verify(self) -> str:
        """Recompute the content hash of the mapped bytes (a full read, on the arena's device)."""
        return content_hash(self.arena.tensor, self.manifest["used_bytes"])

    def close(self) -> None:
        """Stop offering the arena, drop the views, unmap, and hang up (the daemon then stops listing us)."""
        if self.handover is not None:
            self.handover.close()
            self.handover = None
        self.tensors.clear()
        self.arena.close()
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def trusted_daemon_uids() -> frozenset[int]:
    """Whose daemons an engine believes: its own uid's, and root's (root can read our memory anyway)."""
    return frozenset({os.getuid(), 0})


def check_socket_path(socket_path: Path, trusted: frozenset[int], *, follow: bool = True) -> None:
    """AttachRefused unless ``socket_path`` is a socket owned by a trusted uid, in a directory owned by
    a trusted uid that no one else can write to (else someone could replace the socket). A symbolic
    link (the name a daemon publishes in the runtime dir, ``cache.paths.publish``) must pass the same
    checks itself, and so must the socket it names (one link, no chains)."""
    try:
        info = os.lstat(socket_path)
        folder = os.stat(socket_path.parent)
    except OSError as exc:
        raise DaemonUnavailable(f"no weight cache daemon answers on {socket_path}: {exc.strerror}") from None
    if info.st_uid not in trusted:
        raise AttachRefused(f"socket {socket_path} is owned by uid {info.st_uid}; engines trust uids {sorted(trusted)}")
    mode = stat.S_IMODE(folder.st_mode)
    if folder.st_uid not in trusted or mode & 0o022:
        raise AttachRefused(
            f"socket directory {socket_path.parent} (uid {folder.st_uid}, mode {mode:o}) must be owned by uid "
            f"{sorted(trusted)} and not writable by group or others, or anyone could replace the socket"
        )
    if stat.S_ISLNK(info.st_mode) and follow:
        check_socket_path(socket_path.parent / os.readlink(socket_path), trusted, follow=False)
    elif not stat.S_ISSOCK(info.st_mode):
        raise AttachRefused(f"{socket_path} is not a socket: no weight cache daemon serves there")


def connect(
    socket_path: str | Path, timeout: float = CONNECT_TIMEOUT_S, trusted: frozenset[int] | None = None
) -> socket.socket:
    """A connection to a daemon we trust (socket, directory and peer uid checked; AttachRefused if not)."""
    socket_path = Path(socket_path)
    trusted = trusted_daemon_uids() if trusted is None else trusted
    check_socket_path(socket_path, trusted)
    conn = _connect_retrying(socket_path, time.monotonic() + timeout)
    try:
        pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError as exc:
        conn.close()
        raise DaemonUnavailable(f"no weight cache daemon answers on {socket_path}: {exc.strerror or exc}") from None
    if uid not in trusted:
        conn.close()
        raise AttachRefused(
            f"the process serving {socket_path} (pid {pid}) runs as uid {uid}; engines trust uids {sorted(trusted)}"
        )
    return conn


def _connect_retrying(socket_path: Path, deadline: float) -> socket.socket:
    """A connected socket with the time left to ``deadline`` as its timeout. A connect refused with EAGAIN
    (the listen backlog is full: a connect storm) is retried, backing off, until the deadline;
    DaemonUnavailable after it, or at once on any other error (ECONNREFUSED: nobody listens there)."""
    pause = CONNECT_RETRY_FIRST_S
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        conn.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            conn.connect(str(socket_path))
            return conn
        except OSError as exc:
            conn.close()
            left = deadline - time.monotonic()
            if exc.errno != errno.EAGAIN or left <= pause:
                raise DaemonUnavailable(
                    f"no weight cache daemon answers on {socket_path}: {exc.strerror or exc}"
                ) from None
            log.debug("connect to %s refused (%s): retrying in %.3f s", socket_path, exc.strerror, pause)
        time.sleep(pause)
        pause = min(pause * 2, CONNECT_RETRY_MAX_S)


def call(
    conn: socket.socket, request: dict[str, Any], max_fds: int = 0, deadline: float | None = None
) -> tuple[dict[str, Any], list[int]]:
    """One request, one whole reply before ``deadline`` (default: the socket's timeout from now).
    Daemon-side refusals are returned (``ok`` is then exactly False); transport failures raised."""
    if deadline is None:
        deadline = time.monotonic() + (conn.gettimeout() or CONNECT_TIMEOUT_S)
    op = request.get("op")
    try:
        send_message(conn, request, deadline=deadline)
        reply, fds = recv_message(conn, max_fds=max_fds, deadline=deadline)
    except TimeoutError:
        raise DaemonUnavailable(f"weight cache daemon sent no whole reply to {op!r} in time") from None
    except (ProtocolError, OSError) as exc:
        raise DaemonUnavailable(f"weight cache daemon stopped answering during {op!r}: {exc}") from None
    try:
        reply_ok(reply)
    except ProtocolError as exc:
        _close_all(fds)
        raise DaemonUnavailable(f"weight cache daemon sent a malformed reply to {op!r}: {exc}") from None
    return reply, fds


def request(socket_path: str | Path, message: dict[str, Any], timeout: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:
    """A one-shot request (hello, status) on a fresh connection, ``timeout`` for all of it."""
    deadline = time.monotonic() + timeout
    with connect(socket_path, timeout) as conn:
        reply, _ = call(conn, message, deadline=deadline)
    return reply


def hello(socket_path: str | Path, timeout: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:
    reply = request(socket_path, {"op": "hello", "version": PROTOCOL_VERSION}, timeout)
    if not reply["ok"]:
        raise AttachRefused(f"daemon on {socket_path}: {reply.get('message')}")
    try:
        check_version(reply)
    except ProtocolError as exc:
        raise AttachRefused(f"daemon on {socket_path}: {exc}") from None
    return reply


def attach(
    socket_path: str | Path,
    expected: Fingerprint,
    device: torch.device | str,
    timeout: float = CONNECT_TIMEOUT_S,
    *,
    offer_handover: bool = False,
    check_content: bool = True,
) -> Attachment:
    """Attach to the arena on ``socket_path`` if the daemon and its manifest pass every check, the mapped
    bytes' content hash included (``check_content`` False: the caller reports it, as ``cache verify`` does).
    With ``offer_handover``, keep the arena fd and offer it to a daemon that replaces this one
    (``cache.handover``)."""
    start = time.perf_counter()
    deadline = time.monotonic() + timeout
    device = torch.device(device)
    conn = connect(socket_path, timeout)
    kept = -1
    try:
        request = {"op": "attach", "version": PROTOCOL_VERSION, "fingerprint": expected.to_json()}
        reply, fds = call(conn, request, max_fds=MAX_FDS, deadline=deadline)
        try:
            entries = _checked_entries(reply, expected, socket_path)
            kept = _keep_for_handover(reply["handle"], fds) if offer_handover else -1
        except BaseException:
            _close_all(fds)
            raise
        replied = time.perf_counter()
        imported = _import(reply, fds, device, socket_path)
        try:
            mapped = time.perf_counter()
            if check_content:
                _check_content(imported.tensor, reply["manifest"], socket_path)
            tensors = arena_layout.views(imported.tensor, entries)
        except BaseException:
            imported.close()
            raise
    except BaseException:
        conn.close()
        if kept >= 0:
            os.close(kept)
        raise
    conn.settimeout(None)
    checked = time.perf_counter()
    offer = _offer(Path(socket_path), expected, reply["handle"], kept) if kept >= 0 else None
    end = time.perf_counter()
    parts = {
        "reply": (replied - start) * 1e3,
        "map": (mapped - replied) * 1e3,
        "digest": (checked - mapped) * 1e3,
        "offer": (end - checked) * 1e3,
    }
    return Attachment(tensors, reply["manifest"], imported, end - start, conn, offer, parts, Path(socket_path))


def _check_content(data: torch.Tensor, manifest: dict[str, Any], socket_path: str | Path) -> None:
    """AttachRefused unless the mapped bytes have the manifest's content hash: recomputed here, on the arena's
    device (at the memory bus's speed on a GPU), from our own mapping, so a daemon cannot serve other bytes
    (zeros, another model's) under a manifest that describes the real ones."""
    recorded = manifest.get("content_hash")
    actual = content_hash(data, manifest["used_bytes"])
    if actual != recorded:
        raise AttachRefused(
            f"daemon on {socket_path} serves an arena whose content hash is {actual}, but its manifest says "
            f"{str(recorded)[:80]}: its bytes are not the ones it describes"
        )


def _keep_for_handover(handle: dict[str, Any], fds: list[int]) -> int:
    """A duplicate of the arena fd when its backend can be re-adopted from one, else -1."""
    try:
        adoptable = get_backend(handle["backend"]).adoptable
    except BackendUnavailable:
        return -1  # _import says why
    if not adoptable:
        log.info("%s arenas cannot be re-adopted from an engine: a new daemon will load again", handle["backend"])
        return -1
    return fcntl.fcntl(fds[0], fcntl.F_DUPFD_CLOEXEC, 0) if len(fds) == 1 else -1


def _offer(socket_path: Path, expected: Fingerprint, handle: dict[str, Any], fd: int) -> HandoverOffer | None:
    """Offer the kept ``fd`` (owned from now on) beside the daemon's socket; None, with a warning, where we cannot."""
    try:
        return HandoverOffer(offer_path(socket_path, expected.digest()), expected, handle, fd, trusted_daemon_uids())
    except OSError as exc:
        os.close(fd)
        log.warning("this engine cannot offer its arena for re-adoption (a new daemon will load again): %s", exc)
        return None


def _checked_entries(reply: dict[str, Any], expected: Fingerprint, socket_path: str | Path) -> list[TensorEntry]:
    """The manifest's rows, once the reply passed every check that needs no mapping."""
    if not reply["ok"]:
        differences = reply.get("differences")
        rows = (
            [tuple(d) for d in differences if isinstance(d, list) and len(d) == 3]
            if isinstance(differences, list)
            else []
        )
        raise AttachRefused(f"daemon on {socket_path}: {reply.get('message')}", rows)
    try:
        check_version(reply)
        manifest = reply.get("manifest")
        if not isinstance(manifest, dict):
            raise ValueError("the attach reply has no manifest")
        served = Fingerprint.from_json(manifest.get("fingerprint"))
    except (ProtocolError, ValueError) as exc:
        raise AttachRefused(f"daemon on {socket_path}: {exc}") from None
    differences = served.differences(expected)
    if differences:
        raise AttachRefused(
            f"daemon on {socket_path} serves another model or config: {describe_differences(differences)}", differences
        )
    try:
        return _manifest_entries(manifest, reply.get("handle"))
    except ValueError as exc:
        raise AttachRefused(f"daemon on {socket_path} sent a manifest that does not hold together: {exc}") from None


def _manifest_entries(manifest: dict[str, Any], handle: object) -> list[TensorEntry]:
    """Strict: the manifest (``arena.manifest_entries``), the handle's backend and size; ValueError names the fault."""
    entries = arena_layout.manifest_entries(manifest)
    if not isinstance(handle, dict) or not isinstance(handle.get("backend"), str):
        raise ValueError("the attach reply has no backend handle")
    if handle.get("backend") != manifest.get("backend") or type(handle.get("nbytes")) is not int:
        raise ValueError(f"handle {handle.get('backend')!r} does not match the manifest's {manifest.get('backend')!r}")
    if handle["nbytes"] != manifest["arena_bytes"]:
        raise ValueError(f"the handle maps {handle['nbytes']} bytes, the manifest says {manifest['arena_bytes']}")
    return entries


def _import(reply: dict[str, Any], fds: list[int], device: torch.device, socket_path: str | Path) -> ImportedArena:
    """Map the arena (takes ownership of ``fds``); the backend checks the fd's type, size and seals."""
    name = reply["handle"]["backend"]
    try:
        backend = get_backend(name)
    except BackendUnavailable as exc:  # import_arena never took ownership of the fds
        _close_all(fds)
        raise DaemonUnavailable(f"cannot map the {name} arena here: {exc}") from None
    try:
        return backend.import_arena(reply["handle"], fds, device)
    except BackendUnavailable as exc:
        raise DaemonUnavailable(f"cannot map the {name} arena here: {exc}") from None
    except ValueError as exc:
        raise AttachRefused(f"daemon on {socket_path} sent an arena we refuse to map: {exc}") from None


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
