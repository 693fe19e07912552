"""How an arena's bytes travel from a serving daemon to a new one: the seeding transport and its TCP implementation.

A ``SeedChannel`` is one stream to a serving daemon: ``open`` authenticates both ends and agrees on the weights
(returns the peer's manifest), ``read_range`` copies one byte range of the peer's arena into a ``RangeSink``.
``SeedTransport.connect`` opens channels; TCP is the one transport today, RDMA could be another (its channel
would read a range straight into registered memory).

The TCP conversation (length-prefixed JSON frames of ``cache.protocol``, then raw bytes):

  client {"op": "seed_hello", "version": 2, "nonce"}           server {"ok", "version", "nonce", "proof"}
  client {"op": "seed_auth", "proof", "fingerprint",            server {"ok", "manifest"} or a refusal:
          "session", "listen"}                                    forbidden, fingerprint_mismatch, busy
  client {"op": "seed_range", "start", "end"}                  server {"ok", "start", "end", "ack"} + end-start bytes
  with "ack" > 0, the client, as it reads the bytes:           ACK frames (8 bytes, little-endian: the range's
                                                                 bytes read so far) after each "ack" bytes of the
                                                                 range, and after its last byte

The version is seeding's own (SEED_VERSION), not the daemon protocol's: a peer of another version is refused in
its hello, in one line, before anything else is said. Acknowledgements exist because the server sends from memory
it reuses: it hands the socket pages of a staging buffer (os.sendfile: the socket references the pages, no copy),
and the kernel reads them until the client has received them, after ``sendfile`` returned. Overwriting a buffer
before the client acknowledged the bytes it sent would change bytes in flight; the server waits for the
acknowledgement first. A frozen host arena is never written while served, so its ranges need none ("ack": 0).

Both ends prove they know the shared token without sending it: each sends HMAC-SHA256(token, role, both nonces)
and checks the other's in constant time. A stranger can neither read (the server refuses it) nor feed weights
(the client refuses a server that cannot prove the token, and checks the content hash before serving anything).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from hotweights.cache.protocol import ProtocolError, is_our_version, recv_message, reply_ok, send_message
from hotweights.errors import HotweightsError

# Seeding's defaults, here (no torch) so that the controller's configuration takes them from one place:
STREAMS = 4  # parallel channels per copy
MAX_CLIENTS = 1  # seed clients a serving daemon copies to at once (a tree doubles per copy time with 1)
RATE_GBPS = 0.0  # a serving daemon's cap on what seeding sends, GB/s (0: the link's speed)
WAIT_S = 60.0  # how long a new daemon waits while every peer is busy and none is new, before the next source
HANDSHAKE_TIMEOUT_S = 10.0  # the whole handshake, and each range's header
IO_TIMEOUT_S = 10.0  # a stream that moves no byte for this long is dropped (and resumed)
SOCKET_BUFFER_BYTES = 4 << 20  # SO_SNDBUF / SO_RCVBUF asked for each stream
SEED_VERSION = 2  # of the conversation below; 2: acknowledgements
ACK = struct.Struct("<Q")  # an acknowledgement: bytes of the range read so far


class SeedRefused(HotweightsError):
    """The peer refused us (or we it) for a reason retrying cannot fix: a wrong token, other weights."""


class SeedBusy(HotweightsError):
    """The peer serves as many seed clients as it allows: try another, or later."""


class RangeSink(ABC):
    """Where a channel writes the bytes of a range: the new arena, directly or through a staging buffer."""

    @abstractmethod
    def receive(self, start: int, end: int, read_into: Callable[[memoryview], int]) -> int:
        """Fill arena bytes [start, end) by calling ``read_into(buffer)`` (returns bytes read, 0 at EOF; fewer than
        the buffer holds where an acknowledged piece ends) until done; returns how many bytes are in place (less than
        end - start when a read failed: OSError is re-raised after the bytes already received are in place, so a
        resume asks only for the rest)."""


class SeedChannel(ABC):
    """One authenticated stream to a serving daemon."""

    @abstractmethod
    def open(self, token: str, fingerprint: dict[str, Any], session: str, listen: str) -> dict[str, Any]:
        """Authenticate both ways and offer our fingerprint; the peer's manifest. SeedRefused (token, weights),
        SeedBusy, OSError or ProtocolError (the connection failed: worth another try)."""

    @abstractmethod
    def read_range(self, start: int, end: int, sink: RangeSink, progress: Callable[[int], None]) -> None:
        """Copy the peer's arena bytes [start, end) into ``sink``, calling ``progress(n)`` as bytes land. On a
        failure (OSError, ProtocolError) the bytes already reported stay valid."""

    @abstractmethod
    def close(self) -> None:
        """Close without a word (a failed stream)."""


class SeedTransport(ABC):
    @abstractmethod
    def connect(self, address: str) -> SeedChannel:
        """A new channel to the seeding listener at ``address``; OSError when it cannot be reached."""


def proof(token: str, role: str, client_nonce: str, server_nonce: str) -> str:
    """What ``role`` ("client" or "server") sends to show it knows ``token``, bound to both nonces."""
    message = f"hotweights-seed:{role}:{client_nonce}:{server_nonce}".encode()
    return hmac.new(token.encode(), message, hashlib.sha256).hexdigest()


def proof_matches(given: object, expected: str) -> bool:
    """Constant-time comparison of a received proof."""
    return isinstance(given, str) and hmac.compare_digest(given.encode(), expected.encode())


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` -> (host, port); ValueError naming what is wrong."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"expected HOST:PORT, found {address!r}")
    return host.strip("[]"), int(port)


def tune(sock: socket.socket) -> None:
    """Large buffers and no Nagle delay for a bulk stream."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)


