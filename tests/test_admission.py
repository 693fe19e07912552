"""Admission by expected wait: when a request's slots are expected to free, what happens to it, and what a refusal
says, as tables; then ``Admission`` itself on an event loop, against a scheduler's times as the test sets them."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

import pytest

from hotweights.admission import (
    HOLD_WAVES,
    RETRY_AFTER_S,
    Admission,
    Held,
    LiveTimes,
    Refusal,
    Verdict,
    expected_start,
    retry_after,
    verdict,
)

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("remaining_s", "hold_s", "running", "held", "ahead", "expected"),
    [
        ([0.3, 0.3, 0.3, 0.3], 0.32, 4, 4, 0, 0.3),  # a wave ends together
        ([0.3, 0.3, 0.3, 0.3], 0.32, 4, 4, 3, 0.3),
        ([0.3, 0.3, 0.3, 0.3], 0.32, 4, 4, 4, 0.62),  # behind a whole wave of those waiting
        ([0.3, 0.3, 0.3, 0.3], 0.32, 4, 4, 8, 0.94),
        ([0.01, 0.3, 0.3, 0.3], 0.32, 4, 4, 0, 0.01),  # one ends soon
        ([0.01, 0.3, 0.3, 0.3], 0.32, 4, 4, 1, 0.3),
        ([0.01, 0.3, 0.3, 0.3], 0.32, 4, 4, 4, 0.33),  # the soonest slot serves the first who waited
        ([5.0, 0.1], 1.0, 2, 2, 4, 4.1),  # a long one holds its slot: the short one's serves those waiting
        ([5.0, 0.1], 1.0, 2, 2, 5, 5.0),
        ([0.5, 0.5], 1.0, 4, 2, 1, 0.0),  # free slots
        ([0.5, 0.5], 1.0, 4, 2, 2, 0.5),
        ([0.5], 1.0, 2, 2, 1, 1.0),  # a slot held by a sequence not yet started: a whole hold
        ([0.5], 1.0, 2, 2, 2, 1.5),
        ([0.2, 0.9], 1.0, 1, 1, 0, 0.2),  # more live than slots (one cancelled, not yet unwound): the soonest
    ],
)
def test_a_waiting_request_starts_when_the_slot_it_waits_for_frees(
    remaining_s: list[float], hold_s: float, running: int, held: int, ahead: int, expected: float
) -> None:
    found = expected_start(LiveTimes(remaining_s, hold_s), running, held, ahead)
    assert found == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize(
    ("slot_free", "owed", "room", "start_s", "expected"),
    [
        (True, False, False, 99.0, Verdict.ADMIT),  # a free slot serves at once, whatever else
        (False, False, True, 9.9, Verdict.QUEUE),  # within the budget of 10 s
        (False, False, True, 10.0, Verdict.QUEUE),
        (False, False, True, 10.1, Verdict.REFUSE),  # beyond it
        (False, False, True, None, Verdict.QUEUE),  # nothing timed yet
        (False, False, False, None, Verdict.REFUSE),  # the queue is full
        (False, False, False, 0.1, Verdict.REFUSE),
        (False, True, False, 99.0, Verdict.QUEUE),  # owed: never refused for want of queue
    ],
)
def test_admission_verdict(slot_free: bool, owed: bool, room: bool, start_s: float | None, expected: Verdict) -> None:
    assert verdict(slot_free, owed, room, start_s, 10.0) is expected


@pytest.mark.parametrize(
    ("admits_in_s", "expected"), [(None, RETRY_AFTER_S), (0.0, 1), (0.2, 1), (1.0, 1), (1.01, 2), (12.3, 13)]
)
def test_retry_after_is_the_whole_seconds_until_a_request_would_wait(admits_in_s: float | None, expected: int) -> None:
    assert retry_after(admits_in_s) == expected


@dataclass
class Times:
    """A scheduler's times as a test sets them (``hotweights.admission.Timing``); None: no round timed yet."""

    remaining: list[float] | None = None

    def remaining_s(self) -> list[float] | None:
        return self.remaining


def served(answers: list[Refusal | Held]) -> bool:
    return all(isinstance(answer, Held) for answer in answers)


async def queued(admission: Admission, n: int, owed: bool = False) -> list[asyncio.Task[Refusal | Held]]:
    """``n`` requests that arrive now, once each has been decided (a refused one is done, a queued one waits)."""
    tasks = [asyncio.create_task(admission.enter(owed)) for _ in range(n)]
    await asyncio.sleep(0)
    return tasks


async def release(admission: Admission, entered: list[Refusal | Held | asyncio.Task[Refusal | Held]]) -> None:
    """Each request of ``entered`` that holds slots gives them back in turn, once it holds them."""
    for each in entered:
        held = await each if isinstance(each, asyncio.Task) else each
        if isinstance(held, Held):
            admission.leave(held)
        await asyncio.sleep(0)


