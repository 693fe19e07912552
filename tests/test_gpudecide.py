"""GPU health's decisions with no GPU (``controller.gpudecide``) and the device mapping NVML health reads by
(``controller.nvmlread.cuda_to_nvml``): each row a situation and what the controller must make of it. Then the NVML
reader itself on this machine: where no driver is installed it says so in one line; on a GPU it reads every value."""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from hotweights.controller.config import ClusterConfig, GroupSection
from hotweights.controller.events import EventLog
from hotweights.controller.gpudecide import (
    FaultVerdict,
    GpuReading,
    GpuState,
    Slowdown,
    fault_verdict,
    look,
    member_gpus,
    slowed_primary,
)
from hotweights.controller.gpuwatch import GpuWatch
from hotweights.controller.graydecide import DegradePolicy, last_gray_failure
from hotweights.controller.health import HealthRecord
from hotweights.controller.nvmlread import NvmlGpu, NvmlUnavailable, cuda_to_nvml, open_nvml
from hotweights.controller.snapshot import MemberView, Snapshot
from hotweights.eventkinds import EventKind

unit = pytest.mark.unit
NOW = 1000.0
POLICY = DegradePolicy(factor=4.0, for_s=2.0, every_s=300.0)
HW_THERMAL, SW_POWER_CAP, IDLE = 0x40, 0x4, 0x1  # nvml.h clock event reasons
DRIVER = Path("/proc/driver/nvidia").exists()


def member(index: int, role: str = "standby", state: str = "ready") -> MemberView:
    fields: dict[str, object] = dict(
        id=f"g0-e{index}", group=0, port=8200 + index, device="cuda:0", url=f"http://127.0.0.1:{8200 + index}",
        role=role, state=state, status="healthy", pid=100 + index, alive=True, exit_reason=None, exited_at=None,
        exiting_at=None, age_s=10.0, start_timeout_s=120.0, health=HealthRecord(ok=True, ever_ok=True, body={}),
    )  # fmt: skip
    return MemberView(**fields)  # type: ignore[arg-type]


SOUND = GpuState(ecc_base=0)
ECC = GpuState(ecc_base=0, ecc_rise=2)
HOT = GpuState(ecc_base=0, slowdown=Slowdown.HW_THERMAL, slow_since=NOW - 3.0)
PRIMARY, S1, S2 = member(0, "primary"), member(1), member(2)


@unit
@pytest.mark.parametrize(
    ("before", "reading", "fault", "slow_since"),
    [
        pytest.param(GpuState(), GpuReading(ecc_uncorrected=5), None, None, id="first look: the ECC count is a base"),
        pytest.param(
            GpuState(ecc_base=5),
            GpuReading(ecc_uncorrected=7),
            "2 uncorrectable ECC error(s) since it was first read",
            None,
            id="uncorrectable ECC errors rose",
        ),
        pytest.param(GpuState(ecc_base=5), GpuReading(ecc_uncorrected=1), None, None, id="driver reloaded: rebased"),
        pytest.param(
            GpuState(ecc_base=5, ecc_rise=1),
            GpuReading(),
            "1 uncorrectable ECC error(s) since it was first read",
            None,
            id="ECC unread: what was known stays",
        ),
        pytest.param(GpuState(), GpuReading(xids=(13, 31, 43, 45)), None, None, id="applications' Xids: not faults"),
        pytest.param(
            GpuState(xids=(79,)),
            GpuReading(xids=(79, 45)),
            "critical Xid 79 (the GPU fell off the bus)",
            None,
            id="a critical Xid, counted once",
        ),
        pytest.param(
            GpuState(),
            GpuReading(remap_pending=True),
            "a memory row remap waits for a GPU reset",
            None,
            id="a row remap pending",
        ),
        pytest.param(
            GpuState(remap_pending=True),
            GpuReading(),
            "a memory row remap waits for a GPU reset",
            None,
            id="remaps unread: still pending",
        ),
        pytest.param(GpuState(remap_pending=True), GpuReading(remap_pending=False), None, None, id="remapped"),
        pytest.param(GpuState(), GpuReading(remap_failed=True), "a memory row remap failed", None, id="remap failed"),
        pytest.param(GpuState(), GpuReading(lost=True), "NVML has lost it", None, id="lost"),
        pytest.param(GpuState(), GpuReading(clock_reasons=SW_POWER_CAP | IDLE), None, None, id="power cap: not slow"),
        pytest.param(GpuState(), GpuReading(clock_reasons=HW_THERMAL), None, NOW, id="a HW slowdown starts"),
        pytest.param(HOT, GpuReading(clock_reasons=HW_THERMAL | SW_POWER_CAP), None, NOW - 3.0, id="and goes on"),
        pytest.param(HOT, GpuReading(clock_reasons=SW_POWER_CAP), None, None, id="and ends"),
        pytest.param(HOT, GpuReading(), None, None, id="reasons unread: no slowdown"),
    ],
)
def test_each_look_adds_to_what_is_known_of_the_gpu(
    before: GpuState, reading: GpuReading, fault: str | None, slow_since: float | None
) -> None:
    after = look(before, reading, NOW)
    assert (after.fault, after.slow_since) == (fault, slow_since)


