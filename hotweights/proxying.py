"""Relaying HTTP to an engine: what the gateway and the agent share.

Hop-by-hop headers are never forwarded; a relayed response closes its upstream however the relay
ends (done, failed, client gone), so an abandoned generation is cancelled on the engine too. A stream of
server-sent events may be relayed with each of its chunks rewritten (``rewritten_events``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

# Per-connection headers (RFC 9110 section 7.6.1) and those httpx recomputes; never forwarded.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)


class ProxiedStream(StreamingResponse):
    """Relays an upstream response and closes it however the relay ends (done, failed, client gone),
    so an abandoned generation is cancelled on the engine too; then awaits ``on_close``, if given."""

    def __init__(
        self,
        content: AsyncIterator[bytes],
        status: int,
        headers: dict[str, str],
        upstream: httpx.Response,
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(content, status_code=status, headers=headers)
        self.upstream = upstream
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.upstream.aclose()
            if self.on_close is not None:
                await self.on_close()


async def rewritten_events(lines: AsyncIterator[str], rewrite: Callable[[dict], dict]) -> AsyncIterator[bytes]:
    """The server-sent events of ``lines`` (``data: {json}`` lines, as the engines stream) with each JSON object
    passed through ``rewrite``; any other payload passed on as it is, ``[DONE]`` passed on as the end, lines that
    carry no data dropped."""
    async for line in lines:
        payload = line.removeprefix("data: ").strip()
        if not line.startswith("data: ") or not payload:
            continue
        if payload == "[DONE]":
            yield b"data: [DONE]\n\n"
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            chunk = None
        if isinstance(chunk, dict):
            payload = json.dumps(rewrite(chunk), separators=(",", ":"))
        yield f"data: {payload}\n\n".encode()
