"""Progress-based health of the inference thread: an engine with work pending that makes no progress is unhealthy.

An engine whose HTTP server answers while its inference loop is stuck (a kernel that never returns, a collective
that never completes, a lock never released) passes every check that only asks whether it answers. So the reference
engine judges its worker by progress. With sequences pending (submitted and not finished), each operation of the
worker must finish within ``stall_bound_s`` of the previous one's end (or of the work's arrival, after none was
pending): a decode step (a token for every active sequence), a prefill, a call to the cache daemon. The bound is
STALL_FACTOR times the expected duration of the operation in flight, never below STALL_FLOOR_S. The time the
inference thread spent runnable but waiting for a core (Linux's ``schedstat`` of the thread: a host whose cores
other processes keep busy, as a burst of requests beside its other engines does) is not counted as time without
progress; a thread blocked (a frozen loop, a lock, a collective, a stopped process) waits for no core, so it is:

- a decode step, or the time between operations: the engine's decode steps, averaged (none decoded yet: no bound
  but the loop's heartbeat, as below: an engine just promoted is not judged before it has measured a step);
- a prefill: the measured time of its shape (prompts, padded length: the fixed shapes of ``standby.decoder``), its
  own where that shape ran before (at warm-up or since), else the least that a measured shape gives when scaled up
  (``expected_prefill_s``), so a long prompt is allowed its long prefill; none measured at all (the first prefill
  of an engine promoted without a warm-up decoder): no bound but the loop's heartbeat (``standby.server``);
- a call to the cache daemon: its reply timeout (``standby.kvshare.REQUEST_TIMEOUT_S``).

Past the bound, ``/health/ready`` (hence ``/primary``) answers 503 with the reason (``stall_refusal``), the
controller fails over from the engine as from a hang (fence, promote) and the gateway re-sends or continues what
was in flight there. The decision is a pure function of one ``Progress`` snapshot; ``ProgressClock`` keeps what it
reads, written by the inference thread.
The agent beside a vLLM or SGLang engine judges that engine by the same decision (one floor, one factor), from the
tokens it relays (``standby.agentprogress``).

``FREEZE_SIGNAL`` is the drill's way to make this happen (``hotweights drill stall-primary``): the engine freezes
its inference thread for the rest of its life while its HTTP server goes on answering. Only a process allowed to
signal the engine (its user, or root) can send it; no request can.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import signal
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from hotweights.standby.opening import Opening

log = logging.getLogger(__name__)

STALL_FLOOR_S = 1.0  # the least time without progress, work pending, that makes the engine unhealthy
STALL_FACTOR = 10.0  # how many times its expected duration an operation of the worker may take (a loaded host)
SMOOTHING = 0.2  # the weight of the newest measurement in an engine's averaged times
FREEZE_SIGNAL = signal.SIGUSR2  # freezes the inference thread for good (the drill's stall fault)

Shape = tuple[int, int]  # a prefill's (prompts, padded length)


@dataclass(frozen=True)
class Step:
    """An operation of the worker in flight."""

    what: str  # e.g. "a prefill of 2 x 512 tokens"
    started: float  # time.monotonic()
    expected_s: float | None  # None: nothing measured to expect it by


@dataclass(frozen=True)
class Progress:
    """One reading of the worker's progress (``ProgressClock.reading``)."""

    pending: int  # sequences submitted and not finished
    since: float  # time.monotonic() of the last operation's end, or of the work's arrival after none was pending
    step: Step | None  # what runs now; None: between operations
    decode_s: float  # a decode step's time, averaged; 0 until one ran
    subject: str = "the inference thread"  # what makes the progress, as the reason names it
    units: str = "sequence(s)"  # what ``pending`` counts
    waited_s: float = 0.0  # of the time since ``since``, what the worker spent runnable, waiting for a core


def stall_bound_s(progress: Progress) -> float | None:
    """How long the worker may go without progress now (module docstring); None: no bound (nothing measured to
    expect the operation in flight by)."""
    expected = progress.step.expected_s if progress.step is not None else progress.decode_s or None
    return None if expected is None else max(STALL_FLOOR_S, STALL_FACTOR * expected)


def stall_refusal(progress: Progress, now: float) -> str | None:
    """Why the worker counts as stalled at ``now``, or None: work is pending and no operation ended for longer than
    ``stall_bound_s``."""
    bound = stall_bound_s(progress)
    quiet = now - progress.since - progress.waited_s
    if not progress.pending or bound is None or quiet <= bound:
        return None
    doing = f", in {progress.step.what} for {now - progress.step.started:.1f} s" if progress.step else ""
    waited = f", {progress.waited_s:.1f} s more waiting for a core" if progress.waited_s >= 0.05 else ""
    return (
        f"{progress.subject} has made no progress for {quiet:.1f} s{waited} with {progress.pending} "
        f"{progress.units} pending{doing} (its bound: {bound:.1f} s)"
    )


