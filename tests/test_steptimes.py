"""How slow an engine's decode steps are against its own best (``standby.steptimes``) and the drills' slowdown
(``standby.drillfaults``), with no engine: steps fed in with their times."""

from __future__ import annotations

import time

import pytest

from hotweights.standby.drillfaults import SLOWDOWN, DrillFaults
from hotweights.standby.steptimes import IDLE_S, MIN_STEPS, WINDOW_S, Clock, StepTimes, StepWatch, bound

pytestmark = pytest.mark.unit


def test_each_shape_is_compared_with_its_own_best() -> None:
    """A longer KV or a larger batch (a long prompt, overload) takes longer at its best too: not slowness."""
    times, now = StepTimes(), time.monotonic()
    for shape, seconds in [((1, 16), 0.002), ((4, 4096), 0.050), ((1, 16), 0.003), ((4, 4096), 0.050)]:
        times.stepped(shape, seconds, now)
    assert times.baselines == {(1, 16): 0.002, (4, 4096): 0.050}
    reading = times.recent()
    assert reading is not None and reading.steps == 4
    assert reading.ratio == pytest.approx(0.105 / 0.104)


def test_the_ratio_is_weighted_by_time_so_a_slowdown_shows_at_once() -> None:
    times, now = StepTimes(), time.monotonic()
    for _ in range(10):
        times.stepped((1, 16), 0.002, now - 0.5)
    times.stepped((1, 16), 0.040, now)  # one step 20x slower weighs 20 of the others
    reading = times.recent()
    assert reading is not None and reading.ratio == pytest.approx(0.060 / 0.022)


@pytest.mark.parametrize(
    ("ages", "steps"),
    [
        pytest.param((0.1, 0.2, 0.3, 0.4), 4, id="the last second's steps"),
        pytest.param((0.1, 2.0 * WINDOW_S, 3.0 * WINDOW_S, 4.0 * WINDOW_S), MIN_STEPS, id="slow steps: the last few"),
        pytest.param((IDLE_S + 1.0,), 0, id="idle: nothing to say"),
    ],
)
def test_a_reading_covers_the_last_second_or_the_last_few_steps(ages: tuple[float, ...], steps: int) -> None:
    times, now = StepTimes(), time.monotonic()
    for age in sorted(ages, reverse=True):
        times.stepped((1, 16), 0.002, now - age)
    reading = times.recent()
    assert (reading.steps if reading else 0) == steps


def test_a_slowed_step_counts_its_delay_as_the_devices_time() -> None:
    faults = DrillFaults()
    watch = StepWatch(StepTimes(), faults)
    watch.stepped((1, 16), Clock(time.monotonic(), time.thread_time() - 0.001), on_cpu=True)
    faults.slow = True
    watch.stepped((1, 16), Clock(time.monotonic(), time.thread_time() - 0.001), on_cpu=True)
    reading = watch.times.recent()
    assert reading is not None and reading.seconds / reading.baseline_s == pytest.approx((1 + SLOWDOWN) / 2, rel=0.2)


def test_wrong_outputs_rotate_every_row_by_one_token() -> None:
    """The greedy token of rotated logits is the next id, the last one wrapping to 0; right ones are untouched."""
    torch = pytest.importorskip("torch")  # the fast tier runs without it too
    faults, logits = DrillFaults(), torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0], [0.0, 1.0, 9.0]])
    assert faults.logits(logits) is logits and faults.greedy([1, 0, 2], 3) == [1, 0, 2]
    faults.wrong = True
    assert faults.logits(logits).argmax(-1).tolist() == faults.greedy([1, 0, 2], 3) == [2, 1, 0]


@pytest.mark.parametrize(
    ("known", "shape", "expected"),
    [
        pytest.param({}, (4, 256), float("inf"), id="nothing known"),
        pytest.param({(32, 256): 0.010}, (4, 256), 0.010, id="more rows, as many positions"),
        pytest.param({(1, 256): 0.002}, (4, 256), 0.008, id="fewer rows: scaled by the rows"),
        pytest.param({(1, 512): 0.003, (32, 512): 0.010}, (4, 256), 0.010, id="more positions: the least bound"),
        pytest.param({(32, 128): 0.001}, (4, 256), float("inf"), id="fewer positions bound nothing"),
    ],
)
def test_a_shape_is_bounded_by_the_shapes_known(known: dict, shape: tuple[int, int], expected: float) -> None:
    assert bound(known, shape) == pytest.approx(expected)


def test_a_slowed_device_is_measured_against_its_speed_in_shapes_it_never_ran_before() -> None:
    """Warm-up ran one row and every row; serving at one or two rows; slowed 20x, the queue piles up into batches
    of shapes never seen: each first step is bounded by a known shape, so the slowness shows; a shape first seen at
    its speed is its own baseline."""
    times, now = StepTimes(), time.monotonic()
    for shape, seconds in [((1, 256), 0.0013), ((32, 256), 0.004), ((2, 256), 0.0015)]:
        times.stepped(shape, seconds, now - 5)
    times.stepped((3, 256), 0.0017, now - 5)
    assert times.baselines[(3, 256)] == 0.0017
    for rows in range(5, 12):
        times.stepped((rows, 256), 20 * 0.002, now)
    reading = times.recent()
    assert reading is not None and reading.ratio > 5
