"""The serving side of seeding: a daemon sends its arena's bytes to peer daemons (``cache.seeding``).

``SeedServer.bind`` takes the TCP port before the daemon fills its arena (a port in use is refused in one line
at once, not after a load); ``serve`` starts accepting once the arena is filled, hashed and frozen, so only
verified bytes are ever sent. Everything runs on threads of its own: the accept loop and one thread per stream,
never the daemon's attach loop. What seeding may cost the engines sharing the device is bounded:

- ``max_clients`` seed clients (sessions, each up to MAX_STREAMS streams) at once; one more is answered busy;
- ``rate_gbps`` for everything sent, paced in steps of a MiB (host) or PIECE_BYTES (device) (0: no cap);
- the handshake has a deadline, and a connection that has not authenticated counts against MAX_PENDING.

Each stream is authenticated (``cache.seedtransport``: both ends prove the shared token) and its fingerprint
compared field by field before a byte of the arena is sent. A device arena is read through pinned buffers.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from typing import Any

import torch

from hotweights.cache.fingerprint import Fingerprint, describe_differences
from hotweights.cache.protocol import (
    PROTOCOL_VERSION,
    PeerClosed,
    ProtocolError,
    error_reply,
    is_our_version,
    recv_message,
)
from hotweights.cache.protocol import send_message as send_frame
from hotweights.cache.seeding import PIECE_BYTES, SeedOptions
from hotweights.cache.seedtransport import (
    HANDSHAKE_TIMEOUT_S,
    IO_TIMEOUT_S,
    bulk,
    proof,
    proof_matches,
    split_address,
    tune,
)
from hotweights.errors import ConfigError

log = logging.getLogger(__name__)

MAX_STREAMS = 16  # streams per seed client
MAX_PENDING = 16  # connections not yet authenticated
ACCEPT_POLL_S = 0.2
CLOSE_WAIT_S = 2.0
PACE_BYTES = 1 << 20  # host memory is sent (and paced) in steps of this many bytes


class Pacer:
    """A shared send budget of ``rate`` bytes a second (0: none): ``take(n)`` waits until n more may go."""

    def __init__(self, rate_gbps: float) -> None:
        self.rate = rate_gbps * 1e9
        self.next = time.monotonic()
        self.lock = threading.Lock()

    def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        with self.lock:
            now = time.monotonic()
            start = max(self.next, now)
            self.next = start + n / self.rate
        if start > now:
            time.sleep(start - now)  # the pace itself: nothing to wait for but the clock


class ArenaReader:
    """Sends byte ranges of a frozen arena: host memory as it is, device memory through two pinned buffers."""

    def __init__(self, arena: torch.Tensor, pacer: Pacer) -> None:
        self.arena, self.pacer = arena, pacer
        self.device = arena.device.type == "cuda"
        self.view = None if self.device else memoryview(arena.numpy())
        self.local = threading.local()  # a device arena: each stream thread's staging buffers

    def send(self, sock: socket.socket, start: int, end: int) -> None:
        if self.view is not None:
            for position in range(start, end, PACE_BYTES):
                piece = min(PACE_BYTES, end - position)
                self.pacer.take(piece)
                sock.sendall(self.view[position : position + piece])
            return
        self._send_device(sock, start, end)

    def _staging(self) -> tuple[torch.cuda.Stream, list[torch.Tensor]]:
        """This stream thread's CUDA stream and two pinned buffers, made on its first range."""
        if not hasattr(self.local, "staging"):
            from hotweights.cache.loader import aligned_host_buffer

            buffers = [aligned_host_buffer(PIECE_BYTES, pinned=True) for _ in range(2)]
            self.local.staging = (torch.cuda.Stream(self.arena.device), buffers)
        return self.local.staging

    def _send_device(self, sock: socket.socket, start: int, end: int) -> None:
        """The copy of the next piece to a pinned buffer runs while the current one is sent."""
        stream, buffers = self._staging()
        pieces = [(p, min(PIECE_BYTES, end - p)) for p in range(start, end, PIECE_BYTES)]
        events = [self._stage(stream, buffers[0], *pieces[0])] if pieces else []
        for i, (_, length) in enumerate(pieces):
            if i + 1 < len(pieces):
                events.append(self._stage(stream, buffers[(i + 1) % 2], *pieces[i + 1]))
            events[i].synchronize()
            self.pacer.take(length)
            sock.sendall(memoryview(buffers[i % 2].numpy())[:length])

    def _stage(self, stream: torch.cuda.Stream, buffer: torch.Tensor, position: int, length: int) -> torch.cuda.Event:
        with torch.cuda.stream(stream):
            buffer[:length].copy_(self.arena[position : position + length], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def close(self) -> None:
        if self.view is not None:
            self.view.release()


class SeedServer:
    """A daemon's seeding listener (module docstring)."""

    def __init__(self, options: SeedOptions, listener: socket.socket) -> None:
        self.options, self.listener = options, listener
        self.fingerprint: Fingerprint | None = None
        self.manifest: dict[str, Any] = {}
        self.reader: ArenaReader | None = None
        self.sessions: dict[str, int] = {}  # session -> its open streams
        self.pending = 0
        self.streams: dict[socket.socket, threading.Thread] = {}  # every connection being served, and its thread
        self.served = {"sessions": 0, "bytes_sent": 0, "refused": 0}
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    @classmethod
    def bind(cls, options: SeedOptions) -> SeedServer:
        """Listen on ``options.listen``; ConfigError in one line when the address is bad or taken."""
        try:
            host, port = split_address(options.listen)
        except ValueError as exc:
            raise ConfigError(f"--seed-listen: {exc}") from None
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as exc:
            listener.close()
            raise ConfigError(f"--seed-listen {options.listen}: cannot listen there ({exc.strerror})") from None
        listener.listen(64)
        listener.settimeout(ACCEPT_POLL_S)
        return cls(options, listener)

    def serve(self, fingerprint: Fingerprint, manifest: dict[str, Any], arena: torch.Tensor) -> None:
        """Start sending ``arena`` (filled, hashed, frozen) to authenticated peers of ``fingerprint``."""
        self.fingerprint, self.manifest = fingerprint, manifest
        self.reader = ArenaReader(arena, Pacer(self.options.rate_gbps))
        self.thread = threading.Thread(target=self._accept_loop, name="seed-accept", daemon=True)
        self.thread.start()
        log.info("seeding peers on %s (at most %d at once%s)", self.options.listen, self.options.max_clients,
                 f", {self.options.rate_gbps:g} GB/s" if self.options.rate_gbps else "")  # fmt: skip

    def close(self) -> None:
        """Stop accepting, cut the streams in flight and wait for their threads (they read the arena, which is
        closed next), each at most CLOSE_WAIT_S."""
        self.stopping.set()
        if self.thread is not None:
            self.thread.join(timeout=2 * ACCEPT_POLL_S)
        self.listener.close()
        with self.lock:
            streams = list(self.streams.items())
        for conn, _ in streams:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for _, thread in streams:
            thread.join(timeout=CLOSE_WAIT_S)
        if self.reader is not None:
            self.reader.close()

    def status(self) -> dict[str, Any]:
        with self.lock:
            clients, served = len(self.sessions), dict(self.served)
        options = self.options
        return {"listen": options.listen, "clients": clients, "max_clients": options.max_clients,
                "rate_gbps": options.rate_gbps, **served}  # fmt: skip

    def _accept_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, peer = self.listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                log.warning("seeding accept failed: %s", exc)
                self.stopping.wait(ACCEPT_POLL_S)
                continue
            with self.lock:
                crowded = self.pending >= MAX_PENDING
                self.pending += not crowded
            if crowded:
                conn.close()
                continue
            threading.Thread(target=self._serve_stream, args=(conn, peer), name="seed-stream", daemon=True).start()

    def _serve_stream(self, conn: socket.socket, peer: tuple) -> None:
        session = None
        with self.lock:
            self.streams[conn] = threading.current_thread()
        try:
            with conn:
                tune(conn)
                session = self._handshake(conn, f"{peer[0]}:{peer[1]}")
                if session is not None:
                    send_frame(conn, {"ok": True, "manifest": self.manifest}, deadline=time.monotonic() + IO_TIMEOUT_S)
                    self._ranges(conn)
        except (OSError, ProtocolError) as exc:
            log.debug("seed stream from %s ended: %s", peer[0], exc)
        finally:
            self._leave(session)
            with self.lock:
                self.streams.pop(conn, None)

    def _handshake(self, conn: socket.socket, peer: str) -> str | None:
        """Authenticate, compare fingerprints, admit the session (counted until ``_leave``); its id, or None once
        refused (the refusal sent)."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        hello, _ = recv_message(conn, deadline=deadline)
        if hello.get("op") != "seed_hello" or not is_our_version(hello.get("version")):
            return self._refuse(conn, peer, error_reply("version_mismatch", f"expected seed_hello of protocol "
                                                        f"{PROTOCOL_VERSION}, found {hello.get('op')!r} "
                                                        f"{hello.get('version')!r}"))  # fmt: skip
        nonce, client_nonce = secrets.token_hex(16), str(hello.get("nonce", ""))
        server_proof = proof(self.options.token, "server", client_nonce, nonce)
        send_frame(conn, {"ok": True, "version": PROTOCOL_VERSION, "nonce": nonce, "proof": server_proof},
                   deadline=deadline)  # fmt: skip
        auth, _ = recv_message(conn, deadline=deadline)
        if not proof_matches(auth.get("proof"), proof(self.options.token, "client", client_nonce, nonce)):
            return self._refuse(conn, peer, error_reply("forbidden", "wrong seeding token"))
        assert self.fingerprint is not None
        try:
            theirs = Fingerprint.from_json(auth.get("fingerprint"))
        except ValueError as exc:
            return self._refuse(conn, peer, error_reply("bad_message", f"seed_auth: {exc}"))
        if differences := self.fingerprint.differences(theirs):
            text = f"this daemon serves other weights: {describe_differences(differences)}"
            return self._refuse(conn, peer, error_reply("fingerprint_mismatch", text))
        session = str(auth.get("session", ""))[:64]
        if refusal := self._admit(session):
            return self._refuse(conn, peer, error_reply("busy", refusal))
        return session

    def _refuse(self, conn: socket.socket, peer: str, reply: dict[str, Any]) -> None:
        if reply["error"] != "busy":
            log.warning("refused a seed client at %s: %s", peer, reply["message"])
        with self.lock:
            self.served["refused"] += 1
        with contextlib.suppress(OSError):
            send_frame(conn, reply, deadline=time.monotonic() + 1.0)

    def _admit(self, session: str) -> str | None:
        """Count the stream in; the reason it may not join (too many clients, or streams), or None."""
        with self.lock:
            self.pending -= 1
            streams = self.sessions.get(session)
            if streams is None and len(self.sessions) >= self.options.max_clients:
                self.pending += 1  # _leave takes it back off
                return f"already seeding {len(self.sessions)} peer(s), the most allowed (--seed-max-clients)"
            if streams is not None and streams >= MAX_STREAMS:
                self.pending += 1
                return f"at most {MAX_STREAMS} streams per seed client"
            self.served["sessions"] += streams is None
            self.sessions[session] = (streams or 0) + 1
        return None

    def _leave(self, session: str | None) -> None:
        with self.lock:
            if session is None:
                self.pending -= 1
                return
            self.sessions[session] -= 1
            if not self.sessions[session]:
                del self.sessions[session]

    def _ranges(self, conn: socket.socket) -> None:
        """Answer range requests until the client leaves."""
        assert self.reader is not None
        used = self.manifest["used_bytes"]
        while not self.stopping.is_set():
            conn.settimeout(None)
            try:
                request, _ = recv_message(conn)  # an idle stream waits for its next range without a deadline
            except PeerClosed:
                return
            start, end = request.get("start"), request.get("end")
            if request.get("op") != "seed_range" or not (type(start) is int and type(end) is int and
                                                          0 <= start < end <= used):  # fmt: skip
                send_frame(conn, error_reply("bad_message", f"expected a seed_range within 0-{used}"))
                return
            send_frame(conn, {"ok": True, "start": start, "end": end}, deadline=time.monotonic() + IO_TIMEOUT_S)
            bulk(conn, socket.SO_SNDTIMEO)
            self.reader.send(conn, start, end)
            with self.lock:
                self.served["bytes_sent"] += end - start