def expected_prefill_s(measured: Mapping[Shape, float], shape: Shape) -> float | None:
    """The expected time of a prefill of ``shape``: its own measured time, else the least of the measured shapes'
    times, each scaled up by the larger of the ratios of tokens (prompts x length: the matrix products) and of
    prompts x length² (attention) when they are above one, a bound for any cost a + b x tokens + c x prompts x length²;
    None when nothing was measured."""
    if shape in measured:
        return measured[shape]
    rows, length = shape

    def scaled(seconds: float, other: Shape) -> float:
        tokens, attention = rows * length / (other[0] * other[1]), rows * length**2 / (other[0] * other[1] ** 2)
        return seconds * max(1.0, tokens, attention)

    return min((scaled(seconds, other) for other, seconds in measured.items()), default=None)


def padded(lengths: Sequence[int], longest: int) -> int:
    """The prefill length (of the sorted ``lengths``) a prompt of ``longest`` tokens is padded to; ``longest``
    itself beyond the last (a prefill the decoder refuses)."""
    i = bisect.bisect_left(lengths, longest)
    return lengths[i] if i < len(lengths) else longest


class ProgressClock:
    """What ``stall_refusal`` reads, kept as the worker goes. ``arrived`` is called by submitters (under the
    scheduler's lock, when nothing was pending), everything else on the inference thread; readers take a
    ``reading`` from any thread (single attribute reads and writes)."""

    def __init__(self) -> None:
        self.since = time.monotonic()
        self.waits = RunQueueWait()  # the inference thread's (``RunQueueWait.follow_this_thread`` as it starts)
        self.waited_since = 0.0  # its run-queue wait at ``since``
        self.step: Step | None = None
        self.decode_s = 0.0
        self.prefills: dict[Shape, float] = {}  # seconds per prefill shape, averaged
        self.stalled = False  # a stall was reported and has not ended (logged once each)
        self.opening = Opening()  # the first seconds of serving, fed the steps and prefills timed here

    def arrived(self) -> None:
        """Work arrived while none was pending: the time without progress counts from now."""
        self.since, self.waited_since = time.monotonic(), self.waits.seconds()

    def learn(self, prefills: Mapping[Shape, float]) -> None:
        """Take prefill times measured elsewhere (a decoder's warm-up) for the shapes not measured here."""
        for shape, seconds in prefills.items():
            self.prefills.setdefault(shape, seconds)

    @contextlib.contextmanager
    def decoding(self, rows: int) -> Iterator[None]:
        with self._running(f"a decode step of {rows} row(s)", self.decode_s or None) as started:
            yield
        seconds = time.monotonic() - started
        self.decode_s = averaged(self.decode_s, seconds)
        self.opening.stepped(rows, seconds)

    @contextlib.contextmanager
    def prefilling(self, shape: Shape) -> Iterator[None]:
        what = f"a prefill of {shape[0]} x {shape[1]} tokens"
        with self._running(what, expected_prefill_s(self.prefills, shape)) as started:
            yield
        seconds = time.monotonic() - started
        self.prefills[shape] = averaged(self.prefills.get(shape, 0.0), seconds)
        self.opening.prefilled(shape[0], seconds)

    def calling_daemon(self) -> contextlib.AbstractContextManager[float]:
        from hotweights.standby.kvshare import REQUEST_TIMEOUT_S  # here: it imports torch, which the agent has not

        return self._running("a call to the cache daemon", REQUEST_TIMEOUT_S)

    @contextlib.contextmanager
    def _running(self, what: str, expected_s: float | None) -> Iterator[float]:
        """``what`` in flight for the body; its end (also by an exception: its sequences failed) is progress."""
        step = self.step = Step(what, time.monotonic(), expected_s)
        try:
            yield step.started
        finally:
            self.step, self.since, self.waited_since = None, time.monotonic(), self.waits.seconds()

    def reading(self, pending: int) -> Progress:
        waited = max(self.waits.seconds() - self.waited_since, 0.0)
        return Progress(pending, self.since, self.step, self.decode_s, waited_s=waited)

    def refusal(self, pending: int) -> str | None:
        """``stall_refusal`` now, for ``pending`` sequences; a stall's start and end are logged once each."""
        reason = stall_refusal(self.reading(pending), time.monotonic())
        if bool(reason) != self.stalled:
            self.stalled = bool(reason)
            if reason:
                log.error("unhealthy: %s", reason)
            else:
                log.warning("the inference thread makes progress again")
        return reason


class RunQueueWait:
    """How long one thread has been runnable but waiting for a core, in all (``/proc/thread-self/schedstat``'s second
    field, kept open so that any thread reads it in a few microseconds); 0 where the kernel does not say."""

    def __init__(self) -> None:
        self._fd: int | None = None

    def follow_this_thread(self) -> None:
        """Read the calling thread's from now on (called once, by the worker as it starts)."""
        with contextlib.suppress(OSError):
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            weakref.finalize(self, os.close, self._fd)

    def seconds(self) -> float:
        if self._fd is None:
            return 0.0
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return 0.0


def averaged(average: float, value: float) -> float:
    """An exponentially weighted average (SMOOTHING) with ``value`` in; the first value as it is."""
    return value if not average else (1 - SMOOTHING) * average + SMOOTHING * value