@unit
def test_every_fault_is_named_and_the_slowdowns_by_their_hardware_reason() -> None:
    state = look(GpuState(ecc_base=0), GpuReading(ecc_uncorrected=1, xids=(95,), clock_reasons=0x8 | 0x80), NOW)
    assert (
        state.fault
        == "critical Xid 95 (an uncontained ECC error); 1 uncorrectable ECC error(s) since it was first read"
    )
    assert state.slowdown_names() == "HW slowdown, HW power brake"


@unit
@pytest.mark.parametrize(
    ("device", "tp_size", "gpus"),
    [("cpu", 1, ()), ("cuda:3", 1, ("cuda:3",)), ("cuda:0", 2, ("cuda:0", "cuda:1"))],
)
def test_an_engine_uses_its_groups_device_or_one_gpu_per_rank(device: str, tp_size: int, gpus: tuple) -> None:
    assert member_gpus(GroupSection(device=device, tp_size=tp_size)) == gpus


ONE_GPU = {"g0-e0": ("cuda:0",), "g0-e1": ("cuda:0",), "g0-e2": ("cuda:0",)}
APART = {"g0-e0": ("cuda:0",), "g0-e1": ("cuda:1",), "g0-e2": ("cuda:2",)}
FAULT = "cuda:0: 2 uncorrectable ECC error(s) since it was first read"
FAULT2 = FAULT.replace("cuda:0", "cuda:2")


@unit
@pytest.mark.parametrize(
    ("states", "primary", "standbys", "gpus_of", "verdict"),
    [
        pytest.param({"cuda:0": SOUND}, PRIMARY, (S1, S2), ONE_GPU, None, id="sound"),
        pytest.param(
            {"cuda:0": ECC},
            PRIMARY,
            (S1, S2),
            ONE_GPU,
            FaultVerdict(
                None, f"{FAULT}; primary g0-e0 not fenced: standby g0-e1, g0-e2 would take over on a faulty GPU"
            ),
            id="one GPU for the group: told, nothing fenced (no flap)",
        ),
        pytest.param(
            {"cuda:0": ECC},
            PRIMARY,
            (S1, S2),
            APART,
            FaultVerdict(PRIMARY, f"{FAULT}; primary g0-e0 fenced: its standbys are on GPUs free of faults"),
            id="its standbys on sound GPUs: fenced",
        ),
        pytest.param(
            {"cuda:0": ECC, "cuda:2": ECC},
            PRIMARY,
            (S1, S2),
            APART,
            FaultVerdict(
                None,
                f"{FAULT}; {FAULT2}; primary g0-e0 not fenced: standby g0-e2 would take over on a faulty GPU",
            ),
            id="a standby on a faulty GPU too: the loop might promote it",
        ),
        pytest.param(
            {"cuda:0": ECC},
            PRIMARY,
            (),
            APART,
            FaultVerdict(None, f"{FAULT}; primary g0-e0 not fenced: no ready standby"),
            id="no ready standby",
        ),
        pytest.param(
            {"cuda:0": ECC},
            None,
            (S1,),
            ONE_GPU,
            FaultVerdict(None, f"{FAULT}; nothing fenced: no primary on it"),
            id="no primary",
        ),
    ],
)
def test_a_primary_on_a_faulty_gpu_is_fenced_only_where_a_standby_takes_over_on_a_sound_one(
    states: dict, primary: MemberView | None, standbys: tuple, gpus_of: dict, verdict: FaultVerdict | None
) -> None:
    assert fault_verdict(primary, standbys, ("cuda:0", "cuda:1", "cuda:2"), gpus_of, states) == verdict


SLOWED = "cuda:0: HW thermal slowdown for 3.0 s"


