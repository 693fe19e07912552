"""The engine's side of the weight cache: attach to a daemon's arena and get zero-copy views.

An engine believes a daemon only after checking, before it maps a byte (docs/operations.md, "Trust
model"): the connection passes ``cache.connection``'s checks (socket, directory and peer uid trusted;
the reply well-typed, ``version`` our int); the manifest's fingerprint equals ours field by field;
every manifest row fits (known dtype, non-negative dims, aligned offset, nbytes == numel * itemsize,
inside the arena, no overlaps); the handle's size equals the manifest's; the backend checks the fd
itself (cpu-shm: a memfd with the shrink, grow, write and seal seals, of exactly that size); the mapped
bytes have the manifest's content hash, recomputed here the first time this host's engines meet the arena and
remembered for it after (``cache.verified``). Every exchange has one whole-reply deadline.

What happens when the cache cannot be used is the caller's choice (``standby.weights``):

| situation                                         | raised here       | with --weight-cache-fallback disk |
| ------------------------------------------------- | ----------------- | --------------------------------- |
| no daemon on the socket, no reply by the deadline | DaemonUnavailable | loads from disk, warns loudly     |
| malformed reply (``ok`` not a bool, bad frame)    | DaemonUnavailable | loads from disk, warns loudly     |
| untrusted socket, directory or peer uid           | AttachRefused     | loads from disk, warns loudly     |
| another fingerprint (daemon's or manifest's)      | AttachRefused     | loads from disk, warns loudly     |
| another protocol version                          | AttachRefused     | loads from disk, warns loudly     |
| bad manifest, wrong fd type, size or seals        | AttachRefused     | loads from disk, warns loudly     |
| bytes whose content hash is not the manifest's    | AttachRefused     | loads from disk, warns loudly     |

The attach connection stays open for the engine's life, so the daemon can list its clients. If the
daemon dies, the mapping stays valid (the kernel or driver refcounts the memory) and nothing here
reacts: an engine must never kill itself because its daemon went away.
"""

from __future__ import annotations

import enum
import fcntl
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hotweights.cache import arena as arena_layout
from hotweights.cache.arena import TensorEntry
from hotweights.cache.backends import get_backend
from hotweights.cache.backends.base import BackendUnavailable, ImportedArena
from hotweights.cache.connection import (
    CONNECT_TIMEOUT_S,
    AttachRefused,
    DaemonUnavailable,
    call,
    close_all,
    connect,
    peer,
    receive_reply,
    request,
    send_request,
    trusted_daemon_uids,
)
from hotweights.cache.digest import content_hash
from hotweights.cache.fingerprint import Fingerprint, describe_differences
from hotweights.cache.handover import HandoverOffer, offer_path
from hotweights.cache.protocol import MAX_FDS, PROTOCOL_VERSION, ProtocolError, check_version
from hotweights.cache.verified import VerifiedArenas, served_arena
from hotweights.spawn import readable

log = logging.getLogger(__name__)


class ReplyLate(DaemonUnavailable):
    """No byte of a reply came in time on the attach connection, which stays open for it (``Attachment.call``)."""


class ContentCheck(enum.Enum):
    """How an attach knows the mapped bytes are the ones the manifest describes (their content hash)."""

    HASHED = "hashed by this attach"
    REMEMBERED = "hashed by an earlier attach on this host"
    LEFT_TO_CALLER = "left to the caller"


