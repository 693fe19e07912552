"""A fake weight cache daemon for the trust tests: speaks the wire protocol, lies as told.

Standard library only, so the system Python can run it as another uid (who may not read the
virtualenv). Usage: ``hostile_daemon.py SPEC.json``; prints "listening" once it accepts. SPEC keys:

- ``socket``: path to bind.
- ``setuid_before_bind`` / ``setuid_before_listen``: become this uid before bind() (the socket file is
  then that uid's) or between bind() and listen() (the file stays ours, SO_PEERCRED says that uid).
- ``hello``: the reply to hello; ``attach``: the reply to attach (``manifest``, ``handle``, ``ok``,
  ``version``...); with ``echo_fingerprint`` the manifest's fingerprint is the one the client sent.
- ``fd``: what rides with the attach reply: "memfd" (``seals``: names from SEALS, ``fd_bytes``, all
  zero) or "file" (a regular file of ``fd_bytes`` random bytes) or "none".
- ``trickle_s``: send every reply one byte at a time, this many seconds apart.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import sys
import tempfile
import time

SEALS = {"shrink": 0x2, "grow": 0x4, "write": 0x8, "future-write": 0x10, "seal": 0x1}


def arena_fd(spec: dict) -> list[int]:
    kind, size = spec.get("fd", "memfd"), spec.get("fd_bytes", 0)
    if kind == "none":
        return []
    if kind == "file":
        with tempfile.TemporaryFile() as f:
            f.write(os.urandom(size))
            f.flush()
            return [os.dup(f.fileno())]
    fd = os.memfd_create("hotweights-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    seals = sum(SEALS[name] for name in spec.get("seals", []))
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return [fd]


def recv_request(conn: socket.socket) -> dict:
    (length,) = struct.unpack(">I", recv_exactly(conn, 4))
    return json.loads(recv_exactly(conn, length))


def recv_exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("peer closed")
        data += chunk
    return data


def send_reply(conn: socket.socket, reply: dict, fds: list[int], trickle_s: float) -> None:
    body = json.dumps(reply).encode()
    frame = struct.pack(">I", len(body)) + body
    if not trickle_s:
        socket.send_fds(conn, [frame], fds)
        return
    socket.send_fds(conn, [frame[:1]], fds)
    for i in range(1, len(frame)):
        time.sleep(trickle_s)
        conn.sendall(frame[i : i + 1])


def serve(conn: socket.socket, spec: dict) -> None:
    request = recv_request(conn)
    op = request.get("op")
    reply = dict(spec.get(op, {"ok": False, "error": "unknown_op", "message": f"no {op}"}))
    fds: list[int] = []
    if op == "attach" and reply.get("ok") is not False:
        if spec.get("echo_fingerprint"):
            reply["manifest"] = {**reply["manifest"], "fingerprint": request["fingerprint"]}
        fds = arena_fd(spec)
    try:
        send_reply(conn, reply, fds, spec.get("trickle_s", 0))
        conn.recv(1)  # an attached engine keeps the connection open: so do we, until it hangs up
    finally:
        for fd in fds:
            os.close(fd)


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    if "setuid_before_bind" in spec:
        os.setuid(spec["setuid_before_bind"])
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(spec["socket"])
    os.chmod(spec["socket"], 0o666)
    if "setuid_before_listen" in spec:
        os.setuid(spec["setuid_before_listen"])
    listener.listen(16)
    print("listening", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            try:
                serve(conn, spec)
            except (ConnectionError, ValueError, OSError) as exc:
                print(f"connection ended: {exc}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
