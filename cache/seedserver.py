"""The serving side of seeding: a daemon sends its arena's bytes to peer daemons (``cache.seeding``).

``SeedServer.bind`` takes the TCP port before the daemon fills its arena (a port in use is refused in one line
at once, not after a load); ``serve`` starts accepting once the arena is filled, hashed and frozen, so only
verified bytes are ever sent. Everything runs on threads of its own: the accept loop and one thread per stream,
never the daemon's attach loop. What seeding may cost the engines sharing the device is bounded:

- ``max_clients`` seed clients (sessions, each up to MAX_STREAMS streams) at once; one more is answered busy;
- ``rate_gbps`` for everything sent, paced in steps of a MiB (host) or PIECE_BYTES (device) (0: no cap);
- the handshake has a deadline, and a connection that has not authenticated counts against MAX_PENDING.

Each stream is authenticated (``cache.seedtransport``: both ends prove the shared token) and its fingerprint
compared field by field before a byte of the arena is sent. A device arena's bytes go through a ring of memfd
staging buffers, pinned, that the client acknowledges before one is reused (``StagedReader``), and leave by
``os.sendfile``, so the kernel does not copy them into the socket (the socket references the pages; on loopback the
receiver copies straight out of them): a seeding then moves each byte through host memory as often as a plain TCP
copy does (the DMA into the buffer, the receiver's copy out of the socket, its DMA to the device). A host arena's
bytes are copied into the socket from its mapping (``HostReader``): on a 2-core VM, os.sendfile from a cpu-shm memfd
sent 3.9-4.3 GB/s where sendall sent 5.1-6.3 (loopback, 4 streams, 1 GiB).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import mmap
import os
import secrets
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hotweights.cache.fingerprint import Fingerprint, describe_differences
from hotweights.cache.protocol import PeerClosed, ProtocolError, error_reply, is_our_version, recv_message
from hotweights.cache.protocol import send_message as send_frame
from hotweights.cache.seeding import PIECE_BYTES, SeedOptions
from hotweights.cache.seedtransport import (
    ACK,
    HANDSHAKE_TIMEOUT_S,
    IO_TIMEOUT_S,
    SEED_VERSION,
    bulk,
    idle,
    proof,
    proof_matches,
    read_piece,
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
RING = 4  # staging buffers (of PIECE_BYTES) per stream of a device arena
STAGING_NAME = "hotweights-seed-staging"  # the staging buffers' memfds
NO_SENDFILE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP}  # os.sendfile cannot send from this file to this socket


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


class ArenaReader(ABC):
    """Sends byte ranges of a frozen arena to streams; ``ack``: the acknowledgement interval its ranges ask of the
    client (0: none; ``cache.seedtransport``)."""

    ack = 0

    def __init__(self, pacer: Pacer) -> None:
        self.pacer = pacer

    @abstractmethod
    def stream(self) -> contextlib.AbstractContextManager[Callable[[socket.socket, int, int], None]]:
        """What one stream sends its ranges with, ``send(sock, start, end)``, for as long as the stream lasts."""

    def close(self) -> None:
        """Release what the reader holds for every stream (a stream's own staging goes with the stream)."""
        return


class HostReader(ArenaReader):
    """A host arena's ranges, copied into the socket from its mapping (the module docstring says why); no
    acknowledgement."""

    def __init__(self, arena: torch.Tensor, pacer: Pacer) -> None:
        super().__init__(pacer)
        self.view = memoryview(arena.numpy())

    @contextlib.contextmanager
    def stream(self) -> Iterator[Callable[[socket.socket, int, int], None]]:
        yield self.send

    def send(self, sock: socket.socket, start: int, end: int) -> None:
        for position in range(start, end, PACE_BYTES):
            piece = min(PACE_BYTES, end - position)
            self.pacer.take(piece)
            sock.sendall(self.view[position : position + piece])

    def close(self) -> None:
        self.view.release()


class StagedReader(ArenaReader):
    """An arena's ranges (a device's; any tensor's: copy_ reads either) through each stream's ring of RING memfd
    staging buffers (``StagingRing``), piece by piece (``ack`` bytes), sent by os.sendfile. The socket still reads a
    buffer's pages after ``sendfile`` returned, until the client has received them: a buffer is refilled only once
    the client acknowledged the piece it held, which it does as each piece arrives. Without the acknowledgement the
    next piece's copy would overwrite bytes still in flight, and the client would receive them, unnoticed until the
    content hash refused the whole copy."""

    def __init__(self, arena: torch.Tensor, pacer: Pacer) -> None:
        super().__init__(pacer)
        self.arena, self.ack = arena, PIECE_BYTES
        self.zero_copy = True  # until os.sendfile is found unable here

    @contextlib.contextmanager
    def stream(self) -> Iterator[Callable[[socket.socket, int, int], None]]:
        ring = StagingRing(self.arena, self.ack)
        try:
            yield lambda sock, start, end: self.send(ring, sock, start, end)
        finally:
            ring.close()

    def send(self, ring: StagingRing, sock: socket.socket, start: int, end: int) -> None:
        """Piece i + 1's copy into its buffer runs while piece i is sent; buffer (i + 1) % RING is taken only once
        the piece RING before, which it held, is acknowledged; the range ends with every piece acknowledged, so the
        next range starts with the ring free and the stream in step."""
        acks = Acks(sock, end - start)
        pieces = [(position, min(self.ack, end - position)) for position in range(start, end, self.ack)]
        staged = [ring.stage(0, *pieces[0])]
        for i, (_, length) in enumerate(pieces):
            if i + 1 < len(pieces):
                acks.wait((i + 2 - RING) * self.ack)  # the end of piece i + 1 - RING (<= 0: none yet)
                staged.append(ring.stage((i + 1) % RING, *pieces[i + 1]))
            if (event := staged[i]) is not None:
                event.synchronize()
            self.pacer.take(length)
            buffer = ring.buffers[i % RING]
            self._send(sock, buffer, length)
        acks.wait(end - start)

    def _send(self, sock: socket.socket, buffer: MemfdBuffer, length: int) -> None:
        """Send the first ``length`` bytes of ``buffer``: by os.sendfile, zero-copy (the socket references the
        memfd's pages), else (a kernel or socket that cannot) the rest copied by sendall."""
        sent = 0
        while self.zero_copy and sent < length:
            try:
                step = os.sendfile(sock.fileno(), buffer.fd, sent, length - sent)
            except OSError as exc:
                if exc.errno not in NO_SENDFILE:
                    raise
                self.zero_copy = False
                log.debug("os.sendfile cannot send here (%s): seeding copies its bytes into the socket", exc)
                break
            if not step:
                raise ConnectionError(f"os.sendfile sent nothing at byte {sent} of a {length}-byte piece")
            sent += step
        if sent < length:
            sock.sendall(buffer.view[sent:length])


class Acks:
    """A staged range's acknowledgements (``cache.seedtransport``: the client's bytes of the range read so far),
    read as the server needs them."""

    def __init__(self, sock: socket.socket, length: int) -> None:
        self.sock, self.length, self.done = sock, length, 0
        self.frame = bytearray(ACK.size)

    def wait(self, upto: int) -> None:
        """Read acknowledgements until the client has read ``upto`` bytes of the range. OSError when none comes for
        IO_TIMEOUT_S (the ``bulk`` socket's) or the client closed, ProtocolError for one of bytes never sent."""
        while self.done < upto:
            if read_piece(self.sock, memoryview(self.frame)) != ACK.size:
                raise ConnectionError("the seed client stopped mid-range, its acknowledgement unsent")
            (done,) = ACK.unpack(self.frame)
            if not self.done < done <= self.length:
                raise ProtocolError(f"acknowledged {done} bytes of a {self.length}-byte range, after {self.done}")
            self.done = done


class StagingRing:
    """One stream's RING staging buffers of ``nbytes`` (``MemfdBuffer``, pinned for a CUDA arena) and the CUDA
    stream its copies into them run on."""

    def __init__(self, arena: torch.Tensor, nbytes: int) -> None:
        self.arena = arena
        cuda = arena.device.type == "cuda"
        self.stream = torch.cuda.Stream(arena.device) if cuda else None
        self.buffers: list[MemfdBuffer] = []
        try:
            with self._on_device():
                self.buffers += [MemfdBuffer(nbytes, pin=cuda) for _ in range(RING)]
        except BaseException:
            self.close()
            raise

    def _on_device(self) -> contextlib.AbstractContextManager[object]:
        """The arena's device current, for CUDA calls that take the thread's (cudaHostRegister and Unregister): a
        stream thread's is device 0, whose context this process may not have (and should not make)."""
        return torch.cuda.device(self.arena.device) if self.stream is not None else contextlib.nullcontext()

    def stage(self, slot: int, position: int, length: int) -> torch.cuda.Event | None:
        """Start copying arena bytes [position, position + length) into buffer ``slot``; the event to synchronize
        before sending them (None: a host arena's copy, done already)."""
        target, source = self.buffers[slot].tensor[:length], self.arena[position : position + length]
        if self.stream is None:
            target.copy_(source)
            return None
        with torch.cuda.stream(self.stream):
            target.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return event

    def close(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()  # no copy writes into a buffer being unmapped
        with self._on_device():
            for buffer in self.buffers:
                buffer.close()


class MemfdBuffer:
    """``nbytes`` of host memory in a memfd (``fd``, what os.sendfile sends from), mapped here (``tensor``,
    ``view``). ``pin``: registered with CUDA as page-locked (cudaHostRegister), so that a non_blocking copy from the
    device into it is an asynchronous DMA; if CUDA refuses (logged), the copy still runs, synchronously. Pages the
    socket still references outlive ``close``: the kernel holds them until it has sent them."""

    def __init__(self, nbytes: int, pin: bool) -> None:
        self.fd = os.memfd_create(STAGING_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, nbytes)
            self.map = mmap.mmap(self.fd, nbytes)
        except BaseException:
            os.close(self.fd)
            raise
        self.tensor = torch.frombuffer(self.map, dtype=torch.uint8)
        self.view = memoryview(self.map)
        self.pinned = pin and _pin(self.tensor)

    def close(self) -> None:
        if self.fd < 0:
            return
        if self.pinned:
            error = torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            if int(error):
                log.warning("cudaHostUnregister of a seeding staging buffer failed: cudaError %d", int(error))
        self.view.release()
        del self.tensor
        self.map.close()
        os.close(self.fd)
        self.fd = -1


def _pin(tensor: torch.Tensor) -> bool:
    """Register ``tensor``'s host memory with CUDA as page-locked; False (logged) when CUDA refuses."""
    error = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    if int(error):
        log.warning("cudaHostRegister of a %d-byte seeding staging buffer failed (cudaError %d): its copies from "
                    "the device run synchronously", tensor.numel(), int(error))  # fmt: skip
        return False
    return True


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

    def serve(
        self, fingerprint: Fingerprint, manifest: dict[str, Any], arena: torch.Tensor, staged: bool = False
    ) -> None:
        """Start sending ``arena`` (filled, hashed, frozen) to authenticated peers of ``fingerprint``: a device arena
        through staging buffers, a host arena from its mapping (``staged``: through staging buffers too, the
        device's path on a host)."""
        self.fingerprint, self.manifest = fingerprint, manifest
        pacer = Pacer(self.options.rate_gbps)
        if staged or arena.device.type == "cuda":
            self.reader = StagedReader(arena, pacer)
        else:
            self.reader = HostReader(arena, pacer)
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
        if hello.get("op") != "seed_hello" or not is_our_version(hello.get("version"), SEED_VERSION):
            return self._refuse(conn, peer, error_reply("version_mismatch", f"expected seed_hello of seeding protocol "
                                                        f"{SEED_VERSION}, found {hello.get('op')!r} "
                                                        f"{hello.get('version')!r}"))  # fmt: skip
        nonce, client_nonce = secrets.token_hex(16), str(hello.get("nonce", ""))
        server_proof = proof(self.options.token, "server", client_nonce, nonce)
        send_frame(conn, {"ok": True, "version": SEED_VERSION, "nonce": nonce, "proof": server_proof},
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
        with self.reader.stream() as send:
            while not self.stopping.is_set() and (work := self._request(conn)) is not None:
                start, end = work
                reply = {"ok": True, "start": start, "end": end, "ack": self.reader.ack}
                send_frame(conn, reply, deadline=time.monotonic() + IO_TIMEOUT_S)
                bulk(conn, socket.SO_SNDTIMEO, socket.SO_RCVTIMEO)
                send(conn, start, end)
                with self.lock:
                    self.served["bytes_sent"] += end - start

    def _request(self, conn: socket.socket) -> tuple[int, int] | None:
        """The next range the client asks for; None once it left or asked for something else (refused)."""
        used = self.manifest["used_bytes"]
        idle(conn)
        try:
            request, _ = recv_message(conn)  # an idle stream waits for its next range without a deadline
        except PeerClosed:
            return None
        start, end = request.get("start"), request.get("end")
        if request.get("op") != "seed_range" or not (type(start) is int and type(end) is int and
                                                      0 <= start < end <= used):  # fmt: skip
            send_frame(conn, error_reply("bad_message", f"expected a seed_range within 0-{used}"))
            return None
        return start, end
