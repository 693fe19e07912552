"""Pure: a GPU's health as NVML reports it, and what a group does about it.

``controller.nvmlread`` reads each GPU a group uses (``GpuReading``); ``look`` adds each reading to what is known of
that GPU (``GpuState``); ``controller.gpuwatch`` carries the decisions out. ``tests/test_gpudecide.py`` tables them.

- **Fault**: a critical Xid error (``CRITICAL_XIDS``: the hardware's, never an application's, such as the Xid 45 that
  every killed CUDA process leaves), a rise of the volatile uncorrectable ECC count since the first look, a memory
  row (a page, before Ampere) waiting for a reset to be remapped (retired) or a remap that failed, or a GPU NVML has
  lost. The GPU's memory, the weight arena included, can no longer be trusted: ``fault_verdict`` fences the group's
  primary, as a wrong canary answer does, but only where every ready standby of the group is on GPUs free of faults
  (so whichever the loop promotes is sound), and the arena is verified. Where a standby shares the faulty GPU (on one
  host every engine of a group does: a group is one device, or one set of devices for tensor parallelism) nothing is
  fenced: the engine that would replace the primary starts on the same GPU, to be fenced in turn, a flap that serves
  nobody. The fault is then told (event, metric, ``hotweights status``), and the GPU's reset or the host's drain is
  the operator's.
- **Slowdown**: a clock event reason that means the hardware slowed the GPU (``Slowdown``: HW slowdown, thermal,
  power brake; never a software power cap or idling, the GPU working as configured), active at every look for
  ``degraded_for_s``: ``slowed_primary`` switches the group over (planned, nothing fenced) to a ready standby on GPUs
  neither slowed nor faulty, at most once every ``degraded_every_s``, the bound the canaries' slow primaries share.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntFlag

from hotweights.controller.config import GroupSection
from hotweights.controller.graydecide import DegradePolicy, SwitchAway, slowness_of
from hotweights.controller.snapshot import MemberView

# The Xid errors that mean the GPU itself failed (NVIDIA's Xid catalog). Others, an application's page fault or
# its process killed (Xid 13, 31, 43, 45), happen on sound GPUs and are not counted.
CRITICAL_XIDS: Mapping[int, str] = {
    48: "a double-bit ECC error",
    62: "an internal micro-controller halt",
    64: "a row remap or page retirement that could not be recorded",
    74: "an NVLink error",
    79: "the GPU fell off the bus",
    94: "a contained ECC error",
    95: "an uncontained ECC error",
    119: "a GSP RPC timeout",
    120: "a GSP error",
    140: "an unrecovered ECC error",
}


class Slowdown(IntFlag):
    """The clock event reasons (nvml.h's ``nvmlClocksEventReason*`` bits) that mean the hardware slowed the GPU."""

    HW_SLOWDOWN = 0x8
    SW_THERMAL = 0x20  # the driver's thermal slowdown: the GPU is too hot
    HW_THERMAL = 0x40
    HW_POWER_BRAKE = 0x80  # the board's power brake, asserted from outside (the power supply)


ANY_SLOWDOWN = Slowdown(sum(Slowdown))  # every bit above
NO_SLOWDOWN = Slowdown(0)

SLOWDOWN_NAMES: Mapping[Slowdown, str] = {
    Slowdown.HW_SLOWDOWN: "HW slowdown",
    Slowdown.SW_THERMAL: "thermal slowdown",
    Slowdown.HW_THERMAL: "HW thermal slowdown",
    Slowdown.HW_POWER_BRAKE: "HW power brake",
}


@dataclass(frozen=True)
class GpuReading:
    """One look at a GPU through NVML. None: the GPU does not report it (not supported, ECC off, a failed read);
    ``lost``: NVML says the GPU is lost (fallen off the bus), and reports nothing else of it."""

    ecc_uncorrected: int | None = None  # volatile uncorrectable ECC errors, counted since the driver loaded
    remap_pending: bool | None = None  # a memory row (page) waits for a reset to be remapped (retired)
    remap_failed: bool | None = None  # a row remap has failed
    clock_reasons: int | None = None  # the clock event reasons bitmask
    xids: tuple[int, ...] = ()  # the Xid errors reported since the previous look
    lost: bool = False


@dataclass(frozen=True)
class GpuState:
    """What the looks at a GPU add up to: its faults (``fault``) and the hardware slowdown active now, since
    ``slow_since`` (``time.monotonic()``) at every look."""

    ecc_base: int | None = None  # the uncorrectable ECC count at the first look (or since the driver reset it)
    ecc_rise: int = 0
    xids: tuple[int, ...] = ()  # the critical Xids seen since the first look, each once
    remap_pending: bool = False
    remap_failed: bool = False
    lost: bool = False
    slowdown: Slowdown = NO_SLOWDOWN
    slow_since: float | None = None

    @property
    def fault(self) -> str | None:
        """Why the GPU is faulty, None when it is not."""
        clauses = [
            "NVML has lost it" if self.lost else "",
            ", ".join(f"critical Xid {xid} ({CRITICAL_XIDS[xid]})" for xid in self.xids),
            f"{self.ecc_rise} uncorrectable ECC error(s) since it was first read" if self.ecc_rise else "",
            "a memory row remap waits for a GPU reset" if self.remap_pending else "",
            "a memory row remap failed" if self.remap_failed else "",
        ]
        return "; ".join(c for c in clauses if c) or None

    def slowed_for(self, now: float) -> float:
        """How long the hardware has slowed it at every look (0: it does not now)."""
        return 0.0 if self.slow_since is None else now - self.slow_since

    def slowdown_names(self) -> str:
        return ", ".join(name for flag, name in SLOWDOWN_NAMES.items() if flag in self.slowdown)


def look(state: GpuState, reading: GpuReading, now: float) -> GpuState:
    """``state`` after ``reading``, taken at ``now``. A value the GPU did not report keeps what was known of it; an
    ECC count below the first one means the driver reloaded (volatile counts start again): counted from there."""
    base, rise = state.ecc_base, state.ecc_rise
    if reading.ecc_uncorrected is not None:
        if base is None or reading.ecc_uncorrected < base:
            base = reading.ecc_uncorrected
        rise = reading.ecc_uncorrected - base
    seen = set(state.xids)
    xids = state.xids + tuple(dict.fromkeys(x for x in reading.xids if x in CRITICAL_XIDS and x not in seen))
    slowdown = Slowdown((reading.clock_reasons or 0) & ANY_SLOWDOWN)
    since = (state.slow_since if state.slow_since is not None else now) if slowdown else None
    return GpuState(
        ecc_base=base,
        ecc_rise=rise,
        xids=xids,
        remap_pending=state.remap_pending if reading.remap_pending is None else reading.remap_pending,
        remap_failed=state.remap_failed if reading.remap_failed is None else reading.remap_failed,
        lost=reading.lost,
        slowdown=slowdown,
        slow_since=since,
    )


def member_gpus(group: GroupSection) -> tuple[str, ...]:
    """The GPUs an engine of ``group`` uses, one per rank (``GroupSection.rank_device``); none on the CPU."""
    return tuple(group.rank_device(rank) for rank in range(group.tp_size)) if group.device != "cpu" else ()


def faults_of(gpus: Sequence[str], states: Mapping[str, GpuState]) -> str | None:
    """The faults of ``gpus``, each named by its GPU; None when none has one (or none was read)."""
    faults = [f"{gpu}: {fault}" for gpu in gpus if (fault := states.get(gpu, GpuState()).fault) is not None]
    return "; ".join(faults) or None


@dataclass(frozen=True)
class FaultVerdict:
    """A group on a faulty GPU: ``fence``, its primary to fence (None: nothing fenced), and ``reason``, what is wrong
    and what is done, for the event and ``hotweights status``."""

    fence: MemberView | None
    reason: str


def fault_verdict(
    primary: MemberView | None,
    standbys: Sequence[MemberView],
    group_gpus: Sequence[str],
    gpus_of: Mapping[str, Sequence[str]],
    states: Mapping[str, GpuState],
) -> FaultVerdict | None:
    """The group's verdict (module docstring) when one of ``group_gpus`` is faulty, else None. ``standbys``: its
    ready standbys; ``gpus_of``: each engine's GPUs by id."""
    faults = faults_of(group_gpus, states)
    if faults is None:
        return None
    if primary is None or faults_of(gpus_of.get(primary.id, ()), states) is None:
        return FaultVerdict(None, f"{faults}; nothing fenced: no primary on it")
    if not standbys:
        return FaultVerdict(None, f"{faults}; primary {primary.id} not fenced: no ready standby")
    shared = [s.id for s in standbys if faults_of(gpus_of.get(s.id, ()), states) is not None]
    if shared:
        why = f"standby {', '.join(shared)} would take over on a faulty GPU"
        return FaultVerdict(None, f"{faults}; primary {primary.id} not fenced: {why}")
    return FaultVerdict(primary, f"{faults}; primary {primary.id} fenced: its standbys are on GPUs free of faults")


def slowed_primary(
    primary: MemberView | None,
    standbys: Sequence[MemberView],
    gpus_of: Mapping[str, Sequence[str]],
    states: Mapping[str, GpuState],
    last_switch: float | None,
    now: float,
    policy: DegradePolicy,
) -> tuple[SwitchAway | None, str | None]:
    """The planned switchover away from a primary on a GPU the hardware slowed for ``policy.for_s`` (module
    docstring), and a sentence of what is wrong and what is done; (None, None) while no such slowdown lasted that
    long. ``last_switch``: the group's last switchover for slowness (``SlowSpell.last_switch``)."""
    if primary is None or not primary.is_serving_primary:
        return None, None
    mine = {gpu: states.get(gpu, GpuState()) for gpu in gpus_of.get(primary.id, ())}
    slowed = {gpu: state for gpu, state in mine.items() if state.slowed_for(now) >= policy.for_s}
    if not slowed:
        return None, None
    what = "; ".join(f"{gpu}: {s.slowdown_names()} for {s.slowed_for(now):.1f} s" for gpu, s in slowed.items())
    sound = [s for s in standbys if all(_sound(states.get(gpu, GpuState())) for gpu in gpus_of.get(s.id, ()))]
    if not sound:
        return None, f"{what}; nothing switched: no ready standby on GPUs neither slowed nor faulty"
    if last_switch is not None and policy.too_soon(last_switch, now):
        ago = f"the group switched over {now - last_switch:.0f} s ago (at most once every {policy.every_s:g} s)"
        return None, f"{what}; nothing switched: {ago}"
    new = min(sound, key=lambda m: (m.health.consecutive_failures, slowness_of(m) or 1.0, m.id))
    return SwitchAway(primary, new, f"its GPU is slowed ({what})"), f"{what}; switching over to {new.id}"


def _sound(state: GpuState) -> bool:
    return state.fault is None and not state.slowdown
