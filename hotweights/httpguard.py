"""What every HTTP server of ours (controller, gateway, engine, agent) does before its handlers run.

- Bodies are bounded: a ``Content-Length`` above the limit is 413 before a byte of the body is read; a
  chunked body is counted as it arrives and refused with 413 as soon as it passes the limit; a body that
  takes longer than ``body_timeout_s`` to arrive is 408.
- A JSON body is parsed strictly once, before the handler: non-finite numbers (``NaN``, ``Infinity``,
  ``1e999``), integers beyond 64 bits, nesting deeper than ``MAX_DEPTH``, more than ``MAX_CONTAINERS``
  arrays and objects or ``MAX_VALUES`` values in them (counted before the parse, which would hold the GIL while
  it builds them), duplicate
  keys, invalid UTF-8 and lone surrogates are 400 with one short reason. What passes is plain JSON every
  later step can encode again (a validation error echoing it, a tokenizer, a log line); the handler finds it
  parsed (``parsed_json``). A server may answer a request from its headers alone before its body is read
  (``Early``: an engine's 429 while it is full costs it no body and no parse).
- Connections: one whose request headers have not all arrived ``header_timeout_s`` after it opened (or
  after its previous response) is closed. At ``max_connections`` open at once, a new connection takes the
  place of the one that has waited longest for a request's headers (a slow client, or a keep-alive
  connection idle the longest; a health check's, renewed at every check, is among the last), so slow
  clients cannot lock new ones out; when every open connection is mid-request, the new one is closed. The
  cap is at most half the process's open-files limit (``connection_cap``), so it is reached before
  ``accept`` runs out of descriptors.
- Every request's scope holds ``RECEIVED``: when this process first saw it (monotonic), the moment its connection was
  set up for the first request of a connection, the moment its bytes were read for a later one; a handler that times
  itself from there counts its wait in the event loop before it (``hotweights_gateway_wait_seconds``).

Every refusal is a short JSON body in the server's own error shape (``ErrorShape``); values from the
request are never echoed longer than ``ECHO_CHARS``. Work that scales with the body (the strict parse of
a large one) runs in a worker thread, never on the event loop that answers health checks, and hands the GIL over
as it goes (``_offer_gil``).
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import json
import math
import re
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

MIB = 1 << 20
CONTROLLER_BODY_BYTES = 64 * 1024  # the controller's mutations carry a few small fields
COMPLETION_BODY_BYTES = 4 * MIB  # a completion request (prompt included), at the gateway, engine and agent
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 4096  # per server, at most half its open-files limit (``connection_cap``)
MAX_DEPTH = 32  # JSON nesting; our bodies are two levels deep
MAX_CONTAINERS = 1 << 17  # JSON arrays and objects in one body; a chat's messages and content parts are far fewer
MAX_VALUES = 1 << 18  # values in one body's arrays and objects: 64 prompts of 4096 token ids
MAX_INT = 2**63  # integers beyond a signed 64-bit number are refused
ECHO_CHARS = 200  # values from the request quoted in an answer are cut to this
# A request's answer decided from its scope (method, path, headers) alone, before its body is read: an ASGI app that
# answers it, or None to read the body and go on (``BodyGuard``).
Early = Callable[[Scope], ASGIApp | None]
RECEIVED = "hotweights.received"  # a request scope's key: when this process first saw it (module docstring)
INLINE_PARSE_BYTES = 64 * 1024  # larger JSON bodies are checked in a worker thread
YIELD_EVERY = 256  # numbers a parse takes between two offers of the GIL (some 50 us each)
WALK_CHUNK = 4096  # values whose types the depth check takes at once (well under a millisecond)
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # only a body with one can hold a lone surrogate


class ErrorShape(enum.Enum):
    """How a server words its errors: OpenAI's ``{"error": {...}}`` (engine, gateway, agent) or the
    controller's ``{"detail": ...}``."""

    OPENAI = "openai"
    DETAIL = "detail"

    def body(self, message: str, kind: str = "invalid_request_error") -> dict[str, object]:
        if self is ErrorShape.DETAIL:
            return {"detail": message}
        return {"error": {"message": message, "type": kind, "param": None}}


@dataclass(frozen=True)
class HttpLimits:
    """One server's bounds on what a client may make it hold."""

    body_bytes: int = COMPLETION_BODY_BYTES  # 413 above
    body_timeout_s: float = BODY_TIMEOUT_S  # 408 when the whole body has not arrived by then
    header_timeout_s: float = HEADER_TIMEOUT_S  # the connection is closed when headers take longer
    max_connections: int = MAX_CONNECTIONS  # newer connections beyond this are closed at once


