"""The daemon's wire protocol: length-prefixed JSON messages, file descriptors by SCM_RIGHTS.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON (an object).
File descriptors ride on the frame's first ``sendmsg``. No pickle anywhere: a peer can make us
parse JSON and nothing more. Every request has an ``op``; every reply has ``ok`` and, when
``ok`` is false, an ``error`` code and a ``message`` for the operator.

Requests                                   Replies (ok=true)
  {"op": "hello", "version": 1}              {"version", "pid", "fingerprint_digest"}
  {"op": "attach", "fingerprint": {...}}     {"manifest": {...}, "handle": {...}} + fds
  {"op": "status"}                           {"status": {...}}
Refusals (ok=false) carry ``error`` in ERROR_CODES; an attach refused for a fingerprint mismatch
lists ``differences``: [[field, daemon's value, engine's value], ...].
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any

PROTOCOL_VERSION = 1
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # a 10k-tensor manifest is ~1 MB
MAX_FDS = 8
HEADER = struct.Struct(">I")
ERROR_CODES = (
    "bad_message",  # not a JSON object, too large, truncated, missing or mistyped fields
    "unknown_op",
    "version_mismatch",
    "fingerprint_mismatch",
    "forbidden",  # peer uid not allowed
    "not_ready",
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


def send_message(sock: socket.socket, message: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    frame = encode(message)
    sent = socket.send_fds(sock, [frame], list(fds)) if fds else sock.send(frame)
    if sent < len(frame):
        sock.sendall(frame[sent:])


def recv_message(sock: socket.socket, max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    """Read one frame; fds beyond ``max_fds`` (and all fds, on error) are closed, never leaked."""
    fds: list[int] = []
    try:
        header = _recv_exactly(sock, HEADER.size, fds, max_fds, first=True)
        (length,) = HEADER.unpack(header)
        if length > MAX_MESSAGE_BYTES:
            raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
        body = _recv_exactly(sock, length, fds, max_fds, first=False)
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


def _recv_exactly(sock: socket.socket, n: int, fds: list[int], max_fds: int, *, first: bool) -> bytes:
    chunks, received = [], 0
    while received < n:
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


def error_reply(code: str, message: str, **extra: Any) -> dict[str, Any]:
    assert code in ERROR_CODES, code
    return {"ok": False, "error": code, "message": message, **extra}
