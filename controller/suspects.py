"""The gateway's suspect rules: which requests it no longer sends to an engine, as pure decisions.

A *failure* is an engine the gateway saw fail with a request in flight: its connection cut or reset, or a *stall*,
the engine no longer answering the gateway's probes (the gateway moves a migrating completion on at once; the
controller fences the engine, and only its SIGKILL, later, would cut the connection). A stall counts once the
engine is gone (nothing listens, or another process answers in its place) or stays unanswered until the request's
hold deadline; the same process answering again clears it: it was slow, not stalled (``stall_outcome``). A
planned role change (a 503 from a standby or a draining primary) is none. A failure's id names the engine's
process (``http://host:port pid N``; an engine that names no pid, its URL), so every gateway worker counts it
once. A request that ends *unanswered* after failures (refused, cut, abandoned by its client)
counts them for its body (the SHA-256 of its bytes), and, when it was itself in flight at S of them (what a request
of death does: it kills the engine it is re-sent to as well), for its client (its bearer credentials when it sends
some, else its address), unless an engine answered that body, with no failure on the way, within T: a request of
death gets no answer, while a popular body caught in faults that were not its doing (a host that flaps, a drill)
does. The requests left unanswered by an outage (one failure each, no primary within their hold) count for no
client: a proxy's address, which many clients share, is not refused for a bad minute of the group's own.

With ``[gateway]``'s ``suspect_after`` (S), ``suspect_ttl_s`` (T), ``client_failures`` (C; 0: no client bound) and
``client_window_s`` (W):

1. A request in flight at S failures is not sent to another engine: 422 ``suspect_request``.
2. A body that S failures count for within T (one request's, or several's) is suspect: a request with it is
   refused at once (422), without reaching an engine, until they are older than T; nor is one re-sent whose own
   failures bring its body there.
3. A client that C failures count for within W has its requests refused at once (429, ``Retry-After`` until the
   oldest leaves the window), and none re-sent whose own failures bring it there: one client costs at most C
   engines per W, whatever bodies it sends, so a group of C + 1 engines keeps a primary. A body an engine
   answered is sent for it all the same.

A request that completes elsewhere after failures (re-sent, or migrated mid-stream) counts them for nothing: the
same completions at two failovers minutes apart are ordinary. What that leaves is a request that kills an engine
only after its answer began and whose continuation then completes: it costs one engine each time it is sent.

A failure counts against a request only where that engine had started it (``is_started``): a request that only
waited there for a slot, with no byte of its answer sent, cannot have made it fail. An engine sends a stream's
response headers once the request holds its slots, before its model sees it (docs/engine-contract.md), so a
stream cut before its headers was waiting; a whole reply's headers come only with its end, so a failure while it
is in flight counts whenever it came. Without this, under overload (a queue that holds its budget's worth) a
request that waited at two primaries as they failed would be refused, and its body with it.

A first failure alone never refuses a request, whatever else is known about it. The only request in flight at a
crash is the common case at low load (one client, one request at a time), and at any load some request arrived
just before any failure, so neither tells a request that kills engines from one that was there when an engine
died; refusing them would make ordinary failovers visible to clients. What a request of death costs is bounded
instead: S engines per body, C per client and window.

Workers share what they learn as ``Record``s (``gateway.suspectjournal``); applying one twice changes nothing.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from enum import StrEnum

MEMORY = 1024  # bodies with failures, and clients with unanswered ones, remembered (the oldest forgotten first)
ANSWERED_MEMORY = 4096  # bodies an engine answered, remembered (the least recently answered forgotten first)


@dataclass(frozen=True)
class SuspectLimits:
    """The rules' bounds (``[gateway]``'s keys of the same names)."""

    suspect_after: int
    suspect_ttl_s: float
    client_failures: int
    client_window_s: float


class Rule(StrEnum):
    """Which rule refused a request (the label of ``hotweights_gateway_suspect_requests_total``)."""

    FAILURES = "failures"  # in flight at suspect_after failures: not re-sent
    BODY = "body"  # a suspect body
    CLIENT = "client"  # a client at its bound


class Outcome(StrEnum):
    """What a stall turned out to be, so far."""

    FAILED = "failed"
    CLEARED = "cleared"  # the same process answered again: it was slow
    UNRESOLVED = "unresolved"


def is_started(answer_began: bool, streamed: bool) -> bool:
    """Whether the engine that failed with a request in flight had started it, so that its failure counts against
    the request: ``answer_began``, its response headers came; ``streamed``, the request asked for a stream, whose
    headers an engine sends as it starts it (before that it was only waiting for its slots). A whole reply's
    headers come with its end, so without them it may have started all the same."""
    return answer_began or not streamed


def stall_outcome(pid: int | None, since: float, answered_at: float, pid_now: int | None, gone_at: float) -> Outcome:
    """A stall of the engine process ``pid`` seen at ``since``, given when its URL last answered a probe (by
    ``pid_now``) and last had nothing listening (monotonic times; 0: never)."""
    if gone_at > since:
        return Outcome.FAILED
    if answered_at > since:
        return Outcome.CLEARED if pid_now == pid else Outcome.FAILED
    return Outcome.UNRESOLVED


class Kind(StrEnum):
    ANSWERED = "answered"  # an engine answered a request with body ``digest``, with no failure on the way
    UNANSWERED = "unanswered"  # a request with body ``digest`` from ``client`` ended unanswered after ``failures``


@dataclass(frozen=True)
class Record:
    """One thing a gateway worker learned, at ``at`` (wall-clock seconds: the workers share them)."""

    kind: Kind
    at: float
    digest: str = ""
    client: str = ""
    failures: tuple[str, ...] = ()


def refusal(own: int, body: int, client: int, limits: SuspectLimits) -> Rule | None:
    """The rule that refuses a request, or None to send it. ``own``: failures it was in flight at (0 on arrival);
    ``body``: its body's within T (0 once an engine answered it); ``client``: its client's within W (with its own,
    for a re-send; 0 when an engine answered its body)."""
    if own >= limits.suspect_after:
        return Rule.FAILURES
    if body >= limits.suspect_after:
        return Rule.BODY
    if limits.client_failures and client >= limits.client_failures:
        return Rule.CLIENT
    return None


def client_wait(times: Collection[float], now: float, limits: SuspectLimits) -> float:
    """Seconds until a client with unanswered failures at ``times`` (within W) is below its bound again; 0 if it is."""
    over = len(times) - limits.client_failures + 1
    if not limits.client_failures or over <= 0:
        return 0.0
    return max(sorted(times)[over - 1] + limits.client_window_s - now, 0.0)


def remember(table: dict[str, dict[str, float]], key: str, failures: Collection[str], at: float, span_s: float) -> None:
    """Add ``failures`` at ``at`` under ``key`` (the newest key last), forgetting its failures older than ``span_s``;
    beyond MEMORY keys the oldest is forgotten."""
    entry = recent(table.pop(key, {}), at, span_s)
    entry.update({failure: entry.get(failure, at) for failure in failures})
    table[key] = entry
    if len(table) > MEMORY:
        del table[next(iter(table))]


def recent(entry: dict[str, float], now: float, span_s: float) -> dict[str, float]:
    return {failure: at for failure, at in entry.items() if at > now - span_s}


@dataclass
class SuspectTable:
    """What one gateway worker knows: bodies and clients with failures, bodies answered."""

    limits: SuspectLimits
    bodies: dict[str, dict[str, float]] = field(default_factory=dict)  # digest -> failure id -> when
    clients: dict[str, dict[str, float]] = field(default_factory=dict)  # client -> failure id -> when (module doc)
    answered: dict[str, float] = field(default_factory=dict)  # digest -> when an engine last answered it

    def apply(self, record: Record) -> None:
        if record.kind is Kind.ANSWERED:
            self.bodies.pop(record.digest, None)
            self.answered.pop(record.digest, None)
            self.answered[record.digest] = record.at
            if len(self.answered) > ANSWERED_MEMORY:
                del self.answered[next(iter(self.answered))]
        elif not self.is_answered(record.digest, record.at):
            remember(self.bodies, record.digest, record.failures, record.at, self.limits.suspect_ttl_s)
            if len(record.failures) >= self.limits.suspect_after:  # a request of death's mark, not an outage's
                remember(self.clients, record.client, record.failures, record.at, self.limits.client_window_s)

    def is_answered(self, digest: str, now: float) -> bool:
        return self.answered.get(digest, -float("inf")) > now - self.limits.suspect_ttl_s

    def has_failures(self, digest: str) -> bool:
        return digest in self.bodies

    def body_failures(self, digest: str, now: float) -> dict[str, float]:
        return recent(self.bodies.get(digest, {}), now, self.limits.suspect_ttl_s)

    def client_failures(self, client: str, now: float) -> dict[str, float]:
        return recent(self.clients.get(client, {}), now, self.limits.client_window_s)

    def on_arrival(self, digest: str, client: str, now: float) -> Rule | None:
        """The rule that refuses a new request at once, or None."""
        return self.on_failure((), digest, client, now)

    def on_failure(self, own: Collection[str], digest: str, client: str, now: float) -> Rule | None:
        """The rule that refuses to send again a request in flight at the failures ``own``, or None. A body an
        engine answered within T is refused by rule 1 only: it counts for neither rule 2 nor its client."""
        if self.is_answered(digest, now):
            return refusal(len(own), 0, 0, self.limits)
        body = self.body_failures(digest, now).keys() | set(own)
        client_count = self.client_failures(client, now).keys() | set(own)
        return refusal(len(own), len(body), len(client_count), self.limits)

    def client_wait(self, client: str, now: float) -> float:
        """Seconds until ``client``'s requests are taken again (0: they are)."""
        return client_wait(list(self.client_failures(client, now).values()), now, self.limits)
