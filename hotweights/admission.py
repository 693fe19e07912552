"""Admission: how much work a server takes on before it answers the rest at once with 429.

At most ``running`` sequences are generated at a time. A request that finds no free slot waits for one, first come
first served, while its expected start is within ``budget_s`` (an engine's ``queue_budget_s``): the time until as many
slots as it needs have freed: each sequence the engine generates ends once its remaining tokens are done, at the time
its rounds take now (``Timing``: what its scheduler has measured), and every slot then serves the sequences waiting
ahead, one after another, each for as long as a request typically holds its slots (``Admission.hold_s``, measured
here: its generation and what it costs around it): ``expected_start``. Beyond the budget it is refused at once, 429
with the time after which one arriving would wait instead (``Refusal.admits_in_s``), so that a burst waits and is
served while sustained overload is refused in milliseconds, what is admitted starting within the budget. Until a
round and a request's hold have been timed every request waits; however long the budget, at most ``queue`` sequences
wait (a bound for memory: ``MAX_WAITING`` on an engine; a gateway, which bounds what it proxies, lets none wait).

An engine with a paged KV cache (``standby.kvpool``) also reserves, once a request's prompts are tokenized, the KV
blocks its sequences take (``Admission.reserve``): a request whose blocks are not free waits for them, first come
first served, however long (what holds them finishes, nothing is preempted); it is never refused for them. One
whose sequences need more blocks than the whole pool can never run and is refused before (``kvpool.shortfall``).

An engine counts a request as the sequences it generates (``prompts``: a list of prompts takes a slot for each, all at
once, and waits as that many), so that a request of many prompts is bounded by what it costs, not by its count; slots
are handed out first come first served, so small requests never pass one that waits for several.

A request marked owed (``OWED_HEADER``: one a gateway re-sends after a failover, held while no primary was known, cut
before its first byte, or a migrated stream's continuation) is never refused for want of queue: it waits in line
whatever its expected start and ``queue`` (the gateway bounds how many it holds). The sequences it brings count as
waiting ahead of later arrivals, so a new primary takes a failover's burst in order and refuses fresh requests only
once the burst and they would wait beyond the budget.
"""

from __future__ import annotations

import asyncio
import enum
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from hotweights.standby.kvpool import AUTO, KV_MEMORY_SHARE

RETRY_AFTER_S = 1  # what a refusal tells the client to wait before it tries again, when no better time is known
QUEUE_BUDGET_S = 10.0  # how long a request's expected start may be away for it to wait: ``ServingLimits``
MAX_WAITING = 1024  # the most sequences an engine lets wait, whatever their expected start (memory)
RESOLUTION_S = 1e-4  # how closely ``expected_start`` finds a time
HOLD_WAVES = 4  # ``Admission.hold_s`` averages about the holds of this many times as many requests as it has slots


@dataclass(frozen=True)
class ServingLimits:
    """How one engine serves and how much it takes on: the defaults of ``hotweights engine``'s flags, ``hotweights
    agent``'s and ``[engine]`` of ``cluster.toml``, defined here once (``queue_budget_s``, ``batch_invariant`` and the
    KV pool's are the reference engine's only: ``standby.kvpool``)."""

    kv_cache_tokens: int = 4096  # the KV positions one sequence may hold (prompt and generated tokens)
    max_batch: int = AUTO  # sequences generated at once (0: what the KV pool holds, standby.kvpool.auto_max_batch)
    kv_pool_tokens: int = AUTO  # KV positions in each engine's pool of blocks (0: sized automatically)
    kv_memory_share: float = KV_MEMORY_SHARE  # on CUDA, the device memory after the weights its engines' pools take
    drain_timeout_s: float = 30.0  # how long a drain waits for what is generating before it cancels it
    queue_budget_s: float = QUEUE_BUDGET_S  # a completion waits while its expected start is within this; else 429
    batch_invariant: bool = False  # a request's text independent of what shares its steps (standby.decoder)


@dataclass(frozen=True)
class LiveTimes:
    """What an engine has measured: how long each sequence it generates has yet to go (its remaining tokens at the
    time a round takes now) and how long a request typically holds its slots, from taking them to giving them back
    (> 0)."""

    remaining_s: list[float]
    hold_s: float


