"""Which engine is primary now, as each gateway worker learns it: ``GET /primary`` on every upstream, each on
its own so one hung engine never slows the others; engines added at runtime come from the controller's state
file (or, with several hosts, from the leader keys in etcd). A primary's probe that goes unanswered while its process
runs on the CPU, soon after its last answer, is a busy engine's and changes nothing (``busy``): the controller's
health checks judge it alike, and a late probe must not move a saturated primary's requests elsewhere. A proxied
request's connection it did not accept in time is the same (``saturated``): the request is refused 429 at once, or,
owed by a failover, tried again after a pause, instead of held while the gateway would know no primary."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from hotweights.admission import RETRY_AFTER_S
from hotweights.contract import ADMITS_IN_HEADER, Endpoint, Role, State
from hotweights.controller.dcs import LeaderUrls
from hotweights.errors import ConfigError
from hotweights.proctree import busy_not_hung, cpu_seconds, cpu_used
from hotweights.state import read_state

log = logging.getLogger(__name__)

STATE_POLL_S = 1.0  # how often the controller's state file is re-read for engines added at runtime
# The least time an engine that answered a fresh request 429 gets no other (its ADMITS_IN_HEADER may say more): it
# refuses only once its queue holds its budget's worth of work, which a pause this short cannot empty, and each
# refusal it answers itself costs the event loop that feeds its inference thread.
FULL_MIN_S = 0.05
FULL_MAX_S = float(RETRY_AFTER_S)  # the longest it gets none, whatever its header says
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # an upstream at one of these runs on this host (``busy``)
CPU_WINDOW_S = 0.5  # the least time ``saturated`` measures an upstream's CPU over ...
CPU_SAMPLES = 16  # ... from the starts of its last probes, this many kept


@dataclass
class Upstream:
    """One engine, as the prober last saw it."""

    url: str
    status: int | None = None  # last /primary status; None: never answered or unreachable
    reason: str = "not probed yet"  # why it is not primary ("" when it is)
    checked: float = 0.0  # wall-clock time of the last probe
    is_primary: bool = False
    weights: str | None = None  # what it computes with, as its last probe named them (None: unnamed or unreachable)
    draining: bool = False  # its last probe: a primary that finishes its requests and takes no new ones
    wake: asyncio.Event = field(default_factory=asyncio.Event)  # set to probe now instead of next interval
    lost: asyncio.Event = field(default_factory=asyncio.Event)  # set while its streams are to be cut (``cuts``)
    full_until: float = 0.0  # monotonic time until which it gets no fresh request (``refused``)
    pid: int | None = None  # its process, as its last answered probe named it
    failure: str = ""  # while it has failed (``Discovery.failed``) and answered no probe since: the failure's id
    failed_at: float = 0.0  # monotonic time it last failed: a probe sent before does not say it serves
    answered_at: float = 0.0  # monotonic time a probe was last answered (by ``pid``)
    responded_at: float = 0.0  # monotonic time a proxied request was last answered (its headers came)
    # The recent probes' starts: (monotonic time, ``pid``'s CPU seconds), what ``saturated`` measures its CPU over.
    probes_began: deque[tuple[float, float | None]] = field(default_factory=lambda: deque(maxlen=CPU_SAMPLES))
    gone_at: float = 0.0  # monotonic time a probe last found nothing listening (the process is gone)
    probed: asyncio.Event = field(default_factory=asyncio.Event)  # set (and replaced) as each probe ends

    def describe(self) -> dict[str, object]:
        return {
            "url": self.url,
            "primary_status": self.status,
            "is_primary": self.is_primary,
            "reason": self.reason or None,
            "checked_ago_ms": round((time.time() - self.checked) * 1000) if self.checked else None,
            "full_for_ms": round(max(self.full_until - time.monotonic(), 0.0) * 1000),  # fresh requests refused here
        }


def refused(upstream: Upstream, response: httpx.Response) -> None:
    """``upstream`` answered a fresh request 429: it is full for as long as its ``ADMITS_IN_HEADER`` says
    (at least ``FULL_MIN_S``, at most ``FULL_MAX_S``). Fresh requests go to another primary meanwhile, or
    are refused by the gateway, so an overloaded engine spends no time on refusals it would answer alike."""
    try:
        full_s = int(response.headers[ADMITS_IN_HEADER]) / 1000
    except (KeyError, ValueError):
        full_s = 0.0
    upstream.full_until = time.monotonic() + min(max(full_s, FULL_MIN_S), FULL_MAX_S)


def engine_urls_in_state(state_file: Path, host: str = "127.0.0.1") -> list[str]:
    """Engine URLs in the controller's ``state.json`` (its engines listen on ``host``); none while it is
    missing or being replaced."""
    try:
        members = read_state(state_file).members
    except ConfigError:  # corrupt or of another version: the controller will say so
        return []
    return [f"http://{host}:{member.port}" for member in members.values()]


class Discovery:
    """Which upstreams answer 200 on ``/primary``; ``available`` is set while at least one does."""

    def __init__(
        self,
        urls: list[str],
        client: httpx.AsyncClient,
        interval_s: float,
        timeout_s: float,
        engine_host: str = "127.0.0.1",
        leaders: LeaderUrls | None = None,
    ) -> None:
        self.engine_host = engine_host  # where the engines state.json lists listen ([dcs] address)
        self.leaders = leaders  # multi-host: the leader keys' engines, followed by etcd watch
        self.upstreams = [Upstream(url.rstrip("/")) for url in urls]
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.available = asyncio.Event()
        self._turn = itertools.count()

    def primaries(self) -> list[Upstream]:
        return [u for u in self.upstreams if u.is_primary]

    def pick(self) -> Upstream | None:
        """Round-robin among the current primaries (several groups: one primary each), those not full first."""
        primaries = self.primaries()
        now = time.monotonic()
        choice = [u for u in primaries if u.full_until <= now] or primaries
        return choice[next(self._turn) % len(choice)] if choice else None

    def full_for(self) -> float:
        """Seconds until the soonest primary takes fresh requests again while every one is full; 0 while one takes
        them, or none is known (the hold rules apply then)."""
        now = time.monotonic()
        return max(min((u.full_until for u in self.primaries()), default=now) - now, 0.0)

    async def wait_available(self, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.available.wait(), max(timeout_s, 0.0))
        return self.available.is_set()

    def suspect(self, upstream: Upstream, reason: str) -> None:
        """A proxied request failed there: stop routing to it until a probe says 200 again, and probe
        every upstream now (one of them may just have been promoted)."""
        upstream.draining = False
        self._mark(upstream, False, reason)
        self.wake_all()

    def failed(self, upstream: Upstream, reason: str) -> str:
        """``upstream`` failed with a request in flight (its connection cut): what ``suspect`` does; the failure's id
        (``mark_failed``), the same for every request in flight there until it answers a probe again."""
        mark_failed(upstream)
        self.suspect(upstream, reason)
        return upstream.failure

    def saturated(self, upstream: Upstream) -> bool:
        """Whether ``upstream``, a connection to which was not accepted in time, is a primary saturated by its load
        rather than a lost one: ``busy`` over at least the last CPU_WINDOW_S (from the start of a probe that long ago:
        /proc counts CPU time in ticks of 10 ms, too coarse for a shorter window). It is full for as long as a
        connection waits before it times out (fresh requests are refused at once meanwhile, ``full_for``, rather than
        each after that wait), and nothing else changes: what it serves stays there."""
        now = time.monotonic()
        began = list(upstream.probes_began)
        samples = [sample for sample in began if now - sample[0] >= CPU_WINDOW_S] or began[:1]  # else the oldest
        if not samples or not busy(upstream, *samples[-1]):
            return False
        upstream.full_until = max(upstream.full_until, now + self.timeout_s)
        return True

    def wake_all(self) -> None:
        """Probe every upstream now instead of at its next interval (a role just changed somewhere)."""
        for upstream in self.upstreams:
            upstream.wake.set()

    async def probe_all(self) -> None:
        """One probe of every upstream, all at once: what a gateway knows before it accepts a request."""
        await asyncio.gather(*(self._probe(upstream) for upstream in self.upstreams))

    async def run(self, state_file: Path | None = None) -> None:
        """Probe every upstream; with a controller state file, also pick up engines added at runtime."""
        async with asyncio.TaskGroup() as tasks:
            for upstream in self.upstreams:
                tasks.create_task(self._watch(upstream))
            if state_file is not None:
                tasks.create_task(self._follow(state_file, tasks))
            if self.leaders is not None:
                tasks.create_task(self._follow_leaders(self.leaders, tasks))

    def _add(self, url: str, tasks: asyncio.TaskGroup, why: str) -> None:
        upstream = Upstream(url)
        self.upstreams.append(upstream)
        tasks.create_task(self._watch(upstream))
        log.info("%s joined (%s)", url, why)

    async def _follow_leaders(self, leaders: LeaderUrls, tasks: asyncio.TaskGroup) -> None:
        """At every change of the leader keys: probe the engines they name now (another host's too)."""
        async for urls in leaders.follow():
            known = {u.url for u in self.upstreams}
            for url in dict.fromkeys(urls):
                if url not in known:
                    self._add(url, tasks, "named by a leader key in etcd")
            self.wake_all()

    async def _follow(self, state_file: Path, tasks: asyncio.TaskGroup) -> None:
        """Read the controller's state file (not its API: the data path must not need the controller
        to be up) and start probing any engine port it lists that we do not know yet."""
        while True:
            known = {u.url for u in self.upstreams}
            for url in engine_urls_in_state(state_file, self.engine_host):
                if url not in known:
                    self._add(url, tasks, f"listed in {state_file}")
            await asyncio.sleep(STATE_POLL_S)

    async def _watch(self, upstream: Upstream) -> None:
        while True:
            await self._probe(upstream)
            done, upstream.probed = upstream.probed, asyncio.Event()
            done.set()
            # While no primary is known a failover is in progress: learning of the new one is what matters.
            interval = self.interval_s if self.available.is_set() else self.interval_s / 4
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(upstream.wake.wait(), interval)
            upstream.wake.clear()

    async def _probe(self, upstream: Upstream) -> None:
        sent, cpu_before = time.monotonic(), cpu_seconds(upstream.pid)
        upstream.probes_began.append((sent, cpu_before))
        try:
            response = await self.client.get(upstream.url + Endpoint.PRIMARY, timeout=self.timeout_s)
            if upstream.failed_at > sent:  # it failed while this answer was on its way: the next probe decides
                return
            upstream.status = response.status_code
            reason = "" if response.status_code == 200 else reason_of(response, Endpoint.PRIMARY)
            body = health_body(response)
            upstream.weights = body.get("weights")
            draining = body.get("role") == Role.PRIMARY and body.get("state") in (State.DRAINING, State.DRAINED)
            upstream.draining = response.status_code == 503 and draining
            upstream.failure, upstream.pid, upstream.answered_at = "", pid_of(body), time.monotonic()
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.TimeoutException) and busy(upstream, sent, cpu_before):
                upstream.checked = time.time()
                return  # a primary saturated by its load answers late: its requests stay where they are
            upstream.status, reason = None, f"unreachable: {type(exc).__name__} {exc}".strip()
            upstream.weights, upstream.draining = None, False  # a dead engine goes on with nobody's requests
            if isinstance(exc, httpx.ConnectError):
                upstream.gone_at = time.monotonic()
            mark_failed(upstream)  # dead, hung or stalled: the requests in flight there were at a failure
        upstream.checked = time.time()
        self._mark(upstream, upstream.status == 200, reason)

    def _mark(self, upstream: Upstream, is_primary: bool, reason: str) -> None:
        if is_primary != upstream.is_primary:
            log.info("%s %s", upstream.url, "is primary" if is_primary else f"is no longer primary: {reason}")
        upstream.is_primary, upstream.reason = is_primary, reason
        if cuts(upstream, self.upstreams):
            upstream.lost.set()
        else:
            upstream.lost.clear()
        if self.primaries():
            self.available.set()
        else:
            self.available.clear()


