"""A connection to a weight cache daemon we trust, and its one-shot requests (hello, status), without torch.

The checks before a byte is exchanged (docs/operations.md, "Trust model"): the socket and its directory are owned
by a trusted uid (ours or root) and nobody else can write the directory; the peer's SO_PEERCRED uid is trusted;
every reply is well-typed (``ok`` a bool) and, for ``hello``, of our protocol version. Every exchange has one
whole-reply deadline. The engine's attach (``cache.client``) builds on these; the controller uses them alone.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import stat
import struct
import time
from pathlib import Path
from typing import Any

from hotweights.cache.protocol import (
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
        pid, uid = peer(conn)
    except OSError as exc:
        conn.close()
        raise DaemonUnavailable(f"no weight cache daemon answers on {socket_path}: {exc.strerror or exc}") from None
    if uid not in trusted:
        conn.close()
        raise AttachRefused(
            f"the process serving {socket_path} (pid {pid}) runs as uid {uid}; engines trust uids {sorted(trusted)}"
        )
    return conn


def peer(conn: socket.socket) -> tuple[int, int]:
    """The pid and uid of the process on the other end of ``conn``, as the kernel recorded them when it listened
    (SO_PEERCRED; pid 0 when that process is in a pid namespace we cannot see into)."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


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
    conn: socket.socket,
    request: dict[str, Any],
    max_fds: int = 0,
    deadline: float | None = None,
    fds: tuple[int, ...] = (),
) -> tuple[dict[str, Any], list[int]]:
    """One request (with ``fds``, which stay the caller's), one whole reply before ``deadline`` (default: the
    socket's timeout from now). Daemon-side refusals are returned (``ok`` is then exactly False); transport
    failures raised."""
    if deadline is None:
        deadline = time.monotonic() + (conn.gettimeout() or CONNECT_TIMEOUT_S)
    send_request(conn, request, deadline, fds)
    return receive_reply(conn, request.get("op"), max_fds, deadline)


def send_request(conn: socket.socket, request: dict[str, Any], deadline: float, fds: tuple[int, ...] = ()) -> None:
    """Send ``request`` (with ``fds``) before ``deadline``; DaemonUnavailable when it cannot be."""
    try:
        send_message(conn, request, fds, deadline=deadline)
    except (TimeoutError, OSError) as exc:
        raise DaemonUnavailable(f"weight cache daemon took no {request.get('op')!r} request: {exc}") from None


def receive_reply(conn: socket.socket, op: object, max_fds: int, deadline: float) -> tuple[dict[str, Any], list[int]]:
    """The reply to ``op``, whole before ``deadline``, well-typed (its fds are closed when it is not);
    DaemonUnavailable otherwise."""
    try:
        reply, received = recv_message(conn, max_fds=max_fds, deadline=deadline)
    except TimeoutError:
        raise DaemonUnavailable(f"weight cache daemon sent no whole reply to {op!r} in time") from None
    except (ProtocolError, OSError) as exc:
        raise DaemonUnavailable(f"weight cache daemon stopped answering during {op!r}: {exc}") from None
    try:
        reply_ok(reply)
    except ProtocolError as exc:
        close_all(received)
        raise DaemonUnavailable(f"weight cache daemon sent a malformed reply to {op!r}: {exc}") from None
    return reply, received


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


def close_all(fds: list[int]) -> None:
    """Close every fd a reply passed us (one we will not use)."""
    for fd in fds:
        os.close(fd)