def short(value: object, limit: int = ECHO_CHARS) -> str:
    """``value`` as text, cut to ``limit`` characters (with the length it had) so an answer never
    echoes a large input back."""
    text = str(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


class BadJson(ValueError):
    """A body that is not plain JSON; the message names the problem in a few words."""


def _no_constant(name: str) -> Any:
    raise BadJson(f"{name} is not a JSON number")


_numbers = itertools.count()  # parsed by every parse of this process, for ``_offer_gil``


def _offer_gil() -> None:
    """Once every ``YIELD_EVERY`` numbers parsed, hand the GIL to a thread that waits for it: an engine's generation
    takes it back dozens of times a step, and without this each time waits out a switch interval (5 ms) behind a
    parse of a million numbers, which would slow every request the engine generates; so the parse slows itself."""
    if next(_numbers) % YIELD_EVERY == 0:
        time.sleep(0)  # the syscall's timer slack (some 50 us) is what lets the waiting thread take it


def _finite(text: str) -> float:
    _offer_gil()
    value = float(text)
    if not math.isfinite(value):
        raise BadJson(f"number {short(text, 40)} is out of range")
    return value


def _bounded_int(text: str) -> int:
    _offer_gil()
    if len(text) > 20 or abs(value := int(text)) >= MAX_INT:
        raise BadJson(f"integer {short(text, 40)} is out of range (64 bits)")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise BadJson(f"duplicate key {short(duplicate, 40)!r}")
    return result


def _check_tree(value: object, depth: int = 0) -> None:
    """Nesting depth and lone surrogates (``"\\ud800"`` decodes, but no UTF-8 encoder takes it)."""
    if depth > MAX_DEPTH:
        raise BadJson(f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            raise BadJson("a string holds a lone surrogate (\\ud800-\\udfff)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_tree(key, depth + 1)
            _check_tree(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_tree(item, depth + 1)


def _depth_only(value: object, depth: int = 0) -> None:
    if depth > MAX_DEPTH:
        raise BadJson(f"nested deeper than {MAX_DEPTH} levels")
    children = list(value.values()) if isinstance(value, dict) else value if isinstance(value, list) else []
    for start in range(0, len(children), WALK_CHUNK):  # the types of a chunk of scalars taken in C, at once
        chunk = children[start : start + WALK_CHUNK]
        if {dict, list} & set(map(type, chunk)):
            for item in chunk:
                if isinstance(item, dict | list):
                    _depth_only(item, depth + 1)
        _offer_gil()


def _outside_strings(body: bytes) -> bytes:
    """``body`` without its JSON strings (escaped quotes and backslashes taken out first), in C, at once."""
    return b"".join(body.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[::2])


def _containers(body: bytes) -> int:
    """How many arrays and objects ``body`` opens: its brackets, outside strings when there are many of them."""
    count = body.count(b"[") + body.count(b"{")
    if count <= MAX_CONTAINERS:
        return count
    outside = _outside_strings(body)
    return outside.count(b"[") + outside.count(b"{")


def _values(body: bytes) -> int:
    """At least how many values ``body``'s arrays and objects hold: one more than its commas, outside strings when
    there are many of them (a parse of a million token ids costs a second of the GIL before any check)."""
    count = body.count(b",")
    return 1 + (count if count < MAX_VALUES else _outside_strings(body).count(b","))


NO_JSON = object()  # ``parsed_json`` of a request whose body was not parsed as JSON
JSON_BODY = "hotweights.json_body"  # the ASGI scope's key for the value ``BodyGuard`` parsed


def parsed_json(scope: Scope) -> object:
    """The JSON value of the request's body, as ``BodyGuard`` parsed it; ``NO_JSON`` when it was not (no body, or
    another content type)."""
    return scope.get(JSON_BODY, NO_JSON)


def json_refusal(body: bytes) -> str | None:
    """None when ``body`` is plain JSON (see the module docstring); else why not, in a few words."""
    return parse_json(body)[1]


def parse_json(body: bytes) -> tuple[object, str | None]:
    """``body``'s value and None when it is plain JSON (see the module docstring); else ``NO_JSON`` and why not,
    in a few words."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return NO_JSON, f"the body is not UTF-8 (byte {exc.start})"
    if (containers := _containers(body)) > MAX_CONTAINERS:
        return NO_JSON, f"invalid JSON: {containers} arrays and objects, more than {MAX_CONTAINERS}"
    if (values := _values(body)) > MAX_VALUES:
        return NO_JSON, f"its arrays and objects hold at least {values} values, more than the {MAX_VALUES} a body may"
    try:
        value = json.loads(
            text,
            parse_constant=_no_constant,
            parse_float=_finite,
            parse_int=_bounded_int,
            object_pairs_hook=_unique_keys,
        )
        (_check_tree if SURROGATE_ESCAPE.search(body) else _depth_only)(value)
    except BadJson as exc:
        return NO_JSON, f"invalid JSON: {exc}"
    except RecursionError:
        return NO_JSON, f"invalid JSON: nested deeper than {MAX_DEPTH} levels"
    except ValueError as exc:  # JSONDecodeError, and int()'s digit limit
        return NO_JSON, f"invalid JSON: {short(exc, 80)}"
    return value, None


def _is_json(scope: Scope) -> bool:
    """FastAPI parses a body as JSON when its content type says so or when it has none."""
    for name, value in scope["headers"]:
        if name == b"content-type":
            return b"json" in value.lower()
    return True


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else -1
    return None


class TooLarge(Exception):
    pass


class BodyGuard:
    """ASGI middleware: reads a request's body (bounded in size and time), checks JSON strictly, and
    hands the app the body it read; refusals are answered here and the app never runs."""

    def __init__(self, app: ASGIApp, limits: HttpLimits, shape: ErrorShape, early: Early | None = None) -> None:
        self.app, self.limits, self.shape, self.early = app, limits, shape, early

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        if self.early is not None and (answer := self.early(scope)) is not None:
            return await answer(scope, receive, send)
        length = _content_length(scope)
        if length is not None and length > self.limits.body_bytes:
            return await self._refuse(send, 413, self._too_large())
        try:
            async with asyncio.timeout(self.limits.body_timeout_s):
                body = await self._read(receive)
        except TooLarge:
            return await self._refuse(send, 413, self._too_large())
        except TimeoutError:
            return await self._refuse(send, 408, f"the body did not arrive within {self.limits.body_timeout_s} s")
        if body is None:
            return None  # the client went away
        if body and _is_json(scope):
            parse = parse_json
            value, reason = await asyncio.to_thread(parse, body) if len(body) > INLINE_PARSE_BYTES else parse(body)
            if reason is not None:
                return await self._refuse(send, 400, reason)
            scope[JSON_BODY] = value
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limits.body_bytes:
                raise TooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _too_large(self) -> str:
        return f"the body is larger than this server's limit of {self.limits.body_bytes} bytes"

    async def _refuse(self, send: Send, status: int, message: str) -> None:
        await send_json(send, status, self.shape.body(message), {"connection": "close"})


async def send_json(send: Send, status: int, body: dict[str, object], headers: dict[str, str] | None = None) -> None:
    """A whole JSON response straight through ASGI (no framework in between)."""
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives the body once, then whatever the client does next (a disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if sent:
            return await receive()
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def connection_cap(wanted: int) -> int:
    """``wanted``, or half this process's open-files limit if that is lower: the other half stays for upstream
    connections, files and pipes, so the cap is reached before ``accept`` fails for lack of descriptors."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return wanted if soft == resource.RLIM_INFINITY else max(1, min(wanted, soft // 2))


def guarded_protocol(limits: HttpLimits) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header deadline and a cap on open connections (``HttpLimits``; the module
    docstring says which connection goes at the cap)."""
    waiting: dict[H11Protocol, None] = {}  # this server's connections awaiting a request's headers, oldest first

    class GuardedProtocol(H11Protocol):
        def __init__(self, config: uvicorn.Config, server_state: ServerState, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, server_state, *args, **kwargs)
            self._received: float | None = None  # the next request's RECEIVED, once known
            self._header_timer: asyncio.TimerHandle | None = None
            self._armed_for: object = None  # the request cycle current when the deadline was set

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._received = time.monotonic()
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                if not waiting:
                    transport.abort()  # every open one is mid-request: the newest goes
                    return
                oldest = next(iter(waiting))
                oldest._disarm()
                oldest.transport.abort()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not None and self.cycle is not cycle:  # a request's headers arrived: read just now
                self.cycle.scope[RECEIVED] = self._received or time.monotonic()  # type: ignore[index]
                self._received = None
            if self.cycle is not None and self.cycle is not self._armed_for:
                self._disarm()  # a request's headers arrived

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._armed_for = self.cycle
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_late)
            waiting[self] = None

        def _disarm(self) -> None:
            waiting.pop(self, None)
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            waiting.pop(self, None)
            if self.cycle is self._armed_for and not self.transport.is_closing():
                self.transport.close()

    return GuardedProtocol


def server_config(
    app: ASGIApp, limits: HttpLimits, shape: ErrorShape, early: Early | None = None, **kwargs: Any
) -> uvicorn.Config:
    """A uvicorn config serving ``app`` behind ``BodyGuard`` (with ``early``) and ``guarded_protocol``; ``kwargs`` as
    for ``uvicorn.Config`` (our servers log through our handlers and write no access log). The connection cap
    is ``connection_cap`` of the one in ``limits``."""
    limits = replace(limits, max_connections=connection_cap(limits.max_connections))
    return uvicorn.Config(
        BodyGuard(app, limits, shape, early),
        http=guarded_protocol(limits),
        log_config=None,
        access_log=False,
        **kwargs,
    )
