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
  draining) is re-sent to the next primary within the same deadline (or within ``hold_timeout_s`` of the failure,
  when later, where its engine failed with it in flight): a non-streamed completion is read
  whole before its first byte is relayed, so a connection cut between its headers and its body (a
  partition) is retried, not relayed as a truncated body. Completions have no side effects, so running
  one twice is safe.
- A completion of one choice (``gateway.migration``; ``gateway.migratingproxy`` sends it) is migrated
  when its upstream fails mid-way (connection lost, the engine no longer primary, or its stream ending in an error
  event): the gateway continues it on the next primary from the tokens already sent (saying how many were
  generated: ``REPLAY_HEADER``), within the hold rules (counted from the cut), and the client sees one
  uninterrupted response.
- A request the gateway owes to a failover (one it held while no primary was known, a migrated completion's
  continuation, or one whose upstream failed before its first byte, once it is re-sent) is sent marked owed
  (``OWED_HEADER``): the engine queues it whatever its expected start (``hotweights.admission``), first come first
  served, so a new primary takes the burst in order. Should an engine answer it 429 all the same (one that does not
  know the mark), it waits ``BUSY_RETRY_S``, doubling up to ``BUSY_RETRY_MAX_S``, and tries again within the same
  deadline, so a burst released together is queued here rather than answered 429.
- Any other request whose bytes have been relayed cannot hide a failure: an SSE stream ends with a
  ``data: {"error": ...}`` event and no ``[DONE]`` (as the engine itself ends a cancelled stream);
  any other body is cut off, so the client sees a truncated response, never a silently short one.
  So does a migration that finds no primary in time: its error event says why.

Admission bounds what a worker takes on while a primary is known (``gateway.max_in_flight`` proxied at
once): the rest is answered at once, 429 with ``Retry-After``; while
none is known, the hold rules above apply instead (their 503s carry ``Retry-After`` too). A request that
engines failed while serving (their connection cut, or their probes unanswered: a stall) may be what kills them:
``controller.suspects`` says when it is not sent again, when one with the same body is refused at once, and when
its client's are (``gateway.suspectguard`` applies those rules).

Only normalized ``/v1/...`` paths are forwarded: each segment of the raw path (as the client sent it,
before percent-decoding) is a plain RFC 3986 word, so ``..``, ``.``, empty segments and any percent
escape (``%2e%2e``, ``%2f``) are 404 here and never reach an engine's root endpoints.

A proxied request waits for its upstream without a read timeout (a generation takes as long as it
takes); an engine that hangs mid-request is the controller's to fence, which closes the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from hotweights.admission import Admission, Held, Verdict
from hotweights.contract import NOT_NORMALIZED, UPSTREAM_HEADER, forwardable_path
from hotweights.controller.config import ClusterConfig
from hotweights.controller.dcs import LeaderUrls
from hotweights.controller.events import EventLog
from hotweights.controller.suspects import SuspectLimits
from hotweights.gateway.answers import Unaccepted, UpstreamFailed, not_found, refusal, suspect_answer
from hotweights.gateway.discovery import Discovery, Upstream, reason_of, refused
from hotweights.gateway.metrics import GatewayMetrics
from hotweights.gateway.migratingproxy import MigratingProxy, opened, upstream_headers
from hotweights.gateway.migration import Ledger, Migratable, Refusal, plan_off_loop
from hotweights.gateway.suspectguard import SuspectGuard, Tracked
from hotweights.gateway.suspectjournal import SuspectJournal
from hotweights.httpguard import RECEIVED, parsed_json
from hotweights.proxying import HOP_BY_HOP, ProxiedStream
from hotweights.requestschema import Invalid

log = logging.getLogger(__name__)


WHOLE_BODY_MAX = 1 << 20  # a non-streamed reply up to this size is read whole before it is relayed
KEEPALIVE_S = 2.0  # below uvicorn's 5 s, so a pooled connection is never reused as the engine closes it
BUSY_RETRY_S = 0.01  # an owed request's first wait after an engine's 429 (module docstring)
BUSY_RETRY_MAX_S = 0.2  # the longest of those waits


