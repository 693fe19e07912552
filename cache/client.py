"""The engine's side of the weight cache: attach to a daemon's arena and get zero-copy views.

What happens when the cache cannot be used is the caller's choice (``standby.weights``):

| situation                          | raised here          | engine with --weight-cache-fallback disk |
| ---------------------------------- | -------------------- | ---------------------------------------- |
| no daemon on the socket            | DaemonUnavailable    | loads from disk, warns loudly            |
| daemon serves another fingerprint  | AttachRefused        | loads from disk, warns loudly            |
| daemon speaks another protocol     | AttachRefused        | loads from disk, warns loudly            |
| malformed reply, bad manifest      | DaemonUnavailable    | loads from disk, warns loudly            |

The attach connection stays open for the engine's life, so the daemon can list its clients. If the
daemon dies, the mapping stays valid (the kernel or driver refcounts the memory) and nothing here
reacts: an engine must never kill itself because its daemon went away.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from hotweights.cache import arena as arena_layout
from hotweights.cache.backends import get_backend
from hotweights.cache.backends.base import BackendUnavailable, ImportedArena
from hotweights.cache.fingerprint import Fingerprint
from hotweights.cache.protocol import MAX_FDS, PROTOCOL_VERSION, ProtocolError, recv_message, send_message

from hotweights.errors import HotweightsError

CONNECT_TIMEOUT_S = 10.0


class DaemonUnavailable(HotweightsError):
    """No daemon answers on the socket, or it answered with something unusable."""


class AttachRefused(HotweightsError):
    """The daemon refused: ``differences`` lists (field, daemon's value, engine's value)."""

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

    @property
    def content_hash(self) -> str:
        return self.manifest["content_hash"]

    def close(self) -> None:
        """Drop the views, unmap, and hang up (the daemon then stops listing us)."""
        self.tensors.clear()
        self.arena.close()
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def connect(socket_path: str | Path, timeout: float = CONNECT_TIMEOUT_S) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    conn.settimeout(timeout)
    try:
        conn.connect(str(socket_path))
    except OSError as exc:
        conn.close()
        raise DaemonUnavailable(f"no weight cache daemon answers on {socket_path}: {exc.strerror or exc}") from None
    return conn


def call(conn: socket.socket, request: dict[str, Any], max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    """One request, one reply; daemon-side refusals are returned, transport failures raised."""
    try:
        send_message(conn, request)
        return recv_message(conn, max_fds=max_fds)
    except (ProtocolError, OSError) as exc:
        raise DaemonUnavailable(f"weight cache daemon stopped answering during {request.get('op')!r}: {exc}") from None


def request(socket_path: str | Path, message: dict[str, Any], timeout: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:
    """A one-shot request (hello, status) on a fresh connection."""
    with connect(socket_path, timeout) as conn:
        reply, _ = call(conn, message)
    return reply


def hello(socket_path: str | Path, timeout: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:
    reply = request(socket_path, {"op": "hello", "version": PROTOCOL_VERSION}, timeout)
    if not reply.get("ok"):
        raise AttachRefused(f"daemon on {socket_path}: {reply.get('message')}")
    return reply


def attach(
    socket_path: str | Path,
    expected: Fingerprint,
    device: torch.device | str,
    timeout: float = CONNECT_TIMEOUT_S,
) -> Attachment:
    """Attach to the arena on ``socket_path`` if the daemon's fingerprint equals ``expected``."""
    start = time.perf_counter()
    device = torch.device(device)
    conn = connect(socket_path, timeout)
    try:
        reply, fds = call(
            conn, {"op": "attach", "version": PROTOCOL_VERSION, "fingerprint": expected.to_json()}, max_fds=MAX_FDS
        )
        if not reply.get("ok"):
            differences = [tuple(d) for d in reply.get("differences", [])]
            raise AttachRefused(f"daemon on {socket_path}: {reply.get('message')}", differences)
        imported = _import(reply, fds, device)
        try:
            entries = _entries(reply["manifest"], imported.nbytes)
            tensors = arena_layout.views(imported.tensor, entries)
        except (KeyError, TypeError, ValueError) as exc:
            imported.close()
            raise DaemonUnavailable(f"daemon on {socket_path} sent a bad manifest: {exc}") from None
    except BaseException:
        conn.close()
        raise
    conn.settimeout(None)
    return Attachment(tensors, reply["manifest"], imported, time.perf_counter() - start, conn)


def _import(reply: dict[str, Any], fds: list[int], device: torch.device) -> ImportedArena:
    handle = reply.get("handle")
    if not isinstance(handle, dict) or not isinstance(handle.get("backend"), str):
        for fd in fds:
            os.close(fd)
        raise DaemonUnavailable("daemon sent an attach reply without a backend handle")
    try:
        backend = get_backend(handle["backend"])
    except BackendUnavailable as exc:  # import_arena never took ownership of the fds
        for fd in fds:
            os.close(fd)
        raise DaemonUnavailable(f"cannot map the {handle['backend']} arena here: {exc}") from None
    try:
        return backend.import_arena(handle, fds, device)
    except (BackendUnavailable, ValueError) as exc:
        raise DaemonUnavailable(f"cannot map the {handle['backend']} arena here: {exc}") from None


def _entries(manifest: dict[str, Any], arena_nbytes: int) -> list[arena_layout.TensorEntry]:
    return [arena_layout.TensorEntry.from_json(row, arena_nbytes) for row in manifest["tensors"]]