def busy(upstream: Upstream, since: float, cpu_then: float | None) -> bool:
    """Whether ``upstream`` went unanswered since ``since`` (its process's CPU seconds then: ``cpu_then``) because the
    primary is busy, not hung: its process ran on the CPU meanwhile, soon after its last answer, a probe's or a proxied
    request's (``hotweights.proctree.busy_not_hung``, as the controller's health checks judge it: a saturated primary
    answers its clients while its probes wait). A stopped or deadlocked one, or one not on this host (a pid of another
    host's says nothing here), is not."""
    now = time.monotonic()
    last = max(upstream.answered_at, upstream.responded_at)
    answered = now - last if last else None
    local = upstream.is_primary and urlsplit(upstream.url).hostname in LOOPBACK  # its pid is this host's
    return local and busy_not_hung(cpu_used(upstream.pid, cpu_then), now - since, answered)


def cuts(upstream: Upstream, upstreams: list[Upstream]) -> bool:
    """Whether a migratable completion in flight on ``upstream`` is cut now, to go on elsewhere: once it is not
    primary, unless it is draining and no other of ``upstreams`` names its weights (a model update's switchover: its
    requests finish where they began, within the drain's deadline, since no other engine could go on with them)."""
    if upstream.is_primary:
        return False
    if not upstream.draining or upstream.weights is None:
        return True
    return any(u is not upstream and u.weights == upstream.weights for u in upstreams)


def mark_failed(upstream: Upstream) -> None:
    """``upstream`` failed: the failure's id, ``URL pid N`` (every gateway worker names it alike; ``URL`` while its
    pid is unknown), unless its current failure has one."""
    upstream.failed_at = time.monotonic()
    upstream.failure = upstream.failure or (f"{upstream.url} pid {upstream.pid}" if upstream.pid else upstream.url)


def pid_of(body: dict) -> int | None:
    pid = body.get("pid")
    return pid if isinstance(pid, int) and not isinstance(pid, bool) else None


def health_body(response: httpx.Response) -> dict:
    """A health endpoint's JSON object ({} when the body is not one)."""
    try:
        body = json.loads(response.content)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def reason_of(response: httpx.Response, what: str) -> str:
    """The engine's one-sentence reason from an error body (503 or 429; health or OpenAI error shape)."""
    body = health_body(response)
    try:
        reason = body.get("reason") or body["error"]["message"]
    except (KeyError, TypeError):
        reason = response.text[:200]
    return f"{what} answered {response.status_code}: {reason}"
