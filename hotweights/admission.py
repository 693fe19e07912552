"""Admission: how much work a server takes on before it answers the rest at once with 429.

At most ``running`` requests are served at a time; up to ``queue`` more wait for a slot, each for at
most ``wait_s``; anything beyond, or a wait that runs out, is refused at once (429 with
``Retry-After``), so an overloaded server keeps the latency of what it admitted instead of queueing
without bound. The gateway and the engines each hold one. An engine counts a request as the sequences it
generates (``prompts``: a list of prompts takes a slot for each, all at once, and counts as that many waiting and
arriving), so that a request of many prompts is bounded by what it costs, not by its count; slots are handed out
first come first served, so small requests never pass one that waits for several.

With ``queue_wait_share`` above 0, an engine under overload (``Admission.overloaded``: within the last
``OVERLOAD_WINDOW_S`` a fresh request found the queue full, or more fresh requests arrived than its slots complete
and its queue holds, counting those a gateway refused on its behalf, ``REFUSED_HEADER``) also asks whether a request
queued now would start soon (``starts_soon``): the sequences it generates end, at the time its rounds take now, when
their remaining tokens are done, and a request is queued only if the slot it waits for is expected to free within
that share of a typical completion's time. Without it, requests of equal length start and end in waves, and one that
arrives early in a wave waits for all of it (``docs/benchmarks.md``, Overload). Otherwise the share does not apply:
a burst below the capacity waits in the queue instead of being refused.

A request marked owed (``OWED_HEADER``: one a gateway owes to a failover) is fresh load to no one: it waits in a
deeper queue (``OWED_QUEUE_FACTOR`` times ``running + queue``, the queue counted at least as deep as ``running``: a
short queue for fresh requests does not shorten it), first come first served, and the wait share does not
apply to it. Until every owed request has been answered, those that arrive join that queue too: the new primary is
catching up with the failover's burst, and what they would be refused for is the failover, not their load. After
that, arrivals go on joining it while any request in it still waits and no more arrive than the slots complete (what
is left of the burst drains); beyond the capacity they meet the short queue and the wait share at once, the short
queue counting only those queued outside the owed one (what is left of the burst, at most ``OWED_QUEUE_FACTOR``
times ``running + queue`` requests, is served first): a failover's burst ends with its owed requests under
sustained overload. For ``RECOVERY_S`` after an owed request's answer, fresh requests below the capacity may wait as
many as ``running`` (``burst_queue``): what is left of the burst still holds the slots.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

RETRY_AFTER_S = 1  # what a refusal tells the client to wait before it tries again
OWED_QUEUE_FACTOR = 4  # an owed request may wait behind this many times ``running + queue`` (the queue >= running)
QUEUE_WAIT_S = 10.0  # how long a queued request waits for a slot by default
OVERLOAD_WINDOW_S = 1.0  # fresh arrivals over this long, against what the slots complete in it: ``overloaded``
RECOVERY_S = 2.0  # how long after its last owed request a server queues fresh ones as deep as its slots


@dataclass(frozen=True)
class ServingLimits:
    """How one engine serves and how much it takes on: the defaults of ``hotweights engine``'s flags, ``hotweights
    agent``'s and ``[engine]`` of ``cluster.toml``, defined here once (``queue_wait_share`` and ``batch_invariant``
    are the reference engine's only)."""

    kv_cache_tokens: int = 4096  # KV cache positions per sequence slot (prompt and generated tokens)
    max_batch: int = 4  # sequences generated at once
    drain_timeout_s: float = 30.0  # how long a drain waits for what is generating before it cancels it
    max_queue: int = 1  # completions waiting beyond max_batch (0: ``queue_or_default``); more: 429 at once
    queue_timeout_s: float = QUEUE_WAIT_S  # a waiting completion not started by then: 429
    queue_wait_share: float = 0.25  # > 0, overloaded: queued only while a slot frees within this share of a completion
    batch_invariant: bool = False  # a request's text independent of what shares its steps (standby.decoder)

    def queue(self) -> int:
        return queue_or_default(self.max_queue, self.max_batch)