class Gateway(MigratingProxy):
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
        suspects: SuspectLimits | None = None,
        suspects_file: Path | None = None,
    ) -> None:
        """``suspects``: the suspect rules' bounds (default: ``[gateway]``'s); ``suspects_file``: where the workers
        share what they learn of them (``gateway.suspectjournal``; None: this worker keeps it)."""
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
        limits = suspects or ClusterConfig().gateway.suspect_limits()
        self.guard = SuspectGuard(limits, SuspectJournal(suspects_file), self.metrics)
        self.admission = admission or default_admission(ClusterConfig())
        self.admission.on_verdict = lambda verdict: self.metrics.admission.labels(verdict.value).inc()
        self.metrics.held.set_function(lambda: self.held)
        self.metrics.primaries.set_function(lambda: len(self.discovery.primaries()))

    async def proxy(self, request: Request) -> Response:
        """Send the request to a primary, holding it while there is none and retrying elsewhere while
        nothing has been relayed yet; 503 (JSON, with the reason) when that fails until the deadline;
        404 for a path that is not a normalized ``/v1/...`` path."""
        arrived = time.monotonic()
        if (received := request.scope.get(RECEIVED)) is not None:
            self.metrics.wait_seconds.observe(arrived - received)
        path = forwardable_path(request.scope.get("raw_path") or b"")
        if path is None:
            return self.answer(not_found(NOT_NORMALIZED), arrived)
        tracked = await self.guard.track(request)
        if suspect := self.guard.on_arrival(tracked):
            return self.answer(suspect, arrived)
        if not self.discovery.available.is_set():  # held under the failover rules, not admission's
            forwarding = self.forward(request, path, tracked, owed=True)
            return self.answer(await self.ending(forwarding, tracked, None), arrived)
        if request.method == "POST" and (full_s := self.discovery.full_for()):  # what the engines would answer
            self.metrics.admission.labels(Verdict.REFUSE.value).inc()
            message = f"overloaded: every primary engine is full; the soonest expects a slot in {full_s * 1000:.0f} ms"
            return self.answer(refusal(429, message, "overloaded"), arrived)
        held = await self.admission.enter()
        if not isinstance(held, Held):
            return self.answer(refusal(429, held.reason, "overloaded"), arrived)
        return self.answer(await self.ending(self.forward(request, path, tracked), tracked, held), arrived)

    async def ending(self, forwarding: Awaitable[Response], tracked: Tracked, held: Held | None) -> Response:
        """The response ``forwarding`` gives; once it ends (a relay or a migrating stream: when its last byte is
        sent, or the client goes away), the request's end is told to the suspect rules and the admission slot it
        ``held``, if any, given back."""

        async def end() -> None:
            if held is not None:
                self.admission.leave(held)
            self.guard.finish(tracked)

        try:
            response = await forwarding
        except BaseException:
            await end()
            raise
        if isinstance(response, ProxiedStream):
            response.on_close = end  # once the relay ends
        elif isinstance(response, StreamingResponse):  # a migrating stream: once its last segment ends
            response.body_iterator = ending_with(response.body_iterator, end)
        else:
            await end()
        return response

    async def forward(self, request: Request, path: str, tracked: Tracked, owed: bool = False) -> Response:
        """The upstream's response, or the gateway's own refusal (503 no primary in time, 422 suspect). ``owed``:
        the request was held for a failover, so an engine's 429 is retried (module docstring)."""
        body = await request.body()  # kept, so the request can be re-sent
        deadline = time.monotonic() + self.hold_s
        migration = await plan_off_loop(request.method, path, len(body), parsed_json(request.scope))
        if isinstance(migration, Invalid):  # what an engine would refuse (gateway.migration)
            return migration.response()
        if isinstance(migration, Migratable):
            return await self.migrating(request, path, Ledger(migration), tracked, deadline, owed)

        async def attempt(upstream: Upstream, owed: bool) -> Response:
            return await self.send(upstream, request, path, body, tracked, migration, owed)

        return await self.retried(attempt, tracked, deadline, owed)

    async def upstream_failed(
        self, upstream: Upstream, exc: UpstreamFailed, tracked: Tracked, failure: str, deadline: float
    ) -> JSONResponse | None:
        """``exc`` before any byte reached the client: None to send the request to the next primary, or the 422
        that refuses to (``controller.suspects``), when its connection was cut there."""
        self.metrics.upstream_errors.labels(upstream.url, exc.kind).inc()
        if exc.kind != "disconnected":  # not a failure with it in flight: it did not get there, or a role change
            self.discovery.suspect(upstream, str(exc))
        elif not exc.started:  # it only waited for its slots there: the failure is not its (controller.suspects)
            self.discovery.failed(upstream, str(exc))
        elif suspect := await self.guard.on_failure(
            tracked, self.discovery.failed(upstream, str(exc)), failure, deadline
        ):
            return suspect_answer(suspect)
        log.info("retrying on the next primary: %s", failure)
        self.metrics.retries.inc()
        return None

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

    def answer(self, response: Response, arrived: float) -> Response:
        """``response``, counted; a refusal (429, 503) timed from ``arrived`` (monotonic: the request reached the
        handler), by who refused it: ``refused_by``."""
        self.metrics.requests.labels(str(response.status_code)).inc()
        if response.status_code in (429, 503):
            self.metrics.refusal_seconds.labels(refused_by(response)).observe(time.monotonic() - arrived)
        return response

    async def send(
        self,
        upstream: Upstream,
        request: Request,
        path: str,
        body: bytes,
        tracked: Tracked,
        refusal: Refusal | None = None,
        owed: bool = False,
    ) -> Response:
        """Open the upstream response and read its first chunk: until then a failure can be retried (and an
        engine's 429 too, when the request is ``owed``)."""
        headers = upstream_headers(request, owed)
        query = f"?{request.url.query}" if request.url.query else ""
        outgoing = self.client.build_request(request.method, upstream.url + path + query, headers=headers, content=body)
        response = await opened(self.client, upstream, outgoing, asks_stream(parsed_json(request.scope)))
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
        reply_headers[UPSTREAM_HEADER] = upstream.url
        relayed = self.relay(upstream, first, chunks, is_sse, tracked, refusal)
        return ProxiedStream(relayed, response.status_code, reply_headers, response)

    async def relay(
        self,
        upstream: Upstream,
        first: bytes,
        chunks: AsyncIterator[bytes],
        is_sse: bool,
        tracked: Tracked,
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
            tracked.answered = not upstream.failure  # an engine fenced for a stall may answer as it is
        except httpx.TransportError as exc:
            why = f"it is not migrated: {refusal}" if refusal else "it cannot be retried"
            message = f"the upstream {upstream.url} failed mid-response ({type(exc).__name__}); {why}"
            log.warning("%s", message)
            self.metrics.upstream_errors.labels(upstream.url, "mid_stream").inc()
            tracked.failures[self.discovery.failed(upstream, message)] = message  # counted; it is not re-sent
            if not is_sse:
                raise  # the server aborts the connection: a truncated body, never a silently short one
            event = {"error": {"message": message, "type": "unavailable", "param": None}}
            yield f"data: {json.dumps(event)}\n\n".encode()

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


def refused_by(response: Response) -> str:
    """Who refused a request answered 429 or 503: ``engine`` (its answer relayed: ``UPSTREAM_HEADER``),
    ``unaccepted`` (the gateway, once a primary did not accept the connection in time), ``unavailable`` (the gateway:
    no primary within the hold rules), else ``gateway`` (its own admission: every engine full, or its bound)."""
    if UPSTREAM_HEADER in response.headers:
        return "engine"
    if isinstance(response, Unaccepted):
        return "unaccepted"
    return "unavailable" if response.status_code == 503 else "gateway"


def asks_stream(body: object) -> bool:
    """Whether a request (its body's JSON value, ``parsed_json``) asks for a stream (``controller.suspects``)."""
    return isinstance(body, dict) and body.get("stream") is True


async def ending_with(chunks: AsyncIterator, end: Callable[[], Awaitable[None]]) -> AsyncIterator:
    """``chunks``, then ``end`` (also when the client goes away)."""
    try:
        async for chunk in chunks:
            yield chunk
    finally:
        await end()


def default_admission(config: ClusterConfig) -> Admission:
    """As many requests proxied at once as ``config`` derives, none waiting here: the engines queue (what
    they generate and queue is what the gateway passes on), so a second queue would only add latency."""
    return Admission(config.gateway_in_flight(), queue=0)