def bulk(sock: socket.socket, *options: int) -> None:
    """Put ``sock`` in blocking mode with the kernel's own timeouts ``options`` (SO_RCVTIMEO, SO_SNDTIMEO) of
    IO_TIMEOUT_S, for the bytes of a range: then a whole piece moves in one system call (a blocking ``sendall`` or
    ``os.sendfile``, a ``recv_into`` with MSG_WAITALL), the interpreter's lock released for all of it. A Python socket
    timeout instead polls and returns to the interpreter every few hundred KiB, and eight streams of that were bound by
    the lock, not by the link. As before, a call that moves no byte for IO_TIMEOUT_S fails (OSError: EAGAIN); one that
    moved some returns what it moved. The protocol's framed messages set their own timeouts again (``cache.protocol``);
    ``idle`` takes the kernel's off again."""
    _kernel_timeouts(sock, int(IO_TIMEOUT_S), options)


def idle(sock: socket.socket) -> None:
    """Blocking, without the kernel timeouts of ``bulk``: for a stream waiting for its next request, as long as it
    takes."""
    _kernel_timeouts(sock, 0, (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO))


def _kernel_timeouts(sock: socket.socket, seconds: int, options: tuple[int, ...]) -> None:
    """Blocking mode, each of ``options`` set to ``seconds`` (0: none)."""
    sock.settimeout(None)
    for option in options:
        sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("ll", seconds, 0))


def read_piece(sock: socket.socket, buffer: memoryview) -> int:
    """Bytes read into ``buffer``, all of it unless the stream broke or stalled (a ``bulk`` receiving socket); 0 at
    the peer's end."""
    return sock.recv_into(buffer, 0, socket.MSG_WAITALL)


class AckedReads:
    """The client's reads of one range of ``length`` bytes whose server asked for an acknowledgement every ``ack``
    bytes (0: none). A read never crosses the end of an acknowledged piece: the server sends the bytes beyond it only
    once staging buffers are acknowledged free, so a read waiting for them could wait for ever. Each piece is
    acknowledged as soon as its last byte is read (the bytes are in our memory then, out of the server's pages)."""

    def __init__(self, sock: socket.socket, length: int, ack: int) -> None:
        self.sock, self.length, self.ack = sock, length, ack
        self.done = 0
        self.piece_end = min(ack, length) if ack else length

    def read_into(self, buffer: memoryview) -> int:
        """Bytes read into ``buffer`` (``read_piece``), at most to the current piece's end."""
        n = read_piece(self.sock, buffer[: self.piece_end - self.done])
        self.done += n
        if self.ack and n and self.done == self.piece_end:
            self.sock.sendall(ACK.pack(self.done))
            self.piece_end = min(self.done + self.ack, self.length)
        return n


class TcpChannel(SeedChannel):
    def __init__(self, address: str) -> None:
        self.address = address
        self.sock = socket.create_connection(split_address(address), timeout=HANDSHAKE_TIMEOUT_S)
        tune(self.sock)

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S
        send_message(self.sock, message, deadline=deadline)
        reply, _ = recv_message(self.sock, deadline=deadline)
        return reply

    def open(self, token: str, fingerprint: dict[str, Any], session: str, listen: str) -> dict[str, Any]:
        nonce = secrets.token_hex(16)
        reply = self._ask({"op": "seed_hello", "version": SEED_VERSION, "nonce": nonce})
        self._refused(reply)
        if not is_our_version(version := reply.get("version"), SEED_VERSION):
            raise SeedRefused(f"seeding peer {self.address} speaks seeding protocol version {version!r}, we speak "
                              f"{SEED_VERSION}")  # fmt: skip
        server_nonce = str(reply.get("nonce", ""))
        if not proof_matches(reply.get("proof"), proof(token, "server", nonce, server_nonce)):
            raise SeedRefused(f"seeding peer {self.address} does not know the seeding token: not one of ours")
        body = {"op": "seed_auth", "proof": proof(token, "client", nonce, server_nonce), "fingerprint": fingerprint,
                "session": session, "listen": listen}  # fmt: skip
        reply = self._ask(body)
        self._refused(reply)
        manifest = reply.get("manifest")
        if not isinstance(manifest, dict):
            raise ProtocolError(f"seeding peer {self.address} sent no manifest")
        return manifest

    def _refused(self, reply: dict[str, Any]) -> None:
        if reply_ok(reply):
            return
        message = f"seeding peer {self.address} refused: {reply.get('message')}"
        raise SeedBusy(message) if reply.get("error") == "busy" else SeedRefused(message)

    def read_range(self, start: int, end: int, sink: RangeSink, progress: Callable[[int], None]) -> None:
        reply = self._ask({"op": "seed_range", "start": start, "end": end})
        self._refused(reply)
        ack = reply.get("ack", 0)
        if reply.get("start") != start or reply.get("end") != end or type(ack) is not int or ack < 0:
            raise ProtocolError(f"seeding peer {self.address} answered range {reply.get('start')}-{reply.get('end')} "
                                f"(ack {ack!r})")  # fmt: skip
        bulk(self.sock, socket.SO_RCVTIMEO, socket.SO_SNDTIMEO)
        reads = AckedReads(self.sock, end - start, ack)

        def read_into(buffer: memoryview) -> int:
            n = reads.read_into(buffer)
            if n == 0:
                raise ConnectionError(f"seeding peer {self.address} closed the stream mid-range")
            progress(n)
            return n

        sink.receive(start, end, read_into)

    def close(self) -> None:
        self.sock.close()


class TcpTransport(SeedTransport):
    def connect(self, address: str) -> SeedChannel:
        return TcpChannel(address)
