"""GPU health in the controller: every GPU a group uses read through NVML every LOOK_S, its faults and hardware
slowdowns told, and acted on as ``controller.gpudecide`` decides.

``controller.graywatch`` owns the ``GpuWatch`` and runs its looks beside the canaries. At each look:

- a group whose GPU is faulty (``gpudecide.fault_verdict``) gets the event ``gpu_fault`` (again whenever what is
  wrong changes), ``hotweights_controller_gray_failures{kind="gpu_fault"}`` and an error line; at the fault's onset
  the group's arena is verified as after a wrong canary answer; a primary the verdict fences is in ``fenced``, which
  the loop's ``wrong_output`` policy reads, so it is failed over from as a wrong one is;
- a group whose primary's GPU the hardware slowed for ``health.degraded_for_s`` gets the event ``gpu_slowdown`` once
  per spell, with what is done: the planned switchover itself is ``slowed``'s, asked by the loop beside the canaries'
  slow primaries, under the same rate bound;
- ``hotweights_controller_gpu_unhealthy{device, kind}`` is 1 while a GPU is faulty or slowed.

Where NVML cannot be read (no GPU group, no driver, no ``cuda`` extra) nothing is looked at: one warning line says
why (none for a cluster of CPU groups only), and GPU faults show only as the engines' own failures.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry, Counter, Gauge

from hotweights.controller.config import ClusterConfig
from hotweights.controller.events import EventLog
from hotweights.controller.gpudecide import (
    FaultVerdict,
    GpuState,
    fault_verdict,
    look,
    member_gpus,
    slowed_primary,
)
from hotweights.controller.graydecide import DegradePolicy, SwitchAway
from hotweights.controller.nvmlread import Nvml, NvmlUnavailable, open_nvml
from hotweights.controller.snapshot import MemberView, Snapshot
from hotweights.eventkinds import EventKind

log = logging.getLogger(__name__)

LOOK_S = 1.0  # NVML read this often: a slowdown is judged over degraded_for_s (2 s) of looks

Key = tuple[str, int]  # an engine's id and pid


class GpuWatch:
    def __init__(
        self,
        config: ClusterConfig,
        events: EventLog,
        registry: CollectorRegistry,
        failures: Counter,
        policy: DegradePolicy,
    ) -> None:
        self.events = events
        self.failures = failures  # graywatch's hotweights_controller_gray_failures
        self.policy = policy
        self.group_gpus = {g: gpus for g, spec in enumerate(config.groups) if (gpus := member_gpus(spec))}
        self.reader: Nvml | None = None
        self.thread: ThreadPoolExecutor | None = None  # every NVML call, one after another (close after a read)
        self.states: dict[str, GpuState] = {}  # by GPU (cuda:N)
        self.fenced: dict[Key, str] = {}  # primaries to fence for their GPU's fault -> why
        self.faults: dict[int, str] = {}  # per group: the fault last told
        self.slowdowns: dict[int, float] = {}  # per group: the start of the slowdown spell last told
        self.unhealthy = Gauge(
            "hotweights_controller_gpu_unhealthy",
            "1 while NVML reports a GPU faulty (kind gpu_fault: a critical Xid, uncorrectable ECC errors, a row "
            "remap) or slowed by its hardware for health.degraded_for_s (kind gpu_slowdown)",
            ["device", "kind"],
            registry=registry,
        )

    async def open(self) -> bool:
        """NVML opened for every GPU a group uses, off the event loop (NVML's start blocks on the driver, seconds
        on a host of many GPUs); False (said once, in one line) where it cannot be."""
        devices = sorted({gpu for gpus in self.group_gpus.values() for gpu in gpus})
        if not devices:
            return False
        thread = ThreadPoolExecutor(1, thread_name_prefix="nvml")
        try:
            self.reader = await asyncio.get_running_loop().run_in_executor(thread, open_nvml, devices, os.environ)
        except NvmlUnavailable as exc:
            thread.shutdown(wait=False)
            log.warning("NVML health is unavailable: %s; GPU faults show only as the engines' own failures", exc)
            return False
        self.thread = thread
        log.info("NVML health: reading %s every %g s", self.reader.describe(), LOOK_S)
        return True

    def close(self) -> None:
        """NVML ended once a read in progress (its caller cancelled) has finished."""
        if self.reader is not None and self.thread is not None:
            self.thread.submit(self.reader.close)
            self.thread.shutdown(wait=False)
        self.reader = self.thread = None

    async def read(self, now: float) -> None:
        """One look at every GPU (off the event loop: NVML blocks), added to what is known of each."""
        assert self.reader is not None and self.thread is not None, "read() before a successful open()"
        readings = await asyncio.get_running_loop().run_in_executor(self.thread, self.reader.read)
        for gpu, reading in readings.items():
            state = self.states[gpu] = look(self.states.get(gpu, GpuState()), reading, now)
            self.unhealthy.labels(gpu, EventKind.GPU_FAULT).set(state.fault is not None)
            self.unhealthy.labels(gpu, EventKind.GPU_SLOWDOWN).set(bool(state.slowdown))

    def judge(self, snap: Snapshot, last_switch: Mapping[int, float | None], now: float) -> list[MemberView]:
        """Each group's verdicts told and kept (module docstring); the engines whose group's arena to verify now (a
        fault's onset). ``last_switch``: each group's last switchover for slowness."""
        alive = {(m.id, m.pid) for m in snap.members if m.alive}
        self.fenced = {key: why for key, why in self.fenced.items() if key in alive}
        verify = []
        for group, gpus in self.group_gpus.items():
            members = snap.group(group)
            primary = next((p for p in snap.primaries(group) if p.alive), None)
            standbys = [m for m in members if m.is_ready_standby]
            gpus_of = {m.id: gpus for m in members}
            verdict = fault_verdict(primary, standbys, gpus, gpus_of, self.states)
            if self.tell_fault(group, gpus, primary, verdict) and (subject := primary or next(iter(members), None)):
                verify.append(subject)
            _, slowdown = slowed_primary(primary, standbys, gpus_of, self.states, last_switch.get(group), now,
                                         self.policy)  # fmt: skip
            self.tell_slowdown(group, gpus, primary, slowdown)
        return verify

    def slowed(
        self, primary: MemberView | None, standbys: list[MemberView], last_switch: float | None, now: float
    ) -> SwitchAway | None:
        """The planned switchover away from ``primary`` whose GPU the hardware slowed (``gpudecide.slowed_primary``),
        if one is due now; None for a group on no GPU, or while NVML is not read."""
        gpus = self.group_gpus.get(primary.group, ()) if primary is not None else ()
        if not gpus or self.reader is None:
            return None
        gpus_of = {m.id: gpus for m in (primary, *standbys) if m is not None}
        switch, _ = slowed_primary(primary, standbys, gpus_of, self.states, last_switch, now, self.policy)
        return switch

    def tell_fault(
        self, group: int, gpus: tuple[str, ...], primary: MemberView | None, verdict: FaultVerdict | None
    ) -> bool:
        """``verdict`` recorded when it differs from the last told, its primary to fence kept; True at a fault's
        onset (the group had none)."""
        if verdict is None:
            self.faults.pop(group, None)
            return False
        if verdict.fence is not None:
            self.fenced[(verdict.fence.id, verdict.fence.pid or 0)] = f"its GPU is faulty ({verdict.reason})"
        onset, told = group not in self.faults, self.faults.get(group)
        if told == verdict.reason:
            return False
        self.faults[group] = verdict.reason
        faulty = ", ".join(gpu for gpu in gpus if self.states.get(gpu, GpuState()).fault is not None)
        log.error("group %d's GPU is faulty: %s", group, verdict.reason)
        self.events.record(
            EventKind.GPU_FAULT, f"group {group}'s GPU is faulty: {verdict.reason}", group=group, device=faulty,
            reason=verdict.reason, **({"member": primary.id} if primary is not None else {}),
        )  # fmt: skip
        self.failures.labels(str(group), EventKind.GPU_FAULT).inc()
        return onset

    def tell_slowdown(self, group: int, gpus: tuple[str, ...], primary: MemberView | None, what: str | None) -> None:
        """A slowdown spell of the group's primary's GPU recorded once, when it has lasted ``degraded_for_s``."""
        starts = [s.slow_since for gpu in gpus if (s := self.states.get(gpu)) and s.slow_since is not None]
        if what is None or primary is None or not starts:
            self.slowdowns.pop(group, None)
            return
        if self.slowdowns.get(group) == min(starts):
            return
        self.slowdowns[group] = min(starts)
        slowed = ", ".join(gpu for gpu in gpus if self.states.get(gpu, GpuState()).slowdown)
        log.warning("group %d's GPU is slowed by its hardware: %s", group, what)
        self.events.record(
            EventKind.GPU_SLOWDOWN, f"group {group}'s GPU is slowed by its hardware: {what}", group=group,
            device=slowed, member=primary.id, reason=what,
        )  # fmt: skip
        self.failures.labels(str(group), EventKind.GPU_SLOWDOWN).inc()
