"""The gateway's migrating completions (``gateway.migration`` says which, and keeps what each has sent): streamed
from an engine with token ids and continued on the next primary whenever their upstream fails mid-way, within the
hold rules; and the headers every request to an upstream carries.

``MigratingProxy`` is the half of ``gateway.policy.Gateway`` that sends them: it uses the gateway's request
pool, discovery, metrics, events and suspect guard, and its hold rules (the methods it declares).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from hotweights.contract import (
    GATHER_MS,
    GATHER_MS_HEADER,
    OWED_HEADER,
    REPLAY_HEADER,
    UPSTREAM_HEADER,
    WEIGHTS_HEADER,
    Endpoint,
)
from hotweights.controller.events import EventLog
from hotweights.controller.suspects import is_started
from hotweights.eventkinds import EventKind
from hotweights.gateway.answers import SegmentFailed, Unaccepted, UpstreamFailed, sse_event, unavailable
from hotweights.gateway.discovery import Discovery, Upstream, reason_of, refused
from hotweights.gateway.metrics import GatewayMetrics
from hotweights.gateway.migration import Ledger
from hotweights.gateway.suspectguard import SuspectGuard, Tracked
from hotweights.proxying import HOP_BY_HOP

log = logging.getLogger(__name__)

GATEWAY_HEADERS = (REPLAY_HEADER, OWED_HEADER, GATHER_MS_HEADER)  # set by the gateway only: a client's own are dropped


def upstream_headers(request: Request, owed: bool) -> list[tuple[str, str]]:
    """The client's headers that go on to an engine: not the hop-by-hop ones, nor those only the gateway sets (the
    replay count, ``REPLAY_HEADER``; ``OWED_HEADER``, here when ``owed``)."""
    headers = [(k, v) for k, v in request.headers.items() if k not in HOP_BY_HOP and k not in GATEWAY_HEADERS]
    return [*headers, (OWED_HEADER, "1")] if owed else headers


T = TypeVar("T")
# What httpcore's connect raises through anyio when the engine's end closed between the connect and httpcore's look at
# the new connection (seen on an H100 as a SIGKILLed primary went down): the request was never sent, so it goes on
# to the next primary, as a failed connect does.
GONE = "'NoneType' object has no attribute 'getpeername'"


async def opened(
    client: httpx.AsyncClient, upstream: Upstream, outgoing: httpx.Request, streamed: bool
) -> httpx.Response:
    """``upstream``'s response to ``outgoing``, once its headers came (an answer: ``Upstream.responded_at``);
    UpstreamFailed when the connection failed or was cut before, started or not as ``controller.suspects.is_started``
    says of a request that asked for a stream (``streamed``) or not."""
    try:
        response = await client.send(outgoing, stream=True)
        upstream.responded_at = time.monotonic()
        return response
    except httpx.TransportError as exc:
        kind = "connect" if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout) else "disconnected"
        started = kind == "disconnected" and is_started(answer_began=False, streamed=streamed)
        timed_out = isinstance(exc, httpx.ConnectTimeout)
        raise UpstreamFailed(kind, f"{type(exc).__name__} {exc}".strip(), started, timed_out) from exc
    except AttributeError as exc:  # httpcore asks anyio of a connection whose socket is already gone (``GONE``)
        if GONE not in str(exc):
            raise
        raise UpstreamFailed("connect", f"the connection closed as it opened ({exc})", started=False) from exc


class MigratingProxy:
    """Migrating completions, for ``gateway.policy.Gateway`` (module docstring)."""

    client: httpx.AsyncClient  # the request pool
    discovery: Discovery
    metrics: GatewayMetrics
    events: EventLog
    guard: SuspectGuard
    hold_s: float

    async def wait_for_primary(self, deadline: float) -> str | None:
        """None once a primary is known; else why the request gives up (queue full or deadline)."""
        raise NotImplementedError

    async def wait_busy(self, attempt: int, deadline: float) -> None:
        """The wait of an owed request before its next try after its ``attempt``-th 429."""
        raise NotImplementedError

    async def upstream_failed(
        self, upstream: Upstream, exc: UpstreamFailed, tracked: Tracked, failure: str, deadline: float
    ) -> JSONResponse | None:
        """None to send the request to the next primary after ``exc``, or the 422 that refuses to."""
        raise NotImplementedError

    async def migrating(
        self, request: Request, path: str, ledger: Ledger, tracked: Tracked, deadline: float, owed: bool = False
    ) -> Response:
        """A migratable completion: streamed from the engine with token ids, continued on the next primary
        whenever its upstream fails mid-way; the client's stream, or its whole JSON reply, is built here."""
        gathered = not ledger.request.stream
        body = ledger.request.upstream_body()
        opened = await self.open_segment(request, path, body, deadline, tracked, owed, gathered=gathered)
        if isinstance(opened, Response):
            return opened
        ledger.weights = opened[1].headers.get(WEIGHTS_HEADER)
        events = self.migrated_events(request, ledger, tracked, *opened)
        if ledger.request.stream:
            headers = {"cache-control": "no-cache", UPSTREAM_HEADER: opened[0].url}
            return StreamingResponse(self.client_sse(ledger, events), media_type="text/event-stream", headers=headers)
        try:
            async for _ in events:
                pass
        except SegmentFailed as exc:
            return exc.answer()
        return JSONResponse(ledger.whole(), headers={UPSTREAM_HEADER: opened[0].url})

    async def open_segment(
        self,
        request: Request,
        path: str,
        body: dict,
        deadline: float,
        tracked: Tracked,
        owed: bool,
        replay: int = 0,
        gathered: bool = False,
    ) -> tuple[Upstream, httpx.Response] | Response:
        """An upstream's event stream for ``body``, retried on the next primary until ``deadline`` while it
        fails before its first byte (an ``owed`` one after a 429 too); an engine's own non-200 answer (a 400,
        say) as it is; 503 at the deadline; 422 once it is suspect (``controller.suspects``). ``replay``: a
        continuation's generated tokens at the end of its prompt (``REPLAY_HEADER``); ``gathered``: for a client
        that asked for no stream, its tokens in chunks of up to GATHER_MS (``GATHER_MS_HEADER``)."""
        extra = [(REPLAY_HEADER, str(replay))] if replay else []
        extra += [(GATHER_MS_HEADER, str(GATHER_MS))] if gathered else []

        async def attempt(upstream: Upstream, owed: bool) -> tuple[Upstream, httpx.Response] | Response:
            return await self.open_stream(upstream, path, upstream_headers(request, owed) + extra, body, owed)

        return await self.retried(attempt, tracked, deadline, owed)

    async def retried(
        self, attempt: Callable[[Upstream, bool], Awaitable[T]], tracked: Tracked, deadline: float, owed: bool
    ) -> T | Response:
        """``attempt`` on the current primary, again on the next one while it fails before any byte reached the
        client (UpstreamFailed; after a 429, a wait first, and only when ``owed``, which a failure makes it); 503
        once no primary comes by ``deadline``, which an engine failing with the request in flight moves to
        ``hold_s`` after that failure if later (a failover owes it a hold of its own, as a migrated completion's
        continuation has: it may have waited its queue budget there), 422 once the request is suspect
        (``upstream_failed``)."""
        last_failure = ""
        busy = 0  # 429s met so far
        while True:
            if gave_up := await self.wait_for_primary(deadline):
                return unavailable(gave_up + (f"; last upstream failure: {last_failure}" if last_failure else ""))
            upstream = self.discovery.pick()
            assert upstream is not None, "available is set and nothing ran since"
            try:
                return await attempt(upstream, owed)
            except UpstreamFailed as exc:
                last_failure = f"{upstream.url}: {exc}"
                waits = exc.kind == "busy"
                if exc.timed_out and self.discovery.saturated(upstream):  # not lost: its load (``saturated``)
                    if not owed:
                        return Unaccepted(upstream.url)
                    waits = True
                if waits:
                    busy += 1
                    await self.wait_busy(busy, deadline)
                    continue
                if exc.kind == "disconnected":
                    deadline = max(deadline, time.monotonic() + self.hold_s)
                if suspect := await self.upstream_failed(upstream, exc, tracked, last_failure, deadline):
                    return suspect
                owed = True  # the failover's now, not its client's load

    async def open_stream(
        self, upstream: Upstream, path: str, headers: list[tuple[str, str]], body: dict, owed: bool
    ) -> tuple[Upstream, httpx.Response] | Response:
        """The upstream's event stream; any other answer read whole and returned as it is (an engine's
        400, say); UpstreamFailed while it can go elsewhere (connection failed or cut, a 503) or, when ``owed``,
        wait for a slot (a 429)."""
        outgoing = self.client.build_request("POST", upstream.url + path, headers=headers, json=body)
        response = await opened(self.client, upstream, outgoing, streamed=True)
        if response.status_code == 200 and response.headers.get("content-type", "").startswith("text/event-stream"):
            return upstream, response
        try:
            content = await response.aread()
        except httpx.TransportError as exc:
            raise UpstreamFailed("disconnected", f"{type(exc).__name__} {exc}".strip()) from exc
        finally:
            await response.aclose()
        if response.status_code == 503:  # a standby or draining engine; the next primary may serve it
            raise UpstreamFailed("unavailable", reason_of(response, path))
        if response.status_code == 429:
            refused(upstream, response)
            if owed:
                raise UpstreamFailed("busy", reason_of(response, path))
        media = response.headers.get("content-type")
        headers = {UPSTREAM_HEADER: upstream.url}
        if retry_after := response.headers.get("retry-after"):
            headers["retry-after"] = retry_after
        return Response(content, status_code=response.status_code, media_type=media, headers=headers)

    async def migrated_events(
        self, request: Request, ledger: Ledger, tracked: Tracked, upstream: Upstream, response: httpx.Response
    ) -> AsyncIterator[dict]:
        """The client's chunks, across as many upstreams as it takes; SegmentFailed when the request
        cannot go on (no primary in time: the reason says so)."""
        cut_at: float | None = None
        while True:
            try:
                async for chunk in self.segment(upstream, response, ledger):
                    if cut_at is not None:
                        self.metrics.cut_to_next_token.observe(time.monotonic() - cut_at)
                        cut_at = None
                    yield chunk
                tracked.answered = not upstream.failure  # an engine fenced for a stall may answer as it is
                return
            except SegmentFailed as exc:
                cut_at, failure = time.monotonic(), f"{upstream.url}: {exc}"
                self.metrics.upstream_errors.labels(upstream.url, "mid_stream").inc()
                self.discovery.suspect(upstream, str(exc))
                stalled = upstream if exc.stalled else None
                deadline = cut_at + self.hold_s
                if exc.failure and (
                    suspect := await self.guard.on_failure(tracked, exc.failure, failure, deadline, stalled)
                ):
                    raise SegmentFailed(suspect, suspect=True) from exc
            body = ledger.cut()
            if body is None:  # the budget was spent before the failure: nothing is left to generate
                return
            upstream, response = await self.reopen(request, ledger, tracked, body, failure, cut_at)

    async def reopen(
        self, request: Request, ledger: Ledger, tracked: Tracked, body: dict, failure: str, cut_at: float
    ) -> tuple[Upstream, httpx.Response]:
        """The continuation's stream on the next primary, held by the hold rules counted from the cut;
        SegmentFailed when none serves it in time. Either way one event says so. A next primary that computes
        with other weights (a model update's) never continues it: the request runs again from its prompt there
        when its client saw nothing yet, else it fails, saying why."""
        log.info("migrating %s after %d tokens: %s", ledger.id, len(ledger.released), failure)
        deadline = cut_at + self.hold_s
        while True:
            # A continuation is a completion of token ids; a request that has none yet is sent again as it was.
            path, replay = (
                (Endpoint.COMPLETIONS, len(ledger.released))
                if ledger.prompt_ids is not None
                else (ledger.request.path, 0)
            )
            gathered = not ledger.request.stream
            opened = await self.open_segment(request, path, body, deadline, tracked, True, replay, gathered)
            if isinstance(opened, Response):
                reason = bytes(opened.body).decode(errors="replace")[:300]
                message = f"the upstream {failure}; the request could not be migrated: {reason}"
                self.migration_failed(ledger, message)
                raise SegmentFailed(message, suspect=opened.status_code == 422)
            if ledger.continues_on(weights := opened[1].headers.get(WEIGHTS_HEADER)):
                break
            await opened[1].aclose()
            why = f"the next primary {opened[0].url} serves other weights ({weights}, not {ledger.weights})"
            if not ledger.client_saw_nothing:
                message = f"the upstream {failure}; the request cannot be continued: {why}"
                self.migration_failed(ledger, message)
                raise SegmentFailed(message)
            self.events.record(
                EventKind.MIGRATION_RESTARTED, f"{ledger.id} runs again from its prompt: {why}", request=ledger.id
            )
            ledger.restart()
            body = ledger.request.upstream_body()
        ledger.weights = ledger.weights or weights
        replayed = len(ledger.released)  # none once it runs again from its prompt
        self.metrics.tokens_replayed.inc(replayed)
        self.metrics.migrations.labels("migrated").inc()
        to = opened[0].url
        self.events.record(
            EventKind.MIGRATION,
            f"{ledger.id} continues on {to} after {replayed} tokens: {failure}",
            request=ledger.id,
            to=to,
            tokens_replayed=replayed,
            reopen_ms=round((time.monotonic() - cut_at) * 1000, 1),
        )
        return opened

    def migration_failed(self, ledger: Ledger, message: str) -> None:
        self.metrics.migrations.labels("failed").inc()
        self.events.record(EventKind.MIGRATION_FAILED, message, request=ledger.id)

    async def segment(self, upstream: Upstream, response: httpx.Response, ledger: Ledger) -> AsyncIterator[dict]:
        """One upstream's chunks, as the client sees them; SegmentFailed unless it ends with ``[DONE]``.
        The response is closed however this ends, and at once when the upstream stops being primary."""

        async def close_when_lost() -> None:
            await upstream.lost.wait()
            await response.aclose()

        watch = asyncio.create_task(close_when_lost())
        try:
            async for line in response.aiter_lines():
                payload = line.removeprefix("data: ").strip()
                if not line.startswith("data: ") or not payload:
                    continue
                if payload == "[DONE]":
                    return
                chunk = json.loads(payload)
                if "error" in chunk:
                    raise SegmentFailed(f"the stream ended with an error: {chunk['error'].get('message')}")
                if (shown := ledger.take(chunk)) is not None:
                    yield shown
                if ledger.stopped:
                    return  # at a stop string: closing the response ends the generation
            raise SegmentFailed("the stream ended before [DONE]")
        except (httpx.HTTPError, httpx.StreamError, ValueError) as exc:
            if upstream.failure:  # its probes went unanswered (hung, stalled or dead): cut here
                raise SegmentFailed("the engine stopped answering", failure=upstream.failure, stalled=True) from exc
            if upstream.lost.is_set():  # cut here: a planned role change, not a failure
                raise SegmentFailed("the engine is no longer primary") from exc
            failure = self.discovery.failed(upstream, type(exc).__name__)
            raise SegmentFailed(type(exc).__name__, failure=failure) from exc
        finally:
            watch.cancel()
            await response.aclose()

    async def client_sse(self, ledger: Ledger, events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        """A migrated completion as server-sent events: its chunks, the usage chunk if asked, ``[DONE]``;
        an error event (and no ``[DONE]``) when it could not be migrated."""
        try:
            async for chunk in events:
                yield sse_event(chunk)
        except SegmentFailed as exc:
            log.warning("%s", exc)
            yield exc.event()
            return
        if ledger.request.include_usage:
            yield sse_event(ledger.usage_chunk())
        yield b"data: [DONE]\n\n"
