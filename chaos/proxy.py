"""A fault-injecting TCP proxy: every byte, in both directions, is delivered ``delay_s`` after it arrived.

Put in front of an engine, it makes the engine look slow to everything that talks to it through the
proxy (health checks, the load balancer, clients) without touching the engine. The delay is a latency,
not a throttle: chunks are timestamped as they are read and released in order once their time has
come, so throughput is unchanged. ``delay_s`` may be changed while connections are open; it applies to
chunks read from then on. A very long delay is a partition (bytes are taken and never delivered, as by a
network that drops them); ``reset`` then cuts the connections held behind it, as a healed network whose
peers gave up on them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time

log = logging.getLogger(__name__)

CHUNK = 64 * 1024


class DelayProxy:
    def __init__(self, target_port: int, listen_port: int = 0, host: str = "127.0.0.1") -> None:
        self.target_port = target_port
        self.listen_port = listen_port
        self.host = host
        self.delay_s = 0.0
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.Task] = set()

    @property
    def port(self) -> int:
        """The port it listens on (the real one once started, also for ``listen_port=0``)."""
        assert self._server is not None, "start() first"
        return self._server.sockets[0].getsockname()[1]

    async def start(self) -> DelayProxy:
        self._server = await asyncio.start_server(self._accept, self.host, self.listen_port, reuse_address=True)
        return self

    async def close(self) -> None:
        """Stop listening and cut every open connection."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        await self.reset()

    async def reset(self) -> None:
        """Cut every open connection; new ones are accepted as before."""
        for task in list(self._pipes):
            task.cancel()
        await asyncio.gather(*self._pipes, return_exceptions=True)

    async def _accept(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._pipes.add(task)
        try:
            try:
                upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.target_port)
            except OSError:
                return  # the engine is gone: the client sees the connection close, as it would without us
            try:
                await asyncio.gather(
                    self._pipe(client_reader, upstream_writer), self._pipe(upstream_reader, client_writer)
                )
            finally:
                upstream_writer.close()
        except asyncio.CancelledError:
            pass  # reset() or close() cut it: end quietly (asyncio logs a cancelled connection task as an error)
        finally:
            client_writer.close()
            self._pipes.discard(task)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read into a queue of (due time, chunk), write each when due; EOF travels the same way."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, chunk = await queue.get()
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                if not chunk:
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                    return
                writer.write(chunk)
                await writer.drain()

        delivering = asyncio.create_task(deliver())
        try:
            while True:
                try:
                    chunk = await reader.read(CHUNK)
                except OSError:
                    chunk = b""
                queue.put_nowait((time.monotonic() + self.delay_s, chunk))
                if not chunk:
                    break
            await delivering
        except (OSError, ConnectionError):
            log.debug("proxy pipe to port %d closed", self.target_port)
        finally:
            delivering.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, ConnectionError):
                await delivering


async def serve(pairs: list[str]) -> None:
    """One proxy per ``[HOST:]PUBLIC=PRIVATE`` pair (both ports on HOST, default 127.0.0.1); stdin lines
    ``PUBLIC SECONDS`` set a proxy's delay, ``PUBLIC reset`` cuts its open connections; EOF ends."""
    proxies = {}
    for pair in pairs:
        address, public, private = _pair(pair)
        proxies[public] = await DelayProxy(private, listen_port=public, host=address).start()
    print(json.dumps({"event": "ready", "proxies": sorted(proxies)}), flush=True)
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := await reader.readline():
            port, action = line.decode().split()
            if action == "reset":
                await proxies[int(port)].reset()
            else:
                proxies[int(port)].delay_s = float(action)
            log.info("port %s: %s", port, action)
    finally:
        await asyncio.gather(*(p.close() for p in proxies.values()))


def _pair(pair: str) -> tuple[str, int, int]:
    address, _, ports = pair.rpartition(":")
    public, private = (int(port) for port in ports.split("="))
    return address or "127.0.0.1", public, private


def cmd_proxy(args: argparse.Namespace) -> int:
    asyncio.run(serve(args.pairs))
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "drill-proxy",
        help="the drills' delay proxy (started by `hotweights drill` for the hang scenarios)",
        description="TCP proxies [HOST:]PUBLIC=PRIVATE; each stdin line 'PUBLIC SECONDS' sets that proxy's delay, "
        "'PUBLIC reset' cuts its open connections; EOF ends.",
    )
    p.add_argument("pairs", nargs="+", metavar="[HOST:]PUBLIC=PRIVATE", help="listen port = engine port, on HOST")
    p.set_defaults(func=cmd_proxy)