def expected_start(times: LiveTimes, running: int, held: int, ahead: int) -> float:
    """Seconds until the ``ahead``-th slot to free from now (0: the first) frees, of ``running`` slots: those not
    ``held`` are free now; one held by a live sequence frees when it ends (``times.remaining_s``), one held by a
    sequence not yet started (admitted, not yet live: ``held`` beyond the live ones) after a typical hold; each slot
    then frees again every typical hold (``times.hold_s``), as it serves those waiting. A request of ``n`` sequences
    behind ``waiting`` others starts once the ``waiting + n - 1``-th has freed."""
    step = times.hold_s
    ends = sorted(times.remaining_s)[:running]
    ends += [step] * (min(held, running) - len(ends)) + [0.0] * (running - max(held, len(ends)))

    def freed(at: float) -> int:
        return sum(math.floor((at - end) / step) + 1 for end in ends if end <= at)

    low, high = 0.0, min(ends) + ahead * step  # by then the soonest slot alone has freed ahead + 1 times
    if freed(low) > ahead:
        return 0.0
    while high - low > RESOLUTION_S:
        middle = (low + high) / 2
        low, high = (low, middle) if freed(middle) > ahead else (middle, high)
    return high


class Verdict(enum.Enum):
    ADMIT = "admitted"  # its slots are free: served at once
    QUEUE = "queued"  # waits for its slots
    REFUSE = "refused"  # answered at once: it would start beyond the budget, or the queue is full


def verdict(slot_free: bool, owed: bool, room: bool, start_s: float | None, budget_s: float) -> Verdict:
    """What happens to a request that arrives now: served when its slots are free; else queued when it is owed, or
    when the queue has ``room`` for it and it is expected to start within ``budget_s`` (``start_s``: None while
    nothing is timed, when it waits); refused otherwise."""
    if slot_free:
        return Verdict.ADMIT
    if owed or (room and (start_s is None or start_s <= budget_s)):
        return Verdict.QUEUE
    return Verdict.REFUSE


def retry_after(admits_in_s: float | None) -> int:
    """The ``Retry-After`` of a refusal: the whole seconds until a request would wait (at least 1), ``RETRY_AFTER_S``
    when unknown."""
    return RETRY_AFTER_S if admits_in_s is None else max(1, math.ceil(admits_in_s))


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused, and in how many seconds one arriving would wait instead (None: unknown)."""

    reason: str
    admits_in_s: float | None = None


@dataclass(frozen=True)
class Held:
    """The slots an admitted request holds, since when, and the KV blocks it reserved once its prompts were known
    (``Admission.reserve``; ``Admission.leave`` gives them all back)."""

    prompts: int
    since: float  # monotonic time they were granted to it
    blocks: int = 0


@dataclass
class Slots:
    """``capacity`` slots, taken several at a time, first come first served: a taker waits until as many as it asks
    for are free and nobody waits ahead of it."""

    capacity: int
    free: int = field(init=False)
    _waiters: deque[tuple[int, asyncio.Future[float]]] = field(init=False, default_factory=deque)

    def __post_init__(self) -> None:
        self.free = self.capacity

    def available(self, n: int) -> bool:
        """Whether ``n`` slots would be taken at once."""
        return not self._waiters and self.free >= n

    async def take(self, n: int) -> float:
        """Hold ``n`` slots (``give`` returns them): the monotonic time they were granted, which for a taker that
        waited is when another gave them back, not when it went on; cancelled while it waits, it holds none."""
        if self.available(n):
            self.free -= n
            return time.monotonic()
        entry: tuple[int, asyncio.Future[float]] = (n, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        try:
            return await entry[1]
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
                future.set_result(time.monotonic())


class Timing(Protocol):
    """What an engine's scheduler has measured (``standby.scheduler.Scheduler``)."""

    def remaining_s(self) -> list[float] | None: ...  # each live sequence's time to go; None until a round is timed