def test_before_anything_is_timed_a_burst_waits_and_is_served_in_order() -> None:
    async def scenario() -> tuple[list[Verdict], list[int]]:
        seen: list[Verdict] = []
        admission = Admission(2, budget_s=0.0, timing=Times([0.5, 0.5]), on_verdict=seen.append)  # no hold timed
        order: list[int] = []
        holds: list[Held] = []

        async def enter(i: int) -> None:
            held = await admission.enter()
            assert isinstance(held, Held)
            holds.append(held)
            order.append(i)

        tasks = [asyncio.create_task(enter(i)) for i in range(10)]
        await asyncio.sleep(0)
        assert (admission.serving, admission.waiting) == (2, 8)
        for _ in range(10):
            admission.leave(holds.pop(0))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        return seen, order

    seen, order = asyncio.run(scenario())
    assert seen == [Verdict.ADMIT] * 2 + [Verdict.QUEUE] * 8
    assert order == list(range(10))


def test_a_request_waits_while_its_start_is_within_the_budget_and_is_refused_at_once_beyond() -> None:
    """One slot, its sequence 0.4 s from its end, a sequence 0.4 s long, a budget of 1 s: the first two that find no
    slot are expected at 0.4 and 0.8 s and wait; the third, at 1.2 s, is refused, told that one arriving 0.2 s later
    would wait."""

    async def scenario() -> tuple[list[Refusal | Held], Refusal | Held]:
        admission = Admission(1, budget_s=1.0, timing=Times([0.4]), hold_s=0.4)
        first = await admission.enter()
        waiting = await queued(admission, 2)
        refused = await admission.enter()
        await release(admission, [first, *waiting])
        return [await task for task in waiting], refused

    waited, refused = asyncio.run(scenario())
    assert served(waited)
    assert isinstance(refused, Refusal)
    assert "a slot is expected in 1.2 s, beyond the queue budget of 1 s" in refused.reason
    assert refused.admits_in_s == pytest.approx(0.2, abs=1e-3)


def test_the_refusal_of_a_fresh_request_is_known_before_it_enters_and_changes_nothing_else() -> None:
    """What a server answers from a request's headers: None (nothing counted, nothing held) while a fresh request of one
    prompt would be admitted or queued; the refusal ``enter`` would give, counted, once it would be refused."""

    async def scenario() -> tuple[list[Refusal | None], list[Verdict], tuple[int, int]]:
        seen: list[Verdict] = []
        admission = Admission(1, budget_s=1.0, timing=Times([0.4]), hold_s=0.4, on_verdict=seen.append)
        answers = [admission.refusal()]  # a free slot
        first = await admission.enter()
        answers.append(admission.refusal())  # expected at 0.4 s: would wait
        waiting = await queued(admission, 2)
        answers.append(admission.refusal())  # expected at 1.2 s: refused
        state = (admission.serving, admission.waiting)
        await release(admission, [first, *waiting])
        return answers, seen, state

    answers, seen, state = asyncio.run(scenario())
    assert answers[:2] == [None, None] and isinstance(answers[2], Refusal)
    assert "a slot is expected in 1.2 s" in answers[2].reason and answers[2].admits_in_s == pytest.approx(0.2, abs=1e-3)
    assert seen == [Verdict.ADMIT, Verdict.QUEUE, Verdict.QUEUE, Verdict.REFUSE] and state == (1, 2)


def test_a_request_of_several_prompts_waits_as_that_many_sequences() -> None:
    """Two slots, one free and one held 0.3 s more: a request of two prompts waits as two sequences, for the first
    two slots to free (now and at 0.3 s); one of one prompt behind it, for the third (the free one again, a sequence
    of 1 s later): beyond a budget of 0.9 s."""

    async def scenario() -> tuple[Refusal | Held, Refusal | Held, int]:
        admission = Admission(2, budget_s=0.9, timing=Times([0.3]), hold_s=1.0)
        first = await admission.enter()
        pair = asyncio.create_task(admission.enter(prompts=2))
        await asyncio.sleep(0)
        waiting = admission.waiting
        single = await admission.enter()
        await release(admission, [first])
        return await pair, single, waiting

    pair, single, waiting = asyncio.run(scenario())
    assert isinstance(pair, Held) and pair.prompts == 2 and waiting == 2
    assert isinstance(single, Refusal) and single.admits_in_s == pytest.approx(0.1, abs=1e-3)


def test_an_owed_request_waits_whatever_its_start_and_the_queue() -> None:
    """Past the budget and past a full queue, a request owed to a failover waits its turn; a fresh one meets both."""

    async def scenario() -> tuple[list[Refusal | Held], Refusal | Held, int]:
        admission = Admission(1, queue=1, budget_s=0.5, timing=Times([2.0]), hold_s=2.0)
        first = await admission.enter()
        owed = await queued(admission, 3, owed=True)
        fresh = await admission.enter()
        waiting = admission.waiting
        await release(admission, [first, *owed])
        return [await task for task in owed], fresh, waiting

    owed, fresh, waiting = asyncio.run(scenario())
    assert served(owed) and waiting == 3
    assert isinstance(fresh, Refusal) and "beyond the queue budget" in fresh.reason


