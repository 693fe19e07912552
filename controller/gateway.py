"""``hotweights gateway``: a reverse proxy that sends ``/v1/*`` to whichever engine is primary now.

The data path must not depend on the controller, so the gateway finds the primary itself: it polls
``GET /primary`` on every upstream (each on its own, so one hung engine never slows the others) and
round-robins among those answering 200 (one per failover group). Clients see no error from a
failover because of three rules:

- While no primary is known, new requests are held (at most ``queue_limit`` of them, each for at most
  ``hold_timeout_s``); a primary appearing releases them at once. Overflow or deadline: 503 saying why.
- A request whose upstream failed before any response byte reached the client (connect error,
  connection closed before the whole body of a non-streamed reply of up to ``WHOLE_BODY_MAX`` bytes, or
  before the first chunk of a stream or a larger reply, or a 503 from an engine that is now a standby or
  draining) is re-sent to the next primary within the same deadline: a non-streamed completion is read
  whole before its first byte is relayed, so a connection cut between its headers and its body (a
  partition) is retried, not relayed as a truncated body. Completions have no side effects, so running
  one twice is safe.
- A completion of one choice (``controller.migration``) is migrated when its upstream fails mid-way
  (connection lost, the engine no longer primary, or its stream ending in an error event): the
  gateway continues it on the next primary from the tokens already sent (saying how many were generated:
  ``REPLAY_HEADER``), within the hold rules (counted from the cut), and the client sees one uninterrupted
  response.
- A request the gateway owes to a failover (one it held while no primary was known, or a migrated
  completion's continuation) is not refused by the new primary's admission: an engine's 429 sends it
  back to wait ``BUSY_RETRY_S``, doubling up to ``BUSY_RETRY_MAX_S``, and try again within the same
  deadline, so a burst released together is queued here rather than answered 429. So is a request whose upstream
  failed before its first byte, once it is re-sent. Each is sent marked owed (``OWED_HEADER``): the engine queues
  it in its deeper queue for such requests, first come first served, and the requests that arrive until the last
  of them is answered join it (``hotweights.admission``), so a new primary takes the burst in order and refuses no
  arrival for it; the 429 retry is for when even that queue is full.
- Any other request whose bytes have been relayed cannot hide a failure: an SSE stream ends with a
  ``data: {"error": ...}`` event and no ``[DONE]`` (as the engine itself ends a cancelled stream);
  any other body is cut off, so the client sees a truncated response, never a silently short one.
  So does a migration that finds no primary in time: its error event says why.

Admission bounds what a worker takes on while a primary is known (``gateway.max_in_flight`` proxied at
once): the rest is answered at once, 429 with ``Retry-After``; while
none is known, the hold rules above apply instead (their 503s carry ``Retry-After`` too). A
request that was in flight on ``gateway.suspect_after`` engines that failed while serving it is not
re-sent to a third: it may be what kills them, so it is answered 422, saying so, and logged as suspect.

Only normalized ``/v1/...`` paths are forwarded: each segment of the raw path (as the client sent it,
before percent-decoding) is a plain RFC 3986 word, so ``..``, ``.``, empty segments and any percent
escape (``%2e%2e``, ``%2f``) are 404 here and never reach an engine's root endpoints.

A proxied request waits for its upstream without a read timeout (a generation takes as long as it
takes); an engine that hangs mid-request is the controller's to fence, which closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from hotweights.admission import Admission, Verdict
from hotweights.contract import (
    NOT_NORMALIZED,
    OWED_HEADER,
    REFUSED_HEADER,
    REPLAY_HEADER,
    WEIGHTS_HEADER,
    Endpoint,
    forwardable_path,
)
from hotweights.controller.config import SUSPECT_AFTER, ClusterConfig
from hotweights.controller.dcs import LeaderUrls
from hotweights.controller.discovery import Discovery, Upstream, reason_of, refused
from hotweights.controller.events import EventLog
from hotweights.controller.gatewayanswers import (
    SegmentFailed,
    UpstreamFailed,
    not_found,
    refusal,
    sse_event,
    suspect_answer,
    suspect_message,
    unavailable,
)
from hotweights.controller.gatewaymetrics import GatewayMetrics
from hotweights.controller.migration import Ledger, Migratable, Refusal, plan_off_loop
from hotweights.httpguard import parsed_json
from hotweights.proxying import HOP_BY_HOP, ProxiedStream
from hotweights.requestschema import Invalid

log = logging.getLogger(__name__)


WHOLE_BODY_MAX = 1 << 20  # a non-streamed reply up to this size is read whole before it is relayed
KEEPALIVE_S = 2.0  # below uvicorn's 5 s, so a pooled connection is never reused as the engine closes it
BUSY_RETRY_S = 0.01  # an owed request's first wait after an engine's 429 (module docstring)
BUSY_RETRY_MAX_S = 0.2  # the longest of those waits
GATEWAY_HEADERS = (REPLAY_HEADER, OWED_HEADER, REFUSED_HEADER)  # set by the gateway only: a client's own are dropped


def upstream_headers(request: Request, owed: bool, upstream: Upstream) -> list[tuple[str, str]]:
    """The client's headers that go on to ``upstream``: not the hop-by-hop ones, nor those only the gateway sets (the
    replay count, ``REPLAY_HEADER``; ``OWED_HEADER``, here when ``owed``; ``REFUSED_HEADER``, here on a fresh completion
    (a POST) when fresh completions were refused on its behalf since the last one, which it is then told of)."""
    headers = [(k, v) for k, v in request.headers.items() if k not in HOP_BY_HOP and k not in GATEWAY_HEADERS]
    if owed:
        return [*headers, (OWED_HEADER, "1")]
    if request.method != "POST":  # not a completion: no slot of the engine's
        return headers
    refused, upstream.refused_for = upstream.refused_for, 0
    return headers + ([(REFUSED_HEADER, str(refused))] if refused else [])


class Gateway:
    """The proxy's policy: where a request goes, how long it may wait, when it is re-sent."""

    def __init__(
        self,
        urls: list[str],
        interval_s: float,
        timeout_s: float,
        queue_limit: int,
        hold_s: float,
        state_file: Path | None = None,
        engine_host: str = "127.0.0.1",
        leaders: LeaderUrls | None = None,
        events: EventLog | None = None,
        admission: Admission | None = None,
        suspect_after: int = SUSPECT_AFTER,
    ) -> None:
        self.events = events or EventLog(None)  # one event per migration, and per one that failed
        self.state_file = state_file  # the controller's state.json: engines added at runtime are routed too
        self.queue_limit = queue_limit
        self.hold_s = hold_s
        self.held = 0
        # Probes and requests use separate pools, so long streams never delay a probe.
        self.probe_client = httpx.AsyncClient()
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S),
        )
        self.discovery = Discovery(urls, self.probe_client, interval_s, timeout_s, engine_host, leaders)
        self.metrics = GatewayMetrics()
        self.suspect_after = suspect_after
        self.admission = admission or default_admission(ClusterConfig())
        self.admission.on_verdict = lambda verdict: self.metrics.admission.labels(verdict.value).inc()
        self.metrics.held.set_function(lambda: self.held)
        self.metrics.primaries.set_function(lambda: len(self.discovery.primaries()))

    async def proxy(self, request: Request) -> Response:
        """Send the request to a primary, holding it while there is none and retrying elsewhere while
        nothing has been relayed yet; 503 (JSON, with the reason) when that fails until the deadline;
        404 for a path that is not a normalized ``/v1/...`` path."""
        path = forwardable_path(request.scope.get("raw_path") or b"")
        if path is None:
            return self.answer(not_found(NOT_NORMALIZED))
        if not self.discovery.available.is_set():  # held under the failover rules, not admission's
            return self.answer(await self.forward(request, path, owed=True))
        if request.method == "POST" and (full_s := self.discovery.full_for()):  # what the engines would answer
            self.discovery.refuse_for_all()
            self.metrics.admission.labels(Verdict.REFUSE.value).inc()
            message = f"overloaded: every primary engine is full; the soonest expects a slot in {full_s * 1000:.0f} ms"
            return self.answer(refusal(429, message, "overloaded"))
        if reason := await self.admission.enter():
            return self.answer(refusal(429, reason, "overloaded"))
        try:
            response = await self.forward(request, path)
        except BaseException:
            self.admission.leave()
            raise
        if isinstance(response, ProxiedStream):
            response.on_close = self.leave  # once the relay ends
        elif isinstance(response, StreamingResponse):  # a migrating stream: once its last segment ends
            response.body_iterator = self.leaving(response.body_iterator)
        else:
            self.admission.leave()
        return self.answer(response)

    async def leave(self) -> None:
        self.admission.leave()

    async def leaving(self, chunks: AsyncIterator) -> AsyncIterator:
        """``chunks``, then the admission slot back (also when the client goes away)."""
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self.admission.leave()

    async def forward(self, request: Request, path: str, owed: bool = False) -> Response:
        """The upstream's response, or the gateway's own refusal (503 no primary in time, 422 suspect). ``owed``:
        the request was held for a failover, so an engine's 429 is retried (module docstring)."""
        body = await request.body()  # kept, so the request can be re-sent
        deadline = time.monotonic() + self.hold_s
        migration = await plan_off_loop(request.method, path, len(body), parsed_json(request.scope))
        if isinstance(migration, Invalid):  # what an engine would refuse (controller.migration)
            return migration.response()
        if isinstance(migration, Migratable):
            return await self.migrating(request, path, Ledger(migration), deadline, owed)
        last_failure = ""
        failed_serving: dict[str, str] = {}  # engine -> how it failed with this request in flight
        busy = 0  # 429s met so far
        while True:
            if refusal := await self.wait_for_primary(deadline):
                if last_failure:
                    refusal += f"; last upstream failure: {last_failure}"
                return unavailable(refusal)
            upstream = self.discovery.pick()
            assert upstream is not None, "available is set and nothing ran since"
            try:
                return await self.send(upstream, request, path, body, migration, owed)
            except UpstreamFailed as exc:
                last_failure = f"{upstream.url}: {exc}"
                if exc.kind == "busy":
                    busy += 1
                    await self.wait_busy(busy, deadline)
                    continue
                self.metrics.upstream_errors.labels(upstream.url, exc.kind).inc()
                self.discovery.suspect(upstream, str(exc))
                if exc.kind == "disconnected":
                    failed_serving[upstream.url] = last_failure
                if len(failed_serving) >= self.suspect_after:
                    return suspect_answer(self.record_suspect(list(failed_serving.values()), body))
                log.info("retrying on the next primary: %s", last_failure)
                self.metrics.retries.inc()
                owed = True  # the failover's now, not its client's load

    def record_suspect(self, failures: list[str], body: bytes) -> str:
        """Log the request as suspect (its size and digest, never its content); the client's message."""
        digest = hashlib.sha256(body).hexdigest()[:16]
        log.warning(
            "suspect request (%d bytes, sha256 %s): %d engines failed while serving it: %s",
            len(body),
            digest,
            len(failures),
            "; ".join(failures),
        )
        self.metrics.suspects.inc()
        return suspect_message(failures)

    async def wait_for_primary(self, deadline: float) -> str | None:
        """None once a primary is known; else why the request gives up (queue full or deadline)."""
        if time.monotonic() >= deadline:
            return self.reject("hold_timeout", f"no primary engine served the request within {self.hold_s} s")
        if self.discovery.available.is_set():
            return None
        if self.held >= self.queue_limit:
            return self.reject(
                "queue_full", f"no primary engine is known and {self.held} requests are already held (queue_limit)"
            )
        self.held += 1
        started = time.monotonic()
        try:
            found = await self.discovery.wait_available(deadline - started)
        finally:
            self.held -= 1
            self.metrics.hold_seconds.observe(time.monotonic() - started)
        return None if found else self.reject("hold_timeout", f"no primary engine appeared within {self.hold_s} s")

    async def wait_busy(self, attempt: int, deadline: float) -> None:
        """The wait of an owed request before its next try after its ``attempt``-th 429 (module docstring)."""
        self.metrics.retries.inc()
        delay = min(BUSY_RETRY_S * 2 ** (attempt - 1), BUSY_RETRY_MAX_S, deadline - time.monotonic())
        await asyncio.sleep(max(delay, 0.0))

    def reject(self, reason: str, message: str) -> str:
        self.metrics.rejected.labels(reason).inc()
        return message

    def answer(self, response: Response) -> Response:
        self.metrics.requests.labels(str(response.status_code)).inc()
        return response

    async def send(
        self,
        upstream: Upstream,
        request: Request,
        path: str,
        body: bytes,
        refusal: Refusal | None = None,
        owed: bool = False,
    ) -> Response:
        """Open the upstream response and read its first chunk: until then a failure can be retried (and an
        engine's 429 too, when the request is ``owed``)."""
        headers = upstream_headers(request, owed, upstream)
        query = f"?{request.url.query}" if request.url.query else ""
        outgoing = self.client.build_request(request.method, upstream.url + path + query, headers=headers, content=body)
        try:
            response = await self.client.send(outgoing, stream=True)
        except httpx.TransportError as exc:
            kind = "connect" if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout) else "disconnected"
            raise UpstreamFailed(kind, f"{type(exc).__name__} {exc}".strip()) from exc
        chunks = response.aiter_raw()
        is_sse = response.headers.get("content-type", "").startswith("text/event-stream")
        whole = not is_sse and int(response.headers.get("content-length", WHOLE_BODY_MAX + 1)) <= WHOLE_BODY_MAX
        try:
            if response.status_code == 503:  # a standby or draining engine; the next primary may serve it
                await response.aread()
                raise UpstreamFailed("unavailable", reason_of(response, path))
            if response.status_code == 429:
                refused(upstream, response)
                if owed:
                    await response.aread()
                    raise UpstreamFailed("busy", reason_of(response, path))
            first = b"".join([chunk async for chunk in chunks]) if whole else await anext(chunks, b"")
        except httpx.TransportError as exc:
            await response.aclose()
            raise UpstreamFailed("disconnected", f"{type(exc).__name__} {exc}".strip()) from exc
        except BaseException:
            await response.aclose()
            raise
        reply_headers = {k: v for k, v in response.headers.items() if k not in HOP_BY_HOP - {"content-length"}}
        reply_headers["x-hotweights-upstream"] = upstream.url
        relayed = self.relay(upstream, first, chunks, is_sse, refusal)
        return ProxiedStream(relayed, response.status_code, reply_headers, response)

    async def relay(
        self,
        upstream: Upstream,
        first: bytes,
        chunks: AsyncIterator[bytes],
        is_sse: bool,
        refusal: Refusal | None = None,
    ) -> AsyncIterator[bytes]:
        # An SSE stream is relayed whole events at a time, so that the error event that ends a failed one
        # never lands in the middle of an event that was cut off (a read may end anywhere).
        partial = b""

        def whole_events(chunk: bytes) -> bytes:
            nonlocal partial
            if not is_sse:
                return chunk
            partial += chunk
            end = partial.rfind(b"\n\n") + 2
            ready, partial = (partial[:end], partial[end:]) if end >= 2 else (b"", partial)
            return ready

        if ready := whole_events(first):
            yield ready
        try:
            async for chunk in chunks:
                if ready := whole_events(chunk):
                    yield ready
            if partial:
                yield partial
        except httpx.TransportError as exc:
            why = f"it is not migrated: {refusal}" if refusal else "it cannot be retried"
            message = f"the upstream {upstream.url} failed mid-response ({type(exc).__name__}); {why}"
            log.warning("%s", message)
            self.metrics.upstream_errors.labels(upstream.url, "mid_stream").inc()
            self.discovery.suspect(upstream, message)
            if not is_sse:
                raise  # the server aborts the connection: a truncated body, never a silently short one
            event = {"error": {"message": message, "type": "unavailable", "param": None}}
            yield f"data: {json.dumps(event)}\n\n".encode()

    async def migrating(
        self, request: Request, path: str, ledger: Ledger, deadline: float, owed: bool = False
    ) -> Response:
        """A migratable completion: streamed from the engine with token ids, continued on the next primary
        whenever its upstream fails mid-way; the client's stream, or its whole JSON reply, is built here."""
        opened = await self.open_segment(request, path, ledger.request.upstream_body(), deadline, ledger, owed)
        if isinstance(opened, Response):
            return opened
        ledger.weights = opened[1].headers.get(WEIGHTS_HEADER)
        events = self.migrated_events(request, ledger, *opened)
        if ledger.request.stream:
            headers = {"cache-control": "no-cache", "x-hotweights-upstream": opened[0].url}
            return StreamingResponse(self.client_sse(ledger, events), media_type="text/event-stream", headers=headers)
        try:
            async for _ in events:
                pass
        except SegmentFailed as exc:
            return exc.answer()
        return JSONResponse(ledger.whole(), headers={"x-hotweights-upstream": opened[0].url})

    async def open_segment(
        self, request: Request, path: str, body: dict, deadline: float, ledger: Ledger, owed: bool, replay: int = 0
    ) -> tuple[Upstream, httpx.Response] | Response:
        """An upstream's event stream for ``body``, retried on the next primary until ``deadline`` while it
        fails before its first byte (an ``owed`` one after a 429 too); an engine's own non-200 answer (a 400,
        say) as it is; 503 at the deadline; 422 once ``suspect_after`` engines have failed with the request in
        flight. ``replay``: a continuation's generated tokens at the end of its prompt (``REPLAY_HEADER``)."""
        last_failure = ""
        busy = 0  # 429s met so far
        while True:
            if refusal := await self.wait_for_primary(deadline):
                return unavailable(refusal + (f"; last upstream failure: {last_failure}" if last_failure else ""))
            upstream = self.discovery.pick()
            assert upstream is not None, "available is set and nothing ran since"
            try:
                headers = upstream_headers(request, owed, upstream) + ([(REPLAY_HEADER, str(replay))] if replay else [])
                return await self.open_stream(upstream, path, headers, body, owed)
            except UpstreamFailed as exc:
                last_failure = f"{upstream.url}: {exc}"
                if exc.kind == "busy":
                    busy += 1
                    await self.wait_busy(busy, deadline)
                    continue
                self.metrics.upstream_errors.labels(upstream.url, exc.kind).inc()
                self.discovery.suspect(upstream, str(exc))
                if exc.kind == "disconnected":
                    ledger.failed_on[upstream.url] = last_failure
                if len(ledger.failed_on) >= self.suspect_after:
                    return suspect_answer(
                        self.record_suspect(list(ledger.failed_on.values()), json.dumps(body).encode())
                    )
                log.info("retrying on the next primary: %s", last_failure)
                self.metrics.retries.inc()
                owed = True  # the failover's now, not its client's load

    async def open_stream(
        self, upstream: Upstream, path: str, headers: list[tuple[str, str]], body: dict, owed: bool
    ) -> tuple[Upstream, httpx.Response] | Response:
        """The upstream's event stream; any other answer read whole and returned as it is (an engine's
        400, say); UpstreamFailed while it can go elsewhere (connection failed or cut, a 503) or, when ``owed``,
        wait for a slot (a 429)."""
        outgoing = self.client.build_request("POST", upstream.url + path, headers=headers, json=body)
        try:
            response = await self.client.send(outgoing, stream=True)
        except httpx.TransportError as exc:
            kind = "connect" if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout) else "disconnected"
            raise UpstreamFailed(kind, f"{type(exc).__name__} {exc}".strip()) from exc
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
        headers = {"x-hotweights-upstream": upstream.url}
        if retry_after := response.headers.get("retry-after"):
            headers["retry-after"] = retry_after
        return Response(content, status_code=response.status_code, media_type=media, headers=headers)

    async def migrated_events(
        self, request: Request, ledger: Ledger, upstream: Upstream, response: httpx.Response
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
                return
            except SegmentFailed as exc:
                cut_at, failure = time.monotonic(), f"{upstream.url}: {exc}"
                self.metrics.upstream_errors.labels(upstream.url, "mid_stream").inc()
                self.discovery.suspect(upstream, str(exc))
                if exc.while_serving:
                    ledger.failed_on[upstream.url] = failure
            if len(ledger.failed_on) >= self.suspect_after:
                failures, body = list(ledger.failed_on.values()), json.dumps(ledger.request.body).encode()
                raise SegmentFailed(self.record_suspect(failures, body), suspect=True)
            body = ledger.cut()
            if body is None:  # the budget was spent before the failure: nothing is left to generate
                return
            upstream, response = await self.reopen(request, ledger, body, failure, cut_at)

    async def reopen(
        self, request: Request, ledger: Ledger, body: dict, failure: str, cut_at: float
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
            opened = await self.open_segment(request, path, body, deadline, ledger, True, replay)
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
                "migration_restarted", f"{ledger.id} runs again from its prompt: {why}", request=ledger.id
            )
            ledger.restart()
            body = ledger.request.upstream_body()
        ledger.weights = ledger.weights or weights
        replayed = len(ledger.released)  # none once it runs again from its prompt
        self.metrics.tokens_replayed.inc(replayed)
        self.metrics.migrations.labels("migrated").inc()
        to = opened[0].url
        self.events.record(
            "migration",
            f"{ledger.id} continues on {to} after {replayed} tokens: {failure}",
            request=ledger.id,
            to=to,
            tokens_replayed=replayed,
            reopen_ms=round((time.monotonic() - cut_at) * 1000, 1),
        )
        return opened

    def migration_failed(self, ledger: Ledger, message: str) -> None:
        self.metrics.migrations.labels("failed").inc()
        self.events.record("migration_failed", message, request=ledger.id)

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
            if upstream.lost.is_set():  # cut here: a switchover or a hang, not the request's doing
                raise SegmentFailed("the engine is no longer primary") from exc
            raise SegmentFailed(type(exc).__name__, while_serving=True) from exc
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

    def health(self) -> dict[str, object]:
        return {
            "upstreams": [u.describe() for u in self.discovery.upstreams],
            "primaries": [u.url for u in self.discovery.primaries()],
            "held": self.held,
            "queue_limit": self.queue_limit,
            "in_flight": self.admission.serving,
            "waiting": self.admission.waiting,
            "hold_timeout_s": self.hold_s,
        }

    @contextlib.asynccontextmanager
    async def running(self, _: Starlette) -> AsyncIterator[None]:
        """Probe every upstream once before serving (uvicorn accepts only after this returns, so a
        gateway handed a listening socket routes its first request at once), keep probing while
        serving; on shutdown stop probing, then close both pools."""
        await self.discovery.probe_all()
        probing = asyncio.create_task(self.discovery.run(self.state_file))
        try:
            yield
        finally:
            probing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await probing
            await self.client.aclose()
            await self.probe_client.aclose()


def default_admission(config: ClusterConfig) -> Admission:
    """As many requests proxied at once as ``config`` derives, none waiting here: the engines queue (what
    they generate and queue is what the gateway passes on), so a second queue would only add latency."""
    return Admission(config.gateway_in_flight(), 0, config.engine.queue_timeout_s)