@dataclass
class Admission:
    """``enter`` before serving, ``leave`` once answered; ``waiting`` and ``serving`` count sequences. ``queue``: at
    most this many wait (0: none), owed requests aside; ``budget_s`` and ``timing``: how far away a request's start
    may be for it to wait (module docstring; without ``timing``, room in the queue is enough). ``on_verdict`` counts
    each arrival's verdict; ``on_wait`` gets the seconds a queued request waited once it holds its slots."""

    running: int
    queue: int = MAX_WAITING
    budget_s: float = QUEUE_BUDGET_S
    timing: Timing | None = None
    on_verdict: Callable[[Verdict], None] = lambda _: None
    on_wait: Callable[[float], None] = lambda _: None
    blocks: int = 0  # the KV pool's blocks its sequences reserve (``reserve``; 0: not counted)
    waiting: int = 0  # sequences queued now
    serving: int = 0  # sequences holding a slot now
    short: int = 0  # of those serving, sequences whose request waits for its KV blocks
    hold_s: float = 0.0  # how long a request held its slots, averaged over the last HOLD_WAVES waves (0: none yet)
    _slots: Slots = field(init=False)
    _blocks: Slots = field(init=False)

    def __post_init__(self) -> None:
        self._slots = Slots(self.running)
        self._blocks = Slots(self.blocks)

    async def enter(self, owed: bool = False, prompts: int = 1) -> Refusal | Held:
        """The slots for each of the request's ``prompts`` once it holds them (``leave`` gives them back), after a
        wait when none was free; the refusal otherwise, at once. ``owed``: a request owed to a failover (module
        docstring). ``prompts`` must not exceed ``running`` (it would wait for ever)."""
        decided, times, start = self._decided(owed, prompts)
        self.on_verdict(decided)
        if decided is Verdict.REFUSE:
            return self._refusal(times, start, prompts)
        if decided is Verdict.ADMIT:
            granted = await self._slots.take(prompts)  # free: returns at once
        else:
            granted = await self._wait(prompts)
        self.serving += prompts
        return Held(prompts, granted)

    def refusal(self, prompts: int = 1) -> Refusal | None:
        """The refusal ``enter`` would answer a fresh request of ``prompts`` now, counted as its verdict; None (and
        nothing counted or changed) when it would admit or queue it. A request of more prompts waits behind as many
        more sequences, so one refused for a single prompt is refused for any: a server answers it from its headers
        alone, before its body is read."""
        decided, times, start = self._decided(False, prompts)
        if decided is not Verdict.REFUSE:
            return None
        self.on_verdict(decided)
        return self._refusal(times, start, prompts)

    def _decided(self, owed: bool, prompts: int) -> tuple[Verdict, LiveTimes | None, float | None]:
        """The verdict on a request of ``prompts`` arriving now, with the times and expected start it rests on."""
        slot_free = self._slots.available(prompts)
        times = None if slot_free else self._times()
        start = self._start(times, self.waiting + prompts - 1)
        return verdict(slot_free, owed, self.waiting + prompts <= self.queue, start, self.budget_s), times, start

    async def _wait(self, prompts: int) -> float:
        """Hold ``prompts`` slots once they are this request's turn (``Slots.take``: when they were granted);
        cancelled (its client gone), it holds none."""
        self.waiting += prompts
        queued_at = time.monotonic()
        try:
            granted = await self._slots.take(prompts)
        finally:
            self.waiting -= prompts
        self.on_wait(time.monotonic() - queued_at)
        return granted

    async def reserve(self, held: Held, blocks: int) -> Held:
        """``held`` with ``blocks`` of the KV pool reserved too, once they are free: first come first served, a
        request waits for them however long (the sequences holding them finish: nothing is preempted) and is never
        refused for them; cancelled (its client gone), it reserves none. ``blocks`` must not exceed the pool
        (``standby.kvpool.shortfall`` refuses such a request first); without a pool (``blocks`` 0), ``held``."""
        if not self.blocks:
            return held
        short = 0 if self._blocks.available(blocks) else held.prompts
        self.short += short
        try:
            await self._blocks.take(blocks)
        finally:
            self.short -= short
        return replace(held, blocks=blocks)

    def _times(self) -> LiveTimes | None:
        """What ``expected_start`` needs, once a round and a request's hold have been timed."""
        remaining_s = None if self.timing is None else self.timing.remaining_s()
        return None if remaining_s is None or not self.hold_s else LiveTimes(remaining_s, self.hold_s)

    def _start(self, times: LiveTimes | None, ahead: int) -> float | None:
        """``expected_start`` of the ``ahead``-th slot to free; None while nothing is timed."""
        return None if times is None else expected_start(times, self.running, self.serving, ahead)

    def _refusal(self, times: LiveTimes | None, start: float | None, prompts: int) -> Refusal:
        """Why a fresh request of ``prompts`` expected to start in ``start`` s is refused: the queue is full (it
        would wait once enough of those waiting have started), or its start is beyond the budget (it would wait
        once it is within)."""
        if start is not None and start > self.budget_s:
            reason = (
                f"overloaded: a slot is expected in {start:.1f} s, beyond the queue budget of {self.budget_s:g} s "
                f"({self.serving} sequences generating, {self.waiting} waiting)"
            )
            return Refusal(reason, start - self.budget_s)
        reason = f"overloaded: {self.serving} being served and {self.waiting} waiting, the most that may wait"
        return Refusal(reason, self._start(times, self.waiting + prompts - self.queue - 1))

    def leave(self, held: Held) -> None:
        """Give ``held`` back; how long it was held, from its grant, counts in ``hold_s``: the time a slot is busy
        with a request, what it takes on the event loop before the request goes on included."""
        self.serving -= held.prompts
        self.hold_s = _averaged(self.hold_s, time.monotonic() - held.since, 1 / (HOLD_WAVES * self.running))
        self._slots.give(held.prompts)
        if held.blocks:
            self._blocks.give(held.blocks)


def _averaged(average: float, value: float, weight: float) -> float:
    """An exponentially weighted average with ``value`` in at ``weight``; the first value as it is."""
    return value if not average else (1 - weight) * average + weight * value