def queue_or_default(queue: int, running: int) -> int:
    """A configured queue depth (0: as many as are served at once, so a queued request waits at most about one
    request's time)."""
    return queue or running


def burst_queue(queue: int, running: int) -> int:
    """How many fresh requests may wait below the capacity, and what the owed queue counts the queue as: ``queue``,
    and at least as many as are served at once."""
    return max(queue, running)


def starts_soon(remaining: list[int], waiting: int, round_s: float, completion_s: float, share: float) -> bool:
    """Whether a request queued behind ``waiting`` others gets a slot within ``share`` of a typical completion's
    time (``completion_s``): the slot the (waiting+1)-th soonest of the sequences generating or admitted
    (``remaining`` tokens each) frees, at ``round_s`` a token. True while nothing is timed yet, and when fewer
    sequences hold slots than would free one for it."""
    if not completion_s or waiting >= len(remaining):
        return True
    return sorted(remaining)[waiting] * round_s <= share * completion_s


def overloaded(arrivals: int, window_s: float, running: int, completion_s: float, queue: int) -> bool:
    """Whether ``arrivals`` fresh requests in ``window_s`` are more than ``running`` slots complete in that time at
    ``completion_s`` each (a typical completion's time; 0 while none is timed: never) and a ``queue`` holds: an
    engine slowed for a while (a neighbour starting, say) queues what it cannot serve at once, as deep as it may."""
    return completion_s > 0 and (arrivals - queue) * completion_s > running * window_s


def opens_in(
    remaining: list[int], ahead: int, queue: int, round_s: float, completion_s: float, share: float
) -> float | None:
    """Seconds until a fresh request refused now, behind ``ahead`` waiting in a ``queue`` deep, would be queued: once
    the queue has room (``ahead - queue + 1`` of the sequences holding slots, ``remaining`` tokens each at ``round_s``
    a token, have ended) and, with ``share``, once the slot it would wait for is expected within that share of a
    completion (``starts_soon``). None while nothing is timed or nothing holds a slot."""
    if not round_s or not remaining:
        return None
    ends = sorted(tokens * round_s for tokens in remaining)
    if ahead >= queue:
        return ends[min(ahead - queue, len(ends) - 1)]
    if share and completion_s and ahead < len(ends):
        return max(ends[ahead] - share * completion_s, 0.0)
    return 0.0


class Verdict(enum.Enum):
    ADMIT = "admitted"  # a slot is free: served at once
    QUEUE = "queued"  # no slot: waits for one (at most wait_s)
    REFUSE = "refused"  # no slot, and the queue is full or (under overload) no slot frees soon: answered at once


def verdict(slot_free: bool, waiting: int, queue: int, starts_soon: bool = True) -> Verdict:
    """What happens to a request that arrives now (``starts_soon``: the module docstring)."""
    if slot_free:
        return Verdict.ADMIT
    return Verdict.QUEUE if waiting < queue and starts_soon else Verdict.REFUSE


