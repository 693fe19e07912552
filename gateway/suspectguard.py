"""The gateway's guard against requests that kill engines: the suspect rules (``controller.suspects``) applied to
each request as it arrives, as engines fail with it in flight and as it ends; what one worker learns shared with
the others (``gateway.suspectjournal``); for each refusal one log line (the body's size and digest, never its
content) and ``hotweights_gateway_suspect_requests_total{rule}``."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse

from hotweights.controller.suspects import Kind, Outcome, Record, Rule, SuspectLimits, SuspectTable, stall_outcome
from hotweights.gateway.answers import SUSPECT_CLIENT, refusal, suspect_answer
from hotweights.gateway.discovery import Upstream
from hotweights.gateway.metrics import GatewayMetrics
from hotweights.gateway.suspectjournal import SuspectJournal

log = logging.getLogger(__name__)

INLINE_DIGEST_BYTES = 64 << 10  # bodies larger than this are hashed off the event loop


@dataclass(frozen=True)
class Stall:
    """An engine that stopped answering its probes with the request in flight, not resolved yet."""

    upstream: Upstream
    pid: int | None  # its process then
    since: float  # monotonic time the request was cut from it
    how: str


@dataclass
class Tracked:
    """One request as the suspect rules see it."""

    digest: str  # SHA-256 of its body, hex
    size: int  # its body's bytes
    client: str  # ``client_key``
    failures: dict[str, str] = field(default_factory=dict)  # failure id -> how the engine failed, in order
    stalls: dict[str, Stall] = field(default_factory=dict)  # failure id -> a stall that does not count yet
    answered: bool = False  # an engine answered it whole, and had not stopped answering its probes meanwhile

    def resolve(self, expired: bool) -> None:
        """Count the stalls that turned out failures (all those unresolved once ``expired``); forget the cleared."""
        for failure, stall in list(self.stalls.items()):
            up = stall.upstream
            outcome = stall_outcome(stall.pid, stall.since, up.answered_at, up.pid, up.gone_at)
            if outcome is Outcome.FAILED or (outcome is Outcome.UNRESOLVED and expired):
                self.failures[failure] = stall.how
            if outcome is not Outcome.UNRESOLVED or expired:
                del self.stalls[failure]


def client_key(request: Request) -> str:
    """Who sent ``request``: its bearer credentials (their digest: no secret is ever logged or written), else its
    peer address."""
    if credentials := request.headers.get("authorization"):
        return "credentials " + hashlib.sha256(credentials.encode()).hexdigest()[:16]
    return "address " + (request.client.host if request.client else "unknown")


async def next_probe(stalls: list[Stall], deadline: float) -> None:
    """Until the next probe of one of the engines of ``stalls`` ends, or ``deadline`` (monotonic)."""
    waits = [asyncio.ensure_future(stall.upstream.probed.wait()) for stall in stalls]
    try:
        await asyncio.wait(waits, timeout=max(deadline - time.monotonic(), 0.0), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()


async def body_digest(body: bytes) -> str:
    if len(body) <= INLINE_DIGEST_BYTES:
        return hashlib.sha256(body).hexdigest()
    return await asyncio.to_thread(lambda: hashlib.sha256(body).hexdigest())


class SuspectGuard:
    """One gateway worker's suspect rules, with what it and the other workers learned."""

    def __init__(self, limits: SuspectLimits, journal: SuspectJournal, metrics: GatewayMetrics) -> None:
        self.limits = limits
        self.table = SuspectTable(limits)
        self.journal = journal
        self.metrics = metrics

    async def track(self, request: Request) -> Tracked:
        body = await request.body()
        return Tracked(await body_digest(body), len(body), client_key(request))

    def on_arrival(self, tracked: Tracked) -> JSONResponse | None:
        """None to send the request; else the refusal: 422 for a suspect body, 429 for a client at its bound."""
        now = self.sync()
        rule = self.table.on_arrival(tracked.digest, tracked.client, now)
        if rule is Rule.BODY:
            failures = self.table.body_failures(tracked.digest, now)
            return suspect_answer(self.refused(tracked, rule, body_message(len(failures), self.limits)))
        if rule is Rule.CLIENT:
            wait = self.table.client_wait(tracked.client, now)
            count = len(self.table.client_failures(tracked.client, now))
            message = f"{client_message(count, self.limits)}: its requests are refused for {wait:.0f} s more"
            return refusal(429, self.refused(tracked, rule, message), SUSPECT_CLIENT, math.ceil(wait))
        return None

    async def on_failure(
        self, tracked: Tracked, failure: str, how: str, deadline: float, stalled: Upstream | None = None
    ) -> str | None:
        """The engine of failure ``failure`` failed (``how``) with the request in flight (``stalled``: it stopped
        answering its probes): None to send the request again, else why not (the message of its 422). While a stall
        not resolved yet would decide, waits for it to resolve, until ``deadline`` (monotonic; then it counts)."""
        if stalled is None:
            tracked.failures[failure] = how
            tracked.stalls.pop(failure, None)
        else:
            tracked.stalls[failure] = Stall(stalled, stalled.pid, time.monotonic(), how)
        while True:
            tracked.resolve(expired=time.monotonic() >= deadline)
            now = self.sync()
            if rule := self.table.on_failure(tracked.failures, tracked.digest, tracked.client, now):
                return self.not_resent(tracked, rule, now, how)
            at_worst = tracked.failures.keys() | tracked.stalls.keys()
            if self.table.on_failure(at_worst, tracked.digest, tracked.client, now) is None:
                return None
            await next_probe(list(tracked.stalls.values()), deadline)

    def not_resent(self, tracked: Tracked, rule: Rule, now: float, last: str) -> str:
        """Log and count that ``rule`` refuses to send the request again (its engine failed: ``last``); why."""
        if rule is Rule.FAILURES:
            message = failures_message(len(tracked.failures))
        elif rule is Rule.BODY:
            message = body_message(len(self.table.body_failures(tracked.digest, now)), self.limits)
        else:
            count = len(self.table.client_failures(tracked.client, now).keys() | tracked.failures.keys())
            message = client_message(count, self.limits)
        return self.refused(tracked, rule, f"not re-sent: {message}; last failure: {last}")

    def finish(self, tracked: Tracked) -> None:
        """The request ended. Answered with no failure on the way: its body is one an engine answers (shared when
        failures counted for it). Unanswered after failures: they count for its body and its client, unless an
        engine answered that body. Answered after failures: nothing (``controller.suspects``)."""
        now = time.time()
        if tracked.answered and not tracked.failures:
            record = Record(Kind.ANSWERED, now, digest=tracked.digest)
            if self.table.has_failures(tracked.digest):
                self.share(record)
            else:
                self.table.apply(record)
        elif not tracked.answered and tracked.failures and not self.table.is_answered(tracked.digest, now):
            failures = tuple(tracked.failures)
            self.share(Record(Kind.UNANSWERED, now, digest=tracked.digest, client=tracked.client, failures=failures))

    def sync(self) -> float:
        """Apply what the other workers shared; the time now (wall clock, as records have it)."""
        for record in self.journal.read_new():
            self.table.apply(record)
        return time.time()

    def share(self, record: Record) -> None:
        self.table.apply(record)
        self.journal.append(record)

    def refused(self, tracked: Tracked, rule: Rule, message: str) -> str:
        """Log and count a refusal; its message."""
        log.warning(
            "suspect request refused (rule %s; %d bytes, sha256 %s; %s): %s",
            rule.value,
            tracked.size,
            tracked.digest,
            tracked.client,
            message,
        )
        self.metrics.suspects.labels(rule.value).inc()
        return message


def failures_message(count: int) -> str:
    return (
        f"{count} engines failed while serving this request (gateway.suspect_after), so it may be what made them fail"
    )


def body_message(count: int, limits: SuspectLimits) -> str:
    return (
        f"engines failed {count} times while serving a request with this same body, which no engine answered, within "
        f"{limits.suspect_ttl_s:g} s (gateway.suspect_after, gateway.suspect_ttl_s): it may be what made them fail"
    )


def client_message(count: int, limits: SuspectLimits) -> str:
    return (
        f"this client's requests were in flight at {count} engine failures within {limits.client_window_s:g} s and "
        "got no answer (gateway.client_failures, gateway.client_window_s)"
    )
