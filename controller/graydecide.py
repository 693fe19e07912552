"""Pure: gray failures, engines that answer their health checks but serve badly: slow steps, wrong answers.

Two decisions, from what the engines report and no I/O (``controller.graywatch`` gathers the reports and carries the
decisions out; ``tests/test_graydecide.py`` tables them):

- ``degraded_primary``: a primary whose decode steps stay ``factor`` times slower than its own best
  (``standby.steptimes``: the time of its steps, never of its requests, so a queue under overload adds nothing) for
  ``for_s`` in a row, and ``factor`` times slower than a ready standby's canary asked while it looked slow (so a
  slowdown of the whole host, which slows the standbys' canaries alike, never counts: it starts the spell again),
  is switched over to the least slow such standby: planned, its streams handed over with their KV cache, nothing
  fenced. At most one such switchover per group every ``every_s``: a slowdown that follows the primary never makes
  the group flap.
- ``judge_canaries``: the engines that serve the same weights (one fingerprint) must give the canary's answer
  (``standby.canary``). The answer is what a strict majority of them gave, else (no majority: two engines that
  differ, one engine alone) the answer agreed before; the first engine to answer for new weights (a model update's)
  sets it. An engine whose answer differs from it is wrong, to be fenced, unless every engine differs from it: the
  agreed answer was then the odd one out (re-established when they agree), and nothing is fenced.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hotweights.controller.snapshot import MemberView
from hotweights.eventkinds import EventField, EventKind

Answer = tuple[int, ...]  # a canary's tokens


@dataclass(frozen=True)
class DegradePolicy:
    """``health.degraded_*``: how much slower, for how long, and how often at most."""

    factor: float
    for_s: float
    every_s: float

    def too_soon(self, last_switch: float | None, now: float) -> bool:
        """Whether the group's last switchover for slowness (``last_switch``, None: none yet) was under ``every_s``
        before ``now``: the bound on how often a group switches over for slowness, whatever saw it slow."""
        return last_switch is not None and now - last_switch < self.every_s


@dataclass(frozen=True)
class CanaryReading:
    """An engine's latest canary: its answer and how slow its steps were (``standby.canary``)."""

    member: str
    pid: int
    fingerprint: str
    tokens: Answer
    slowness: float | None
    at: float  # time.monotonic() when it was asked


@dataclass(frozen=True)
class SlowSpell:
    """A group's primary: slower than ``factor`` times its best since ``slow_since`` (standbys' canaries asked then,
    none of them as slow since), and found ``factor`` times slower than a standby's at ``since`` (None: not yet);
    ``last_switch``: the group's last such switchover."""

    primary: str | None = None
    slow_since: float | None = None
    since: float | None = None
    last_switch: float | None = None


@dataclass(frozen=True)
class SwitchAway:
    """Switch the group over from ``old`` to ``new`` (planned), for ``reason``."""

    old: MemberView
    new: MemberView
    reason: str


def slowness_of(member: MemberView) -> float | None:
    """The ratio of its recent steps' time to their best (``/health/ready``'s ``slowness``); None when it has not
    stepped lately or says nothing."""
    slowness = (member.health.body or {}).get("slowness")
    ratio = slowness.get("ratio") if isinstance(slowness, dict) else None
    return float(ratio) if isinstance(ratio, int | float) and ratio > 0 else None


def degraded_primary(
    primary: MemberView | None,
    standbys: Sequence[MemberView],
    canaries: Mapping[str, CanaryReading],
    spell: SlowSpell,
    now: float,
    policy: DegradePolicy,
) -> tuple[SwitchAway | None, SlowSpell]:
    """The switchover to make now (module docstring), if any, and the group's spell after this look. ``standbys``:
    the group's ready standbys; ``canaries``: the latest canary of each engine by id (a standby's counts only when
    it was asked while the primary looked slow: the caller asks them when ``slow_since`` begins)."""
    ratio = slowness_of(primary) if primary is not None and primary.is_serving_primary else None
    if primary is None or ratio is None or ratio < policy.factor:
        return None, SlowSpell(last_switch=spell.last_switch)
    same = spell.primary == primary.id
    slow_since = spell.slow_since if same and spell.slow_since is not None else now
    measured = [
        (reading.slowness, standby)
        for standby in standbys
        if (reading := canaries.get(standby.id)) is not None
        and reading.pid == standby.pid
        and reading.at >= slow_since
        and reading.slowness is not None
    ]
    best, standby = min(measured, key=lambda pair: pair[0], default=(None, None))
    if best is None:  # no standby measured since it looked slow (the caller asks them)
        return None, SlowSpell(primary.id, slow_since, None, spell.last_switch)
    if ratio < policy.factor * best:  # a standby about as slow: the host's slowdown, the spell starts again
        return None, SlowSpell(primary.id, now, None, spell.last_switch)
    since = spell.since if same and spell.since is not None else now
    spell = SlowSpell(primary.id, slow_since, since, spell.last_switch)
    if now - slow_since < policy.for_s or policy.too_soon(spell.last_switch, now):
        return None, spell
    reason = (
        f"its decode steps have taken {ratio:.1f}x their best for {now - slow_since:.1f} s, {ratio / best:.1f}x what "
        f"standby {standby.id}'s canary took (switching at {policy.factor:g}x for {policy.for_s:g} s)"
    )
    return SwitchAway(primary, standby, reason), replace(spell, last_switch=now)


@dataclass(frozen=True)
class CanaryVerdict:
    """``judge_canaries``' answer: the agreed answer per fingerprint after this round, the engines whose answer is
    wrong (id -> reason), and the fingerprints whose answer was set or changed this round."""

    agreed: dict[str, Answer]
    wrong: dict[str, str]
    established: tuple[str, ...]


def judge_canaries(readings: Sequence[CanaryReading], agreed: Mapping[str, Answer]) -> CanaryVerdict:
    """The canary round's verdict (module docstring) from each engine's latest ``readings``."""
    after, wrong, established = dict(agreed), {}, []
    for fingerprint in sorted({r.fingerprint for r in readings}):
        mine = [r for r in readings if r.fingerprint == fingerprint]
        top, count = Counter(r.tokens for r in mine).most_common(1)[0]
        majority = count * 2 > len(mine) and (count >= 2 or fingerprint not in after)
        if majority and after.get(fingerprint) != top:
            after[fingerprint] = top
            established.append(fingerprint)
        answer = after.get(fingerprint)
        if answer is None or all(r.tokens != answer for r in mine):
            continue  # no answer yet, or the agreed one is the odd one out: nothing to judge by
        for r in mine:
            if r.tokens != answer:
                wrong[r.member] = f"answered the canary {list(r.tokens)}, not {list(answer)} as the others agree"
    return CanaryVerdict(after, wrong, tuple(established))


GRAY_KINDS = (EventKind.DEGRADED, EventKind.WRONG_OUTPUT, EventKind.GPU_FAULT, EventKind.GPU_SLOWDOWN)


def last_gray_failure(events: Sequence[Mapping[str, Any]], group: int) -> str | None:
    """The group's newest gray failure event (``GRAY_KINDS``) as ``hotweights status`` shows it: whom it is about
    (a GPU's about its device); None without."""
    mine = [e for e in events if e["kind"] in GRAY_KINDS and e.get(EventField.GROUP) == group]
    if not mine:
        return None
    event = max(mine, key=lambda e: e["seq"])
    who = event.get(EventField.DEVICE) or event.get(EventField.MEMBER)
    return f"{event['kind']} {who} at {event['time']}: {event.get(EventField.REASON) or event['message']}"