@unit
@pytest.mark.parametrize(
    ("states", "primary", "gpus_of", "last_switch", "switch_to", "sentence"),
    [
        pytest.param({"cuda:0": SOUND}, PRIMARY, APART, None, None, None, id="not slowed"),
        pytest.param(
            {"cuda:0": replace(HOT, slow_since=NOW - 1.0)}, PRIMARY, APART, None, None, None, id="not for long enough"
        ),
        pytest.param(
            {"cuda:0": HOT}, member(0, "primary", "draining"), APART, None, None, None, id="not a serving primary"
        ),
        pytest.param(
            {"cuda:0": HOT},
            PRIMARY,
            ONE_GPU,
            None,
            None,
            f"{SLOWED}; nothing switched: no ready standby on GPUs neither slowed nor faulty",
            id="one GPU for the group: told, nothing switched",
        ),
        pytest.param(
            {"cuda:0": HOT},
            PRIMARY,
            APART,
            None,
            "g0-e1",
            f"{SLOWED}; switching over to g0-e1",
            id="a standby on a sound GPU: switched over",
        ),
        pytest.param(
            {"cuda:0": HOT, "cuda:1": HOT},
            PRIMARY,
            APART,
            None,
            "g0-e2",
            f"{SLOWED}; switching over to g0-e2",
            id="not to a standby on a slowed GPU",
        ),
        pytest.param(
            {"cuda:0": HOT, "cuda:1": ECC, "cuda:2": HOT},
            PRIMARY,
            APART,
            None,
            None,
            f"{SLOWED}; nothing switched: no ready standby on GPUs neither slowed nor faulty",
            id="nor to one on a faulty GPU",
        ),
        pytest.param(
            {"cuda:0": HOT},
            PRIMARY,
            APART,
            NOW - 100.0,
            None,
            f"{SLOWED}; nothing switched: the group switched over 100 s ago (at most once every 300 s)",
            id="rate-bounded as the canaries' slow primaries",
        ),
    ],
)
def test_a_primary_on_a_gpu_its_hardware_slowed_is_switched_over_to_a_sound_gpu(
    states: dict,
    primary: MemberView,
    gpus_of: dict,
    last_switch: float | None,
    switch_to: str | None,
    sentence: str | None,
) -> None:
    switch, said = slowed_primary(primary, (S1, S2), gpus_of, states, last_switch, NOW, POLICY)
    assert (switch.new.id if switch else None, said) == (switch_to, sentence)
    if switch is not None:
        assert switch.old is primary and switch.reason == f"its GPU is slowed ({SLOWED})"


def gpu(index: int, bus: str, name: str = "NVIDIA H100 80GB HBM3", mig: bool = False) -> NvmlGpu:
    return NvmlGpu(index, f"GPU-{index}{index}aaaaaa-0000", f"00000000:{bus}:00.0", name, mig)


# NVML enumerates in an order of its own; CUDA numbers by PCI bus id (or fastest first, the same for one model).
GPUS = (gpu(0, "C1"), gpu(1, "1B"), gpu(2, "4F"))