@dataclass
class Attachment:
    """Zero-copy views of the daemon's arena. Keep it alive as long as the tensors are used."""

    tensors: dict[str, torch.Tensor]
    manifest: dict[str, Any]
    arena: ImportedArena
    seconds: float
    _conn: socket.socket | None = field(default=None, repr=False)
    handover: HandoverOffer | None = field(default=None, repr=False)  # offers the arena to a successor daemon
    parts: dict[str, float] = field(default_factory=dict)  # ms of the attach's steps: reply, map, digest, offer
    socket_path: Path | None = None  # the daemon's
    content: ContentCheck = ContentCheck.LEFT_TO_CALLER  # how the bytes were checked against the manifest
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # one request at a time on _conn
    _late: bool = field(default=False, repr=False)  # whether the daemon owes us a reply (``call``)

    @property
    def backend(self) -> str:
        """The arena's backend (``cache.backends``)."""
        return self.manifest["backend"]

    def call(
        self, message: dict[str, Any], fds: tuple[int, ...] = (), max_fds: int = 0, timeout: float = CONNECT_TIMEOUT_S
    ) -> tuple[dict[str, Any], list[int]]:
        """One request on the attach connection (the KV deposits of ``cache.kvdeposits``), its reply within
        ``timeout``; DaemonUnavailable otherwise. A daemon slow for a moment does not detach the engine: when not a
        byte of the reply came in time (ReplyLate), the connection stays open and the late reply is read and dropped
        ahead of the next call's; until it has come, calls raise ReplyLate at once, without waiting. When the daemon
        is gone, or sent part of a reply, the connection is closed: later calls fail at once."""
        with self._lock:
            if self._conn is None:
                raise DaemonUnavailable("the attach connection is closed")
            deadline = time.monotonic() + timeout
            try:
                if self._late:
                    if not readable(self._conn.fileno()):
                        raise ReplyLate("weight cache daemon has not answered an earlier request yet")
                    close_all(receive_reply(self._conn, "an earlier request", MAX_FDS, deadline)[1])
                    self._late = False
                op = message.get("op")
                send_request(self._conn, message, deadline, fds)
                self._late = True
                if not readable(self._conn.fileno(), deadline - time.monotonic()):
                    raise ReplyLate(f"weight cache daemon sent no reply to {op!r} in time; it may still answer")
                reply = receive_reply(self._conn, op, max_fds, deadline)
                self._late = False
                return reply
            except ReplyLate:
                raise
            except DaemonUnavailable:
                self._conn.close()
                self._conn = None
                raise

    @property
    def waits_for_reply(self) -> bool:
        """Whether a request went unanswered in time on an open connection (``call``): the daemon may still act."""
        return self._late and self._conn is not None

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
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


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
    bytes' content hash included (``_check_content``; ``check_content`` False: the caller reports it, as
    ``cache verify`` does). With ``offer_handover``, keep the arena fd and offer it to a daemon that replaces
    this one (``cache.handover``)."""
    start = time.perf_counter()
    deadline = time.monotonic() + timeout
    device = torch.device(device)
    conn = connect(socket_path, timeout)
    kept = -1
    try:
        daemon_pid = peer(conn)[0]
        request = {"op": "attach", "version": PROTOCOL_VERSION, "fingerprint": expected.to_json()}
        reply, fds = call(conn, request, max_fds=MAX_FDS, deadline=deadline)
        try:
            entries = _checked_entries(reply, expected, socket_path)
            kept = _keep_for_handover(reply["handle"], fds) if offer_handover else -1
        except BaseException:
            close_all(fds)
            raise
        replied = time.perf_counter()
        imported = _import(reply, fds, device, socket_path)
        try:
            mapped = time.perf_counter()
            content = ContentCheck.LEFT_TO_CALLER
            if check_content:
                content = _check_content(imported, reply["manifest"], daemon_pid, socket_path)
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
    path = Path(socket_path)
    return Attachment(tensors, reply["manifest"], imported, end - start, conn, offer, parts, path, content=content)


def _check_content(
    imported: ImportedArena, manifest: dict[str, Any], daemon_pid: int, socket_path: str | Path
) -> ContentCheck:
    """AttachRefused unless the mapped bytes have the manifest's content hash: recomputed here, on the arena's
    device (at the memory bus's speed on a GPU), from our own mapping, so a daemon cannot serve other bytes
    (zeros, another model's) under a manifest that describes the real ones. Once per arena and host: an arena
    an engine of ours hashed before, served by the same daemon process, is taken from its record
    (``cache.verified``); a record is written after a hash that matched."""
    recorded = manifest["content_hash"]
    arena = served_arena(daemon_pid, manifest, imported.identity())
    remembered = VerifiedArenas()
    if arena is not None and remembered.vouches(arena, recorded):
        return ContentCheck.REMEMBERED
    actual = content_hash(imported.tensor, manifest["used_bytes"])
    if actual != recorded:
        raise AttachRefused(
            f"daemon on {socket_path} serves an arena whose content hash is {actual}, but its manifest says "
            f"{str(recorded)[:80]}: its bytes are not the ones it describes"
        )
    if arena is not None:
        remembered.remember(arena, actual)
    return ContentCheck.HASHED


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
        close_all(fds)
        raise DaemonUnavailable(f"cannot map the {name} arena here: {exc}") from None
    try:
        return backend.import_arena(reply["handle"], fds, device)
    except BackendUnavailable as exc:
        raise DaemonUnavailable(f"cannot map the {name} arena here: {exc}") from None
    except ValueError as exc:
        raise AttachRefused(f"daemon on {socket_path} sent an arena we refuse to map: {exc}") from None
