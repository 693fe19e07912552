"""Re-adoption handover: an attached engine keeps its arena fd and hands it to the daemon that replaces a dead one.

Engine side (``HandoverOffer``): after attaching, the engine keeps a duplicate of the arena fd (cpu-shm, cuda-vmm;
facts/vmm_readopt.md) and listens on its own socket beside the daemon's, named from the fingerprint digest:
``<daemon socket dir>/<digest>.<pid>-<n>.handover`` (0600, in the daemon's private directory). It answers one
request per connection, only from a peer whose SO_PEERCRED uid it trusts (its own, root, or one it was given),
only for its own fingerprint, within one deadline.

Daemon side (``offers``, ``ask``): list the offers for a fingerprint digest, ask one for its fd. The daemon
trusts nothing the engine says: ``cache.recovery`` checks the fd against the daemon's own record.

  {"op": "handover", "version": 1, "fingerprint": {...}}
      -> {"ok": true, "version": 1, "fingerprint": {...}, "handle": {"backend", "nbytes", ...}} + the arena fd
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import stat
import struct
import threading
import time
from pathlib import Path
from typing import Any

from hotweights.cache.fingerprint import Fingerprint, describe_differences
from hotweights.cache.paths import OFFER_SUFFIX
from hotweights.cache.protocol import (
    PROTOCOL_VERSION,
    ProtocolError,
    check_version,
    error_reply,
    is_our_version,
    recv_message,
    reply_ok,
    send_message,
)
from hotweights.limits import ACCEPT_BACKOFF_S, is_out_of_descriptors

log = logging.getLogger(__name__)

HANDOVER_TIMEOUT_S = 5.0  # one whole request or reply
MAX_SOCKET_PATH = 107  # sun_path is 108 bytes including the NUL
_serial = itertools.count()


class HandoverRefused(Exception):
    """An engine's offer cannot be used; the message names the engine and the reason."""


class StaleOffer(HandoverRefused):
    """Nobody listens on the offer's socket any more (its engine died)."""


