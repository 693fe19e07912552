"""The split-brain detector: how often more than one engine says it is the primary.

Every ``interval_s`` (10 ms) one sweep sends ``GET /primary`` to every engine at the same instant and
waits at most ``timeout_s`` for each answer (a late answer counts as none: its connection is dropped).
A sweep in which two or more engines answer 200 is a split-brain sample: two engines claimed the
primary role within ``timeout_s`` of each other. The engines are asked directly, never through a
load balancer or fault proxy, since they are the truth about their roles.

HTTP/1.1 is spoken by hand over one kept-alive connection per engine: a sweep costs a few hundred
microseconds of our CPU, which matters when the drill shares two cores with the whole stack.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from hotweights.chaos.load import in_background
from hotweights.contract import Endpoint


@dataclass(frozen=True)
class Sample:
    time: float  # time.time() the sweep began
    primaries: tuple[str, ...]  # the URLs that answered 200


class PrimaryProbe:
    """``GET /primary`` on one engine over a persistent connection; the status, or None."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.url = url
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.request = f"GET {Endpoint.PRIMARY} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n\r\n".encode()
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def status(self, timeout_s: float) -> int | None:
        try:
            return await asyncio.wait_for(self._exchange(), timeout_s)
        except (TimeoutError, OSError, ValueError, asyncio.IncompleteReadError):
            self.close()  # a late or broken answer must never be read as the next sweep's
            return None

    async def _exchange(self) -> int:
        if self._conn is None:
            self._conn = await asyncio.open_connection(self.host, self.port)
        reader, writer = self._conn
        writer.write(self.request)
        status = int((await reader.readuntil(b"\r\n")).split(b" ", 2)[1])
        length = 0
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
            elif name.strip().lower() == b"connection" and value.strip().lower() == b"close":
                self._conn = None  # read this answer, then reconnect next time
        await reader.readexactly(length)
        if self._conn is None:
            writer.close()
        return status

    def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None


@dataclass
class SplitBrainDetector:
    urls: list[str]
    interval_s: float = 0.010
    timeout_s: float = 0.050
    sweeps: int = 0
    samples: list[Sample] = field(default_factory=list)

    async def run(self) -> None:
        """Sweep until cancelled."""
        probes = [PrimaryProbe(url) for url in self.urls]
        try:
            next_sweep = time.monotonic()
            while True:
                started = time.time()
                statuses = await asyncio.gather(*(p.status(self.timeout_s) for p in probes))
                self.sweeps += 1
                primaries = tuple(p.url for p, s in zip(probes, statuses, strict=True) if s == 200)
                if len(primaries) > 1:
                    self.samples.append(Sample(started, primaries))
                next_sweep = max(next_sweep + self.interval_s, time.monotonic())
                await asyncio.sleep(next_sweep - time.monotonic())
        finally:
            for probe in probes:
                probe.close()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[SplitBrainDetector]:
        """Sweep in the background for the duration of the block."""
        async with in_background(self.run()):
            yield self
