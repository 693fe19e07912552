"""NVML read for the controller's GPU health (``controller.gpuwatch``): per GPU a group uses, its critical Xid errors,
volatile uncorrectable ECC count, pending or failed row remaps and clock event reasons (``gpudecide.GpuReading``).

Through ``cuda.bindings.nvml`` (the ``cuda`` extra's cuda-bindings, 12.9.6 or 13.2 on), which loads the driver's
``libnvidia-ml.so.1`` at ``init_v2``: the controller reads NVML only, it never makes a CUDA context. ``open_nvml``
raises ``NvmlUnavailable`` with one line where NVML cannot be read (no module, no driver, a GPU that cannot be
told), the caller's cue to do without. A value a GPU does not report (ECC off, no row remapper) is None, said once
per GPU; a GPU NVML has lost is a reading of its own (``lost``).

Which GPU is ``cuda:N``: CUDA numbers the GPUs that CUDA_VISIBLE_DEVICES lists (every one when it is unset) in
CUDA_DEVICE_ORDER: by PCI bus id, or (its default, FASTEST_FIRST) the fastest first, which among GPUs of one model
is the PCI bus order again. NVML sees every GPU, whatever CUDA_VISIBLE_DEVICES says. So an index among the visible
entries picks the GPU of that rank by PCI bus id, a UUID (or a prefix of one, as CUDA allows) the GPU of that UUID;
GPUs of several models in FASTEST_FIRST order, and MIG instances, are refused (the mapping would be a guess). The
controller's environment is read: its engines inherit it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hotweights.controller.gpudecide import GpuReading

log = logging.getLogger(__name__)

# nvml.h's values, part of its ABI (the bindings' enum names have changed between releases; these have not).
XID_CRITICAL_ERROR = 0x8  # nvmlEventTypeXidCriticalError: an Xid error, its number in the event's data
MEMORY_ERROR_UNCORRECTED = 1  # NVML_MEMORY_ERROR_TYPE_UNCORRECTED
VOLATILE_ECC = 0  # NVML_VOLATILE_ECC: counted since the driver loaded
FEATURE_ENABLED = 1  # NVML_FEATURE_ENABLED: a page retirement is pending
MIG_ENABLE = 1  # NVML_DEVICE_MIG_ENABLE
MAX_EVENTS = 256  # the Xid events taken in one read at most; the rest wait for the next
INSTALL_HINT = "pip install 'hotweights[cuda]'"
USED = (  # what this module calls of cuda.bindings.nvml, checked at the start: an older release may lack some
    "init_v2", "shutdown", "device_get_count_v2", "device_get_handle_by_index_v2", "device_get_mig_mode",
    "device_get_pci_info_v3", "device_get_uuid", "device_get_name", "event_set_create", "event_set_free",
    "device_register_events", "event_set_wait_v2", "device_get_remapped_rows",
    "device_get_retired_pages_pending_status", "device_get_total_ecc_errors",
    "device_get_current_clocks_event_reasons", "NvmlError", "NotSupportedError", "GpuIsLostError", "TimeoutError",
)  # fmt: skip


class NvmlUnavailable(Exception):
    """NVML cannot be read here; the message says why, in one line."""


@dataclass(frozen=True)
class NvmlGpu:
    """A GPU as NVML enumerates it."""

    handle: int
    uuid: str  # "GPU-" and its UUID
    bus_id: str  # its PCI bus id, "00000000:3B:00.0"
    name: str  # its model
    mig: bool = False  # MIG is on: CUDA numbers its instances, not the GPU


def cuda_to_nvml(devices: Sequence[str], env: Mapping[str, str], gpus: Sequence[NvmlGpu]) -> dict[str, NvmlGpu]:
    """The GPU behind each of ``devices`` (``cuda:N``) for processes started with ``env`` (module docstring);
    ``NvmlUnavailable`` names the device that cannot be told."""
    by_bus = sorted(gpus, key=lambda gpu: gpu.bus_id.upper())
    if mig := [gpu.uuid for gpu in gpus if gpu.mig]:
        raise NvmlUnavailable(f"MIG is on for {', '.join(mig)}: CUDA numbers MIG instances, whole GPUs only are read")
    order, models = env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST"), sorted({gpu.name for gpu in gpus})
    if order != "PCI_BUS_ID" and len(models) > 1:
        raise NvmlUnavailable(
            f"GPUs of several models ({', '.join(models)}) in CUDA_DEVICE_ORDER {order}: which is cuda:N cannot "
            "be told; set CUDA_DEVICE_ORDER=PCI_BUS_ID for the controller and its engines"
        )
    visible = env.get("CUDA_VISIBLE_DEVICES")
    entries = [str(i) for i in range(len(by_bus))] if visible is None else [e.strip() for e in visible.split(",")]
    found = {}
    for device in devices:
        index = int(device.removeprefix("cuda:"))
        if index >= len(entries):
            seen = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "this host"
            raise NvmlUnavailable(f"{device}: {seen} has {len(entries)} GPU(s)")
        found[device] = _visible(device, entries[index], by_bus)
    return found


def _visible(device: str, entry: str, by_bus: Sequence[NvmlGpu]) -> NvmlGpu:
    """The GPU CUDA_VISIBLE_DEVICES' ``entry`` names, of ``by_bus`` (NVML's GPUs by PCI bus id)."""
    if entry.isdigit() and int(entry) < len(by_bus):
        return by_bus[int(entry)]
    matches = [gpu for gpu in by_bus if entry.startswith("GPU-") and gpu.uuid.startswith(entry)]
    if len(matches) == 1:
        return matches[0]
    raise NvmlUnavailable(
        f"{device} is CUDA_VISIBLE_DEVICES' {entry!r}, which names no single GPU NVML sees (expected an index "
        f"below {len(by_bus)} or a GPU UUID; MIG instances are not read)"
    )


def open_nvml(devices: Sequence[str], env: Mapping[str, str]) -> Nvml:
    """NVML started, ``devices`` (``cuda:N``) found among its GPUs and their Xid events registered; raises
    ``NvmlUnavailable`` (module docstring)."""
    try:
        from cuda.bindings import nvml
    except ImportError as exc:
        raise NvmlUnavailable(
            f"cuda-bindings' NVML module is missing ({exc}); install it with: {INSTALL_HINT}"
        ) from exc
    if missing := [name for name in USED if not hasattr(nvml, name)]:
        raise NvmlUnavailable(
            f"cuda-bindings' NVML module has no {', '.join(missing)}; install it with: {INSTALL_HINT}"
        )
    try:
        nvml.init_v2()
    except (OSError, RuntimeError, nvml.NvmlError) as exc:  # the driver's library is missing: RuntimeError
        raise NvmlUnavailable(f"NVML does not start: {first_line(exc)}") from exc
    try:
        gpus = [_gpu(nvml, index) for index in range(nvml.device_get_count_v2())]
        return Nvml(nvml, cuda_to_nvml(devices, env, gpus))
    except (nvml.NvmlError, NvmlUnavailable) as exc:
        nvml.shutdown()
        raise NvmlUnavailable(first_line(exc)) from exc


def _gpu(nvml: Any, index: int) -> NvmlGpu:
    handle = nvml.device_get_handle_by_index_v2(index)
    try:
        mig = nvml.device_get_mig_mode(handle)[0] == MIG_ENABLE
    except nvml.NotSupportedError:  # before Ampere
        mig = False
    bus_id = nvml.device_get_pci_info_v3(handle).bus_id
    return NvmlGpu(handle, nvml.device_get_uuid(handle), bus_id, nvml.device_get_name(handle), mig)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


class Nvml:
    """NVML, started, and the GPUs to read (``open_nvml``). ``read`` blocks on the driver for milliseconds: the
    caller runs it off its event loop, one read at a time; ``close`` ends it."""

    def __init__(self, nvml: Any, gpus: Mapping[str, NvmlGpu]) -> None:
        self.nvml = nvml
        self.gpus = dict(gpus)  # by device, cuda:N
        self.by_uuid = {gpu.uuid: device for device, gpu in self.gpus.items()}
        self.said: set[tuple[str, str]] = set()  # (device, what) whose failure was logged
        self.events = nvml.event_set_create()
        for device, gpu in self.gpus.items():
            try:
                nvml.device_register_events(gpu.handle, XID_CRITICAL_ERROR, self.events)
            except nvml.NvmlError as exc:
                self._once(device, "Xid errors", exc)

    def describe(self) -> str:
        return ", ".join(f"{device} ({gpu.name} {gpu.uuid})" for device, gpu in self.gpus.items())

    def read(self) -> dict[str, GpuReading]:
        """A reading of every GPU, by device; its ``xids`` are the Xid errors reported since the last read."""
        xids = self._xids()
        return {
            device: self._read(device, gpu.handle, tuple(xids.get(device, ()))) for device, gpu in self.gpus.items()
        }

    def close(self) -> None:
        self.nvml.event_set_free(self.events)
        self.nvml.shutdown()

    def _read(self, device: str, handle: int, xids: tuple[int, ...]) -> GpuReading:
        nvml = self.nvml
        try:
            pending, failed = self._remaps(device, handle)
            ecc = self._value(device, "uncorrectable ECC errors", nvml.device_get_total_ecc_errors, handle,
                              MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC)  # fmt: skip
            reasons = self._value(device, "clock event reasons", nvml.device_get_current_clocks_event_reasons, handle)
        except nvml.GpuIsLostError:
            return GpuReading(xids=xids, lost=True)
        return GpuReading(
            ecc_uncorrected=ecc, remap_pending=pending, remap_failed=failed, clock_reasons=reasons, xids=xids
        )

    def _remaps(self, device: str, handle: int) -> tuple[bool | None, bool | None]:
        """(a remap pending, a remap failed) from the row remapper (Ampere on), else the pages pending retirement
        (before Ampere: no failure told)."""
        try:
            _, _, pending, failed = self.nvml.device_get_remapped_rows(handle)
            return bool(pending), bool(failed)
        except self.nvml.NotSupportedError:
            pass
        except self.nvml.GpuIsLostError:
            raise
        except self.nvml.NvmlError as exc:
            self._once(device, "row remaps", exc)
            return None, None
        retiring = self._value(device, "pages pending retirement", self.nvml.device_get_retired_pages_pending_status,
                               handle)  # fmt: skip
        return (None if retiring is None else retiring == FEATURE_ENABLED), None

    def _value(self, device: str, what: str, call: Callable[..., int], *args: int) -> int | None:
        """``call(*args)``, None (said once) when the GPU does not report it; a lost GPU raises."""
        try:
            return int(call(*args))
        except self.nvml.GpuIsLostError:
            raise
        except self.nvml.NvmlError as exc:
            self._once(device, what, exc)
            return None

    def _xids(self) -> dict[str, list[int]]:
        """The Xid errors waiting in the event set, by device."""
        found: dict[str, list[int]] = {}
        for _ in range(MAX_EVENTS):
            try:
                event = self.nvml.event_set_wait_v2(self.events, 0)
            except self.nvml.TimeoutError:  # NVML_ERROR_TIMEOUT: none waits
                break
            except self.nvml.NvmlError as exc:
                self._once("every GPU", "Xid errors", exc)
                break
            device = self._device_of(event.device_)
            if event.event_type & XID_CRITICAL_ERROR and device is not None:
                found.setdefault(device, []).append(int(event.event_data))
        return found

    def _device_of(self, handle: int) -> str | None:
        device = next((d for d, gpu in self.gpus.items() if gpu.handle == handle), None)
        if device is not None:
            return device
        try:
            return self.by_uuid.get(self.nvml.device_get_uuid(handle))
        except self.nvml.NvmlError:
            return None

    def _once(self, device: str, what: str, exc: BaseException) -> None:
        if (device, what) not in self.said:
            self.said.add((device, what))
            unsupported = isinstance(exc, self.nvml.NotSupportedError)
            (log.info if unsupported else log.warning)("NVML gives no %s of %s: %s", what, device, first_line(exc))