def peer_uid(conn: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a Unix socket, from the kernel (SO_PEERCRED)."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def offer_path(daemon_socket: Path, digest: str) -> Path:
    """Where this process offers its arena for a daemon serving ``digest`` on ``daemon_socket``."""
    return daemon_socket.resolve().parent / f"{digest}.{os.getpid()}-{next(_serial)}{OFFER_SUFFIX}"


class HandoverOffer:
    """The engine's listener: hands a duplicate of ``fd`` (owned from now on) to a trusted daemon that asks
    for ``fingerprint``'s arena. ``close`` stops listening, removes the socket and closes the fd."""

    def __init__(
        self, path: Path, fingerprint: Fingerprint, handle: dict[str, Any], fd: int, trusted: frozenset[int]
    ) -> None:
        self.path, self.fingerprint, self.handle, self.trusted = path, fingerprint, dict(handle), trusted
        self._fd = fd
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise OSError(f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old_umask = os.umask(0o177)
        try:
            self._listener.bind(str(path))
        except OSError:
            self._listener.close()
            raise
        finally:
            os.umask(old_umask)
        self._listener.listen(8)
        self._thread = threading.Thread(target=self._accept_loop, name="handover", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if not is_out_of_descriptors(exc):
                    return  # closed by ``close``
                time.sleep(ACCEPT_BACKOFF_S)  # out of descriptors: keep offering once some are free
                continue
            with conn:
                self._serve(conn)

    def _serve(self, conn: socket.socket) -> None:
        """One request from one peer; a failure costs that connection only."""
        pid, uid = peer_uid(conn)
        deadline = time.monotonic() + HANDOVER_TIMEOUT_S
        try:
            request, _ = recv_message(conn, deadline=deadline)
            reply, fds = self._answer(request, uid)
            send_message(conn, reply, fds, deadline=deadline)
        except (ProtocolError, OSError) as exc:
            log.warning("handover request from pid %d failed: %s", pid, exc)
            return
        if fds:
            log.info("handed the arena fd to pid %d (uid %d) for re-adoption", pid, uid)
        else:
            log.warning("refused a handover request from pid %d: %s", pid, reply["message"])

    def _answer(self, request: dict[str, Any], uid: int) -> tuple[dict[str, Any], list[int]]:
        if uid not in self.trusted:
            return error_reply("forbidden", f"uid {uid} may not take this engine's arena"), []
        if request.get("op") != "handover" or not is_our_version(request.get("version")):
            return error_reply("bad_message", f"expected a version {PROTOCOL_VERSION} handover request"), []
        try:
            wanted = Fingerprint.from_json(request.get("fingerprint"))
        except ValueError as exc:
            return error_reply("bad_message", f"bad fingerprint: {exc}"), []
        differences = wanted.differences(self.fingerprint)  # the daemon's, then ours
        if differences:
            return error_reply("fingerprint_mismatch", describe_differences(differences)), []
        reply = {"ok": True, "version": PROTOCOL_VERSION, "fingerprint": self.fingerprint.to_json()}
        return reply | {"handle": self.handle}, [self._fd]

    def close(self) -> None:
        """Stop offering: no daemon can take the fd from us after this returns."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        self._listener.close()
        self._thread.join(timeout=HANDOVER_TIMEOUT_S)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self._fd)
        self._fd = -1


def offers(directory: Path, digest: str) -> list[Path]:
    """The offers engines attached to ``digest``'s arena left in ``directory`` (some may be stale)."""
    return sorted(directory.glob(f"{digest}.*{OFFER_SUFFIX}"))


def ask(path: Path, fingerprint: Fingerprint, trusted: frozenset[int]) -> tuple[int, dict[str, Any], int]:
    """(engine pid, handle, fd) from the engine offering on ``path``. StaleOffer when no one listens there;
    HandoverRefused when the socket, the peer or the reply is not what a trusted engine of ``fingerprint``
    sends. The fd is the caller's to close; nothing about it is checked here."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise StaleOffer(f"{path} is gone") from None
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid not in trusted:
        raise HandoverRefused(f"{path} is not a socket of a trusted uid (uid {info.st_uid}): ignored")
    deadline = time.monotonic() + HANDOVER_TIMEOUT_S
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as conn:
        conn.settimeout(HANDOVER_TIMEOUT_S)
        try:
            conn.connect(str(path))
            pid, uid = peer_uid(conn)
        except (ConnectionRefusedError, FileNotFoundError):
            raise StaleOffer(f"no engine listens on {path} any more") from None
        except OSError as exc:
            raise HandoverRefused(f"cannot reach the engine offering on {path}: {exc}") from None
        if uid not in trusted:
            raise HandoverRefused(f"engine pid {pid} on {path} runs as uid {uid}, not one we trust")
        try:
            send_message(conn, {"op": "handover", "version": PROTOCOL_VERSION, "fingerprint": fingerprint.to_json()})
            reply, fds = recv_message(conn, max_fds=1, deadline=deadline)
        except (ProtocolError, OSError) as exc:
            raise HandoverRefused(f"engine pid {pid} did not hand over its arena: {exc}") from None
    try:
        return pid, _checked_reply(reply, fds, fingerprint, pid), fds[0]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _checked_reply(reply: dict[str, Any], fds: list[int], fingerprint: Fingerprint, pid: int) -> dict[str, Any]:
    """The handle of a well-formed, positive reply for ``fingerprint`` with exactly one fd."""
    try:
        if not reply_ok(reply):
            raise HandoverRefused(f"engine pid {pid} refused: {reply.get('message')}")
        check_version(reply)
        offered = Fingerprint.from_json(reply.get("fingerprint"))
    except (ProtocolError, ValueError) as exc:
        raise HandoverRefused(f"engine pid {pid} sent a malformed reply: {exc}") from None
    differences = fingerprint.differences(offered)
    if differences:
        raise HandoverRefused(f"engine pid {pid} offers another arena: {describe_differences(differences)}")
    handle = reply.get("handle")
    if not isinstance(handle, dict) or len(fds) != 1:
        raise HandoverRefused(f"engine pid {pid} sent no handle or {len(fds)} fds instead of 1")
    return handle
