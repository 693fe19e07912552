"""The daemon's wire protocol: length-prefixed JSON messages, file descriptors by SCM_RIGHTS.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON (an object).
File descriptors ride on the frame's first ``sendmsg``. No pickle anywhere: a peer can make us
parse JSON and nothing more. Every request has an ``op``; every reply has ``ok`` and, when
``ok`` is false, an ``error`` code and a ``message`` for the operator.

Requests                                   Replies (ok=true)
  {"op": "hello", "version": 1}              {"version", "pid", "fingerprint_digest"}
  {"op": "attach", "fingerprint": {...}}     {"version", "manifest": {...}, "handle": {...}} + fds
  {"op": "status"}                           {"status": {...}}
  {"op": "kv_deposit" | "kv_withdraw" | "kv_hand_over" | "kv_sources" | "kv_release", ...}: ``cache.kvdeposits``
The manifest's ``arena_id`` (also in ``status``) names the allocation: new at each fill from a snapshot or the
checkpoint, kept by re-adoption, so an engine can tell whether a daemon still serves the memory it maps.
The same frames carry re-adoption's one request, from a new daemon to an engine's own socket
(``cache.handover``): {"op": "handover", "version": 1, "fingerprint": {...}} -> {"version", "fingerprint",
"handle"} + the arena fd the engine kept.
Refusals (ok=false) carry ``error`` in ERROR_CODES; an attach refused for a fingerprint mismatch
lists ``differences``: [[field, daemon's value, engine's value], ...]. ``ok`` is exactly true or false
and ``version`` exactly the int PROTOCOL_VERSION (``reply_ok``, ``check_version``); anything else is a
ProtocolError. Sending or receiving one whole message has one deadline (``deadline``, a
``time.monotonic()`` instant), so a peer that trickles a byte at a time cannot stretch it.
"""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import time
from typing import Any

PROTOCOL_VERSION = 1
KV_RETAIN_S = 10.0  # how long a daemon keeps a failed engine's deposited KV cache, by default (cache.kvdeposits)
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # a 10k-tensor manifest is ~1 MB
MAX_FDS = 8
HEX = re.compile(r"[0-9a-f]{64}")  # a content hash or digest as the wire and the records carry it (cache.digest)
HEADER = struct.Struct(">I")
ERROR_CODES = (
    "bad_message",  # not a JSON object, too large, truncated, missing or mistyped fields
    "unknown_op",
    "version_mismatch",
    "fingerprint_mismatch",
    "forbidden",  # peer uid not allowed
    "not_ready",
    "busy",  # every connection slot is held by an attached engine
)


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame; the connection cannot continue."""


class PeerClosed(ProtocolError):
    """The peer closed the connection (cleanly, between frames)."""


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode()
    if len(body) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    return HEADER.pack(len(body)) + body


def send_message(
    sock: socket.socket,
    message: dict[str, Any],
    fds: list[int] | tuple[int, ...] = (),
    deadline: float | None = None,
) -> None:
    """Send one frame (with ``fds``); TimeoutError once ``deadline`` passes."""
    frame = encode(message)
    _arm(sock, deadline)
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else sock.send(frame)
    if sent < len(frame):
        _arm(sock, deadline)
        sock.sendall(frame[sent:])  # sendall's timeout bounds the whole call


def recv_message(
    sock: socket.socket, max_fds: int = 0, deadline: float | None = None
) -> tuple[dict[str, Any], list[int]]:
    """Read one frame; fds beyond ``max_fds`` (and all fds, on error) are closed, never leaked.
    With ``deadline``, the whole frame must arrive before it (TimeoutError otherwise); without,
    the socket's own timeout applies to each read."""
    fds: list[int] = []
    try:
        header = _recv_exactly(sock, HEADER.size, fds, max_fds, deadline, first=True)
        (length,) = HEADER.unpack(header)
        if length > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
        body = _recv_exactly(sock, length, fds, max_fds, deadline, first=False)
        try:
            message = json.loads(body)
        except (ValueError, RecursionError) as exc:  # also a >4300-digit int, or nesting too deep
            raise ProtocolError(f"frame is not valid JSON: {str(exc)[:200]}") from None
        if not isinstance(message, dict):
            raise ProtocolError(f"frame must hold a JSON object, found {type(message).__name__}")
        return message, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _arm(sock: socket.socket, deadline: float | None) -> None:
    """Give the next socket call what is left of ``deadline``; TimeoutError if nothing is."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the message deadline passed")
    sock.settimeout(left)


def _recv_exactly(
    sock: socket.socket, n: int, fds: list[int], max_fds: int, deadline: float | None, *, first: bool
) -> bytes:
    chunks, received = [], 0
    while received < n:
        _arm(sock, deadline)
        if first and received == 0:
            data, new_fds, _flags, _addr = socket.recv_fds(sock, n, MAX_FDS)
            fds.extend(new_fds)
            if len(fds) > max_fds:
                raise ProtocolError(f"peer sent {len(fds)} file descriptors, at most {max_fds} allowed")
        else:
            data = sock.recv(min(n - received, 1 << 20))
        if not data:
            if first and received == 0:
                raise PeerClosed("peer closed the connection")
            raise ProtocolError(f"truncated frame: got {received} of {n} bytes")
        chunks.append(data)
        received += len(data)
    return b"".join(chunks)


def reply_ok(reply: dict[str, Any]) -> bool:
    """The reply's ``ok``, which must be the JSON literal true or false."""
    ok = reply.get("ok")
    if type(ok) is not bool:
        raise ProtocolError(f"reply field 'ok' must be true or false, found {ok!r}")
    return ok


def is_our_version(value: object, ours: int = PROTOCOL_VERSION) -> bool:
    """Exactly the int ``ours`` (PROTOCOL_VERSION, or a conversation's own, seeding's): 1.0 and true compare equal to
    1 in Python, and are refused."""
    return type(value) is int and value == ours


def check_version(reply: dict[str, Any]) -> None:
    """ProtocolError unless the reply's ``version`` is exactly the int PROTOCOL_VERSION (not 1.0, not true)."""
    version = reply.get("version")
    if not is_our_version(version):
        raise ProtocolError(f"peer speaks protocol version {version!r}, we speak {PROTOCOL_VERSION}")


def error_reply(code: str, message: str, **extra: Any) -> dict[str, Any]:
    assert code in ERROR_CODES, code
    return {"ok": False, "error": code, "message": message, **extra}