@pytest.mark.parametrize(("hold_s", "admits_in_s"), [(0.0, None), (0.4, 0.4)], ids=["untimed", "timed"])
def test_a_full_queue_refuses_and_says_when_it_has_room(hold_s: float, admits_in_s: float | None) -> None:
    """One slot, a queue of two, a budget no start reaches: the third to find no slot is refused; timed, it is told
    that the queue has room once the slot held now frees and the first waiting starts."""

    async def scenario() -> Refusal | Held:
        admission = Admission(1, queue=2, budget_s=100.0, timing=Times([0.4]), hold_s=hold_s)
        first = await admission.enter()
        waiting = await queued(admission, 2)
        refused = await admission.enter()
        await release(admission, [first, *waiting])
        return refused

    refused = asyncio.run(scenario())
    assert isinstance(refused, Refusal) and "1 being served and 2 waiting, the most that may wait" in refused.reason
    assert refused.admits_in_s == (pytest.approx(admits_in_s, abs=1e-3) if admits_in_s is not None else None)


def test_without_a_queue_a_full_server_refuses_at_once() -> None:
    """A gateway's admission: as many proxied at once as it may, none waiting, nothing timed."""

    async def scenario() -> tuple[Refusal | Held, Refusal | Held]:
        admission = Admission(1, queue=0)
        first = await admission.enter()
        refused = await admission.enter()
        await release(admission, [first])
        return refused, await admission.enter()

    refused, again = asyncio.run(scenario())
    assert isinstance(refused, Refusal) and refused.admits_in_s is None
    assert isinstance(again, Held)


def test_a_request_whose_client_goes_away_while_it_waits_leaves_the_line() -> None:
    async def scenario() -> tuple[int, Refusal | Held]:
        admission = Admission(1, timing=Times())
        first = await admission.enter()
        gone, behind = await queued(admission, 2)
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        waiting = admission.waiting
        await release(admission, [first])
        return waiting, await behind

    waiting, behind = asyncio.run(scenario())
    assert waiting == 1 and isinstance(behind, Held)


def test_a_queued_request_reports_how_long_it_waited_for_its_slot() -> None:
    async def scenario() -> list[float]:
        waits: list[float] = []
        admission = Admission(1, on_wait=waits.append)
        first = await admission.enter()  # served at once: no wait reported
        waiter = asyncio.create_task(admission.enter())
        await asyncio.sleep(0.05)  # the time it waits
        await release(admission, [first])
        assert isinstance(await waiter, Held)
        return waits

    waits = asyncio.run(scenario())
    assert len(waits) == 1 and 0.05 <= waits[0] < 5.0, waits


def test_a_request_s_hold_is_measured_from_taking_its_slots_to_giving_them_back() -> None:
    """The first hold is taken as it is, later ones averaged in, each from when its slot was granted (for one that
    waited, when the one before gave it back); until one has been given back nothing is timed and every request
    waits, whatever the budget."""

    async def scenario() -> tuple[float, float, Refusal | Held]:
        admission = Admission(1, budget_s=0.0, timing=Times([1.0]))
        first = await admission.enter()
        waiting = await queued(admission, 1)  # nothing timed: it waits
        await asyncio.sleep(0.05)
        await release(admission, [first])
        one = admission.hold_s
        await release(admission, waiting)
        return one, admission.hold_s, await admission.enter()

    one, two, third = asyncio.run(scenario())
    assert 0.05 <= one < 5.0
    assert (1 - 1 / HOLD_WAVES) * one <= two < one  # a short one averaged in (one slot: a wave is one request)
    assert isinstance(third, Held)


def test_a_request_waits_for_its_kv_blocks_first_come_first_served_and_is_never_refused_for_them() -> None:
    """A pool of 10 blocks, four slots: a request holding 8 blocks; one needing 4 waits (counted short), and one
    needing 2 behind it waits too though 2 are free (no one passes a request that waits); both hold theirs once the
    first leaves, which gives its slot and blocks back. A cancelled wait reserves nothing."""

    async def scenario() -> tuple[list[int], list[int], int]:
        admission = Admission(4, blocks=10)
        first = await admission.reserve(await admission.enter(), 8)
        second = asyncio.create_task(admission.reserve(await admission.enter(), 4))
        third = asyncio.create_task(admission.reserve(await admission.enter(), 2))
        await asyncio.sleep(0)
        short = [admission.short]
        gone = asyncio.create_task(admission.reserve(await admission.enter(), 1))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        short.append(admission.short)
        admission.leave(first)
        held = [(await second).blocks, (await third).blocks]
        return short, held, admission.serving

    short, held, serving = asyncio.run(scenario())
    assert short == [2, 2] and held == [4, 2] and serving == 3  # the cancelled one's slot is its caller's to leave


def test_without_a_pool_a_request_reserves_nothing() -> None:
    async def scenario() -> Held:
        admission = Admission(1)
        return await admission.reserve(await admission.enter(), 10**6)

    assert asyncio.run(scenario()).blocks == 0