@unit
@pytest.mark.parametrize(
    ("env", "gpus", "found"),
    [
        pytest.param({}, GPUS, {"cuda:0": 1, "cuda:1": 2}, id="every GPU visible: by PCI bus id"),
        pytest.param({"CUDA_VISIBLE_DEVICES": "2,0"}, GPUS, {"cuda:0": 0, "cuda:1": 1}, id="visible indices"),
        pytest.param({"CUDA_VISIBLE_DEVICES": "GPU-00a, GPU-22"}, GPUS, {"cuda:0": 0, "cuda:1": 2}, id="UUID prefixes"),
        pytest.param(
            {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"},
            (gpu(0, "C1", "A100"), gpu(1, "1B")),
            {"cuda:0": 1, "cuda:1": 0},
            id="two models in PCI bus order",
        ),
        pytest.param(
            {},
            (gpu(0, "C1", "A100"), gpu(1, "1B")),
            "GPUs of several models (A100, NVIDIA H100 80GB HBM3) in CUDA_DEVICE_ORDER FASTEST_FIRST",
            id="two models fastest first: cannot be told",
        ),
        pytest.param({"CUDA_VISIBLE_DEVICES": "1"}, GPUS, "cuda:1: CUDA_VISIBLE_DEVICES='1' has 1 GPU(s)", id="hidden"),
        pytest.param(
            {"CUDA_VISIBLE_DEVICES": "GPU-,0"},
            GPUS,
            "cuda:0 is CUDA_VISIBLE_DEVICES' 'GPU-', which names no single",
            id="an ambiguous UUID prefix",
        ),
        pytest.param(
            {"CUDA_VISIBLE_DEVICES": "MIG-abc,0"}, GPUS, "cuda:0 is CUDA_VISIBLE_DEVICES' 'MIG-abc'", id="MIG entry"
        ),
        pytest.param({}, (*GPUS[:2], gpu(2, "4F", mig=True)), "MIG is on for GPU-22aaaaaa-0000", id="MIG on"),
    ],
)
def test_cuda_n_is_the_gpu_cuda_numbers_so(env: dict, gpus: tuple, found: dict | str) -> None:
    if isinstance(found, str):
        with pytest.raises(NvmlUnavailable) as refused:
            cuda_to_nvml(("cuda:0", "cuda:1"), env, gpus)
        assert str(refused.value).startswith(found) and "\n" not in str(refused.value)
    else:
        mapped = cuda_to_nvml(("cuda:0", "cuda:1"), env, gpus)
        assert {device: g.handle for device, g in mapped.items()} == found


@unit
def test_status_names_a_gpus_fault_by_its_device() -> None:
    events = [
        {"seq": 1, "kind": "degraded", "group": 0, "member": "g0-e0", "time": "T1", "reason": "slow", "message": "m"},
        {
            "seq": 2,
            "kind": "gpu_fault",
            "group": 0,
            "member": "g0-e0",
            "device": "cuda:0",
            "time": "T2",
            "reason": FAULT,
            "message": "m",
        },
    ]
    assert last_gray_failure(events, 0) == f"gpu_fault cuda:0 at T2: {FAULT}"


def watch(device: str) -> GpuWatch:
    registry = CollectorRegistry()
    failures = Counter("gray_failures", "as graywatch's", ["group", "kind"], registry=registry)
    config = ClusterConfig(groups=(GroupSection(device=device),))
    return GpuWatch(config, EventLog(None), registry, failures, POLICY)


def test_a_gpu_fault_is_told_when_it_changes_and_a_slowdown_once_a_spell() -> None:
    """``GpuWatch.judge`` with states as NVML's looks leave them: events, the arena to verify at a fault's onset,
    nothing fenced on a group's one GPU."""
    gpus, snap = watch("cuda:0"), Snapshot(NOW, 1, (PRIMARY, S1, S2), ())
    told = lambda kind: [e for e in gpus.events.events if e["kind"] == kind]  # noqa: E731
    for states, verify in (
        ({"cuda:0": ECC}, [PRIMARY]),
        ({"cuda:0": ECC}, []),
        ({"cuda:0": replace(ECC, ecc_rise=3)}, []),
    ):
        gpus.states = states
        assert gpus.judge(snap, {}, NOW) == verify
    faults = told(EventKind.GPU_FAULT)
    assert [(e["device"], e["member"], e["reason"].split(";")[0]) for e in faults] == [
        ("cuda:0", "g0-e0", FAULT),
        ("cuda:0", "g0-e0", FAULT.replace("2", "3")),
    ]
    assert gpus.fenced == {} and "not fenced" in faults[-1]["reason"]
    for states, verify in (({"cuda:0": HOT}, []), ({"cuda:0": HOT}, []), ({"cuda:0": ECC}, [PRIMARY])):
        gpus.states = states
        assert gpus.judge(snap, {}, NOW) == verify
    assert [e["reason"] for e in told(EventKind.GPU_SLOWDOWN)] == [
        f"{SLOWED}; nothing switched: no ready standby on GPUs neither slowed nor faulty"
    ]
    assert len(told(EventKind.GPU_FAULT)) == 3  # the fault again after it had cleared


@pytest.mark.skipif(DRIVER, reason="an NVIDIA driver is installed")
def test_without_a_driver_nvml_health_is_unavailable_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(NvmlUnavailable) as refused:
        open_nvml(("cuda:0",), os.environ)
    assert "\n" not in str(refused.value) and "Traceback" not in str(refused.value)
    gpus = watch("cuda:0")
    with caplog.at_level(logging.INFO, logger="hotweights.controller"):
        assert asyncio.run(gpus.open()) is False
        assert asyncio.run(watch("cpu").open()) is False  # no GPU group: nothing to say
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("NVML health is unavailable: "), lines
    assert gpus.slowed(PRIMARY, [S1], None, NOW) is None


@pytest.mark.cuda
@pytest.mark.skipif(not DRIVER, reason="needs an NVIDIA driver")
def test_on_a_gpu_nvml_reads_every_value_of_the_gpu_cuda_0_is() -> None:
    import torch

    reader = open_nvml(("cuda:0",), os.environ)
    try:
        assert reader.gpus["cuda:0"].uuid == f"GPU-{torch.cuda.get_device_properties(0).uuid}"
        state = GpuState()
        for _ in range(2):
            reading = reader.read()["cuda:0"]
            state = look(state, reading, NOW)
        print(f"\n{reader.describe()}: {reading}, fault {state.fault}, slowdown {state.slowdown_names() or 'none'}")
        assert not reading.lost and reading.clock_reasons is not None
        assert reading.ecc_uncorrected is None or reading.ecc_uncorrected >= 0
        assert reading.remap_pending in (True, False, None) and all(isinstance(x, int) for x in reading.xids)
    finally:
        reader.close()