@dataclass
class Slots:
    """``capacity`` slots, taken several at a time, first come first served: a taker waits until as many as it asks
    for are free and nobody waits ahead of it."""

    capacity: int
    free: int = field(init=False)
    _waiters: deque[tuple[int, asyncio.Future[None]]] = field(init=False, default_factory=deque)

    def __post_init__(self) -> None:
        self.free = self.capacity

    def available(self, n: int) -> bool:
        """Whether ``n`` slots would be taken at once."""
        return not self._waiters and self.free >= n

    async def take(self, n: int) -> None:
        """Hold ``n`` slots (``give`` returns them); cancelled while it waits, it holds none."""
        if self.available(n):
            self.free -= n
            return
        entry = (n, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            await entry[1]
        except BaseException:
            if entry[1].done() and not entry[1].cancelled():
                self.give(n)  # granted as its wait ended
            elif entry in self._waiters:
                self._waiters.remove(entry)
                self._wake()  # those behind it may fit now
            raise

    def give(self, n: int) -> None:
        """Return ``n`` slots; the waiters at the head that now fit take theirs."""
        self.free += n
        self._wake()

    def _wake(self) -> None:
        while self._waiters and (self._waiters[0][1].done() or self._waiters[0][0] <= self.free):
            n, future = self._waiters.popleft()
            if not future.done():
                self.free -= n
                future.set_result(None)


class Timing(Protocol):
    """What an engine's scheduler knows of its sequences' times (``standby.scheduler.Scheduler``)."""

    @property
    def completion_s(self) -> float: ...  # a typical completion's time, submit to last token (0: none timed yet)

    def starts_soon(self, share: float, waiting: int) -> bool: ...

    def opens_in(self, share: float, ahead: int, queue: int) -> float | None: ...


@dataclass
class Admission:
    """``enter`` before serving, ``leave`` once answered (``owed`` and ``prompts`` as it entered); ``waiting``,
    ``owed_waiting`` and ``serving`` count prompts (sequences), ``owed`` requests. ``on_verdict`` counts each
    arrival's verdict (and ``Verdict.REFUSE`` again for a queued request whose wait ran out); ``on_wait`` gets the
    seconds a queued request waited once it holds a slot. ``share`` and ``timing``: the wait share and the times it is
    judged by (module docstring; without ``timing``, or at a share of 0, a free place in the queue is enough)."""

    running: int
    queue: int
    wait_s: float
    on_verdict: Callable[[Verdict], None] = lambda _: None
    share: float = 0.0
    timing: Timing | None = None
    on_wait: Callable[[float], None] = lambda _: None
    waiting: int = 0  # queued now
    owed_waiting: int = 0  # of which in the owed queue (owed, or joined while an owed request was not answered)
    owed: int = 0  # owed requests queued or holding a slot now: while any, arrivals join the owed queue
    serving: int = 0  # holding a slot now
    _slots: Slots = field(init=False)
    _arrivals: deque[tuple[float, int]] = field(init=False, default_factory=deque)  # (when, how many) in the window
    _arrived: int = field(init=False, default=0)  # their sum
    _full_at: float = field(init=False, default=float("-inf"))  # when a fresh request last found the queue full
    _owed_at: float = field(init=False, default=float("-inf"))  # when an owed request was last answered or gave up

    def __post_init__(self) -> None:
        self._slots = Slots(self.running)

    def overloaded(self) -> bool:
        """Whether the wait share applies now (``pressed``, with a share and ``timing``)."""
        return bool(self.share) and self.timing is not None and self._pressed()

    def _pressed(self) -> bool:
        """A fresh request found the queue full, or more arrived than the slots complete and the queue holds, within
        the last ``OVERLOAD_WINDOW_S``."""
        return time.monotonic() - self._full_at < OVERLOAD_WINDOW_S or self._beyond_capacity()

    def _fresh_queue(self) -> int:
        """How many fresh requests may wait now: ``queue``; within ``RECOVERY_S`` of an owed request's answer, unless
        ``pressed``, at least as many as are served at once (``burst_queue``): what is left of a failover's burst
        still holds the slots, and arrivals the slots complete in time wait for them instead of being refused."""
        if self.timing is None or time.monotonic() - self._owed_at >= RECOVERY_S or self._pressed():
            return self.queue
        return burst_queue(self.queue, self.running)

    def _beyond_capacity(self) -> bool:
        """More fresh requests arrived over the last ``OVERLOAD_WINDOW_S`` than the slots complete and the queue holds
        (``overloaded``); False without ``timing``."""
        if self.timing is None:
            return False
        now = time.monotonic()
        while self._arrivals and self._arrivals[0][0] < now - OVERLOAD_WINDOW_S:
            self._arrived -= self._arrivals.popleft()[1]
        return overloaded(self._arrived, OVERLOAD_WINDOW_S, self.running, self.timing.completion_s, self.queue)

    async def enter(self, owed: bool = False, refused_elsewhere: int = 0, prompts: int = 1) -> str | None:
        """None once a slot for each of the request's ``prompts`` is held (``leave`` gives them back); else why the
        request is refused. ``owed``: a request owed to a failover (module docstring); ``refused_elsewhere``: fresh
        requests a gateway refused on this server's behalf since its last one (``REFUSED_HEADER``), counted as
        arrivals with this one. ``prompts`` must not exceed ``running`` (it would wait for ever)."""
        if not owed:
            self._arrivals.append((time.monotonic(), prompts + refused_elsewhere))
            self._arrived += prompts + refused_elsewhere
        lane, queue, ahead = self._line(owed)
        slot_free = self._slots.available(prompts)
        judged = not (slot_free or lane or ahead >= queue) and self.overloaded()  # by the wait share
        last = ahead + prompts - 1  # its last prompt's place in line
        soon = not judged or (self.timing is not None and self.timing.starts_soon(self.share, last))
        decided = verdict(slot_free, ahead, queue, soon)
        self.on_verdict(decided)
        if decided is Verdict.REFUSE and not lane and soon:
            self._full_at = time.monotonic()
        if decided is Verdict.REFUSE:
            if not soon:
                return (
                    f"overloaded: {self.running} requests are being served, none is expected to end soon, and more "
                    "arrive than they complete"
                )
            return f"overloaded: {self.running} requests are being served and {ahead} are waiting"
        self.owed += owed
        if decided is Verdict.ADMIT:
            await self._slots.take(prompts)  # free: returns at once
            self.serving += prompts
            return None
        self.waiting += prompts
        self.owed_waiting += lane * prompts
        queued_at = time.monotonic()
        held = False
        try:
            async with asyncio.timeout(self.wait_s):
                await self._slots.take(prompts)
            held = True
        except TimeoutError:
            self.on_verdict(Verdict.REFUSE)
            return f"overloaded: no slot came free within {self.wait_s} s"
        finally:  # also when the request is cancelled while it waits (its client gone)
            self.waiting -= prompts
            self.owed_waiting -= lane * prompts
            if owed and not held:
                self._owed_ended()
        self.serving += prompts
        self.on_wait(time.monotonic() - queued_at)
        return None

    def _line(self, owed: bool) -> tuple[bool, int, int]:
        """(whether in the owed queue, that queue's depth, how many wait ahead) for a request arriving now."""
        catching_up = self.owed > 0 or (self.owed_waiting > 0 and not self._beyond_capacity())
        if owed or catching_up:  # the owed queue: owed, or catching up with a failover's burst
            return True, OWED_QUEUE_FACTOR * (self.running + burst_queue(self.queue, self.running)), self.waiting
        # what is left of a burst in the owed queue is not this request's queue
        return False, self._fresh_queue(), self.waiting - self.owed_waiting

    def reopens_in(self) -> float | None:
        """Seconds until a fresh request refused now would be queued (``opens_in``), None when unknown."""
        if self.timing is None:
            return None
        _, queue, ahead = self._line(False)
        return self.timing.opens_in(self.share if self.overloaded() else 0.0, ahead, queue)

    def leave(self, owed: bool = False, prompts: int = 1) -> None:
        """Give the slots back; ``owed`` and ``prompts``: as the request entered."""
        self.serving -= prompts
        if owed:
            self._owed_ended()
        self._slots.give(prompts)

    def _owed_ended(self) -> None:
        """An owed request was answered, or gave up its wait: the recovery (``RECOVERY_S``) counts from now."""
        self.owed -= 1
        self._owed_at = time.monotonic()
