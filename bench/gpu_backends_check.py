"""Check the CUDA arena backends across real processes, quickly, outside pytest.

    python bench/gpu_backends_check.py [--backends cuda-vmm,cuda-ipc] [--strict]

For each backend: a child maps a 64 MiB arena and sees the parent's bytes; a child maps a 1 GiB arena (timed);
the parent keeps reading an arena whose exporting child was SIGKILLed; an import on the wrong device is
refused; a cuda-vmm importer that asks the driver for read-write access (as a hostile engine could) writes the
arena or not (reported as ``vmm_importer_can_write``, a fact, not a pass condition). Prints a table, then, as
the last line, one JSON object. Exits 1 when a check fails (with --strict also when a backend is unavailable),
never hangs: children are daemonic, every wait has a timeout, and a watchdog ends the run.

tests/test_cuda_backends.py runs these same checks under pytest: keep the check functions' results (dicts
with "ok") and the helpers it imports (fill, digest, cuda_ready) stable.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import multiprocessing as mp
import os
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from hotweights.cache.backends import get_backend
from hotweights.cache.backends.base import BackendUnavailable, ExportedArena

MiB = 1 << 20
TIMEOUT_S = 120.0
WATCHDOG_S = 540.0  # under a 10-minute device command limit
IMPORT_LIMIT_MS = 250.0  # loose bound on mapping 1 GiB; the design's target is < 50 ms


def fill(t: torch.Tensor, seed: int) -> None:
    """Random bytes: a misplaced or stale mapping cannot match them by accident."""
    t.random_(generator=torch.Generator(device=t.device).manual_seed(seed))
    torch.cuda.synchronize(t.device)


def digest(t: torch.Tensor) -> str:
    """sha256 of the bytes (copied to CPU) up to 256 MiB; of per-MiB int64 sums (computed on the GPU) beyond."""
    torch.cuda.synchronize(t.device)
    if t.numel() <= 256 * MiB:
        return hashlib.sha256(t.cpu().numpy()).hexdigest()
    return hashlib.sha256(t.view(-1, MiB).sum(dim=1, dtype=torch.int64).cpu().numpy()).hexdigest()


def cuda_ready(index: int) -> torch.device:
    """Set the device and create its context now, so that timings do not include it."""
    torch.cuda.set_device(index)
    torch.zeros(1, device="cuda").sum().item()
    return torch.device("cuda", index)


def _recv(conn: Connection, timeout: float = TIMEOUT_S) -> Any:
    """One message, or fail instead of hanging; a child's traceback is re-raised here."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no message from the child within {timeout} s")
    msg = conn.recv()
    if isinstance(msg, dict) and "error" in msg:
        raise RuntimeError(f"child failed:\n{msg['error']}")
    return msg


def _send_arena(conn: Connection, sock: socket.socket, handle: dict[str, Any], fds: list[int]) -> None:
    """The handle as JSON text through the Pipe, the fds (maybe none) through the socket, as the daemon will."""
    conn.send(json.dumps(handle))
    socket.send_fds(sock, [b"F"], fds)


def _recv_arena(conn: Connection, sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    handle = json.loads(_recv(conn))
    sock.settimeout(TIMEOUT_S)
    _, fds, _, _ = socket.recv_fds(sock, 16, 8)
    return handle, fds


def _warm_up(name: str) -> float:
    """Load what a backend loads once per process (cuda-bindings and libcuda for cuda-vmm), so that the
    timed import is the per-arena map cost; returns the one-time cost in ms, which an engine pays once."""
    t0 = time.perf_counter()
    get_backend(name)
    if name == "cuda-vmm":
        from hotweights.cache.backends.cuda_vmm import _driver

        _driver()
    return (time.perf_counter() - t0) * 1e3


def _import_child(name: str, index: int, conn: Connection, sock: socket.socket) -> None:
    """Spawned: import what we are sent; report digest, import time and whether the mapping is read-only."""
    try:
        device = cuda_ready(index)
        handle, fds = _recv_arena(conn, sock)
        warmup_ms = _warm_up(name)
        t0 = time.perf_counter()
        arena = get_backend(name).import_arena(handle, fds, device)
        torch.cuda.synchronize()
        import_ms = (time.perf_counter() - t0) * 1e3
        read_only = getattr(arena, "read_only", None)
        conn.send(
            {"digest": digest(arena.tensor), "import_ms": import_ms, "warmup_ms": warmup_ms, "read_only": read_only}
        )
        conn.recv()
        arena.close()
    except Exception:
        conn.send({"error": traceback.format_exc()})


def _export_child(name: str, index: int, nbytes: int, conn: Connection, sock: socket.socket) -> None:
    """Spawned: allocate, fill and send an arena and its digest, then wait to be killed."""
    try:
        arena = get_backend(name).allocate(nbytes, cuda_ready(index))
        fill(arena.tensor, seed=1)
        handle, fds = arena.export()
        _send_arena(conn, sock, handle, fds)
        conn.send({"digest": digest(arena.tensor)})
        conn.recv()
    except Exception:
        conn.send({"error": traceback.format_exc()})


@contextmanager
def _spawn(
    target: Callable[..., None], *args: Any
) -> Iterator[tuple[mp.process.BaseProcess, Connection, socket.socket]]:
    """A daemonic spawned child with a Pipe and a Unix socketpair end; killed and joined on the way out."""
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = ctx.Process(target=target, args=(*args, child_conn, child_sock), daemon=True)
    try:
        proc.start()
        child_conn.close()
        child_sock.close()
        yield proc, conn, sock
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(timeout=30)
        conn.close()
        sock.close()


def _to_child(name: str, arena: ExportedArena, index: int) -> dict[str, Any]:
    with _spawn(_import_child, name, index) as (_, conn, sock):
        handle, fds = arena.export()
        _send_arena(conn, sock, handle, fds)
        report = _recv(conn)
        conn.send("exit")
        return report


def check_roundtrip(name: str, device: torch.device, nbytes: int, seed: int) -> dict[str, Any]:
    """Parent fills, a child imports: same bytes?"""
    arena = get_backend(name).allocate(nbytes, device)
    try:
        fill(arena.tensor, seed)
        report = _to_child(name, arena, device.index)
        return {**report, "ok": report["digest"] == digest(arena.tensor)}
    finally:
        arena.close()


def _write_child(name: str, index: int, conn: Connection, sock: socket.socket) -> None:
    """Spawned: import what we are sent and try to overwrite it; report whether the kernel ran clean."""
    try:
        device = cuda_ready(index)
        handle, fds = _recv_arena(conn, sock)
        arena = get_backend(name).import_arena(handle, fds, device)
        conn.send({"read_only": getattr(arena, "read_only", None)})
        arena.tensor.fill_(0)
        torch.cuda.synchronize()
        conn.send({"wrote": True})
    except Exception as exc:  # an illegal-address error poisons this context: report and leave
        conn.send({"wrote": False, "refusal": str(exc)[:300]})


def check_write_refused(name: str, device: torch.device) -> dict[str, Any]:
    """A child imports the parent's arena and writes zeros over it: do the parent's bytes survive?"""
    arena = get_backend(name).allocate(2 * MiB, device)
    try:
        fill(arena.tensor, seed=3)
        before = digest(arena.tensor)
        with _spawn(_write_child, name, device.index) as (proc, conn, sock):
            handle, fds = arena.export()
            _send_arena(conn, sock, handle, fds)
            read_only = _recv(conn)["read_only"]
            try:
                outcome = _recv(conn)
            except (EOFError, TimeoutError):
                outcome = {"wrote": False, "refusal": "the child died or hung while writing"}
            proc.join(timeout=TIMEOUT_S)
        unchanged = digest(arena.tensor) == before
        return {"read_only": read_only, **outcome, "unchanged": unchanged, "ok": unchanged and not outcome["wrote"]}
    finally:
        arena.close()


def _forced_write_child(index: int, conn: Connection, sock: socket.socket) -> None:
    """Spawned: import a cuda-vmm fd as a hostile engine would, asking the driver for PROT_READWRITE, and write."""
    from hotweights.cache.backends import cuda_vmm

    try:
        cuda_ready(index)
        handle, (fd,) = _recv_arena(conn, sock)
        drv = cuda_vmm._driver()
        posix_fd = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        with cuda_vmm._on_device(drv, index):
            alloc = cuda_vmm._check(drv.cuMemImportFromShareableHandle(fd, posix_fd), "import")
            mapping, read_only = cuda_vmm._map(drv, index, alloc, handle["nbytes"], read_only=False)
        mapping.tensor().fill_(0)
        torch.cuda.synchronize()
        conn.send({"granted_read_write": not read_only})
    except Exception as exc:  # the driver refused: what a read-only guarantee would look like
        conn.send({"granted_read_write": False, "refusal": str(exc)[:300]})


def check_forced_write(device: torch.device) -> dict[str, Any]:
    """Does a cuda-vmm importer that asks for read-write get it, and do its writes reach the arena? (A fact to
    report, not a pass condition: docs/operations.md's trust model rests on it.)"""
    arena = get_backend("cuda-vmm").allocate(2 * MiB, device)
    try:
        fill(arena.tensor, seed=4)
        before = digest(arena.tensor)
        with _spawn(_forced_write_child, device.index) as (proc, conn, sock):
            handle, fds = arena.export()
            _send_arena(conn, sock, handle, fds)
            outcome = _recv(conn)
            proc.join(timeout=TIMEOUT_S)
        return {**outcome, "importer_can_write": digest(arena.tensor) != before, "ok": True}
    finally:
        arena.close()


def check_import_time(name: str, device: torch.device) -> dict[str, Any]:
    """A 1 GiB arena: same bytes in the child, and mapped within IMPORT_LIMIT_MS?"""
    res = check_roundtrip(name, device, 1 << 30, seed=2)
    return {**res, "ok": res["ok"] and res["import_ms"] < IMPORT_LIMIT_MS}


def check_sigkill(name: str, device: torch.device) -> dict[str, Any]:
    """A child exports, the parent imports, the child is SIGKILLed: still the same bytes, still computable?"""
    with _spawn(_export_child, name, device.index, 64 * MiB) as (proc, conn, sock):
        handle, fds = _recv_arena(conn, sock)
        imported = get_backend(name).import_arena(handle, fds, device)
        expected = _recv(conn)["digest"]
        before = digest(imported.tensor) == expected
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)
        time.sleep(0.5)
        after = digest(imported.tensor) == expected
        m = imported.tensor[: 2048 * 2048].view(2048, 2048).float()
        finite = bool(torch.isfinite(m @ m).all().item())
        del m
        imported.close()
        return {"ok": before and after and finite and not proc.is_alive(), "before": before, "after": after}


def check_wrong_device(name: str, device: torch.device) -> dict[str, Any]:
    """Importing on another device index must raise ValueError (and close the fds it was given)."""
    arena = get_backend(name).allocate(2 * MiB, device)
    try:
        handle, fds = arena.export()
        try:
            get_backend(name).import_arena(handle, [os.dup(fd) for fd in fds], torch.device("cuda", device.index + 1))
        except ValueError as e:
            return {"ok": True, "error": str(e)}
        return {"ok": False, "error": "no ValueError"}
    finally:
        arena.close()


def run_backend(name: str, device: torch.device, rows: list[tuple[str, str, bool, str]]) -> dict[str, Any]:
    """Every check for one backend; a check that raises is a failed row, not a crash."""
    results: dict[str, Any] = {}
    checks: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("roundtrip 64 MiB", lambda: check_roundtrip(name, device, 64 * MiB, seed=0)),
        ("import 1 GiB", lambda: check_import_time(name, device)),
        ("survives SIGKILL", lambda: check_sigkill(name, device)),
        ("wrong device refused", lambda: check_wrong_device(name, device)),
    ]
    if name == "cuda-vmm":
        checks.append(("forced read-write", lambda: check_forced_write(device)))
    for label, check in checks:
        t0 = time.perf_counter()
        try:
            res = check()
        except Exception as e:
            traceback.print_exc()
            res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        detail = {k: v for k, v in res.items() if k not in ("ok", "digest")}
        for key in ("import_ms", "warmup_ms"):
            if key in detail:
                detail[key] = round(detail[key], 3)
        detail["wall_s"] = round(time.perf_counter() - t0, 2)
        rows.append((name, label, res["ok"], json.dumps(detail)[:110]))
        results[label] = res
    return results


def _available(name: str) -> str | None:
    """None if ``name`` can run here, else why not."""
    try:
        if name == "cuda-vmm":
            import cuda.bindings.driver  # noqa: F401
        get_backend(name)
    except (ImportError, BackendUnavailable) as e:
        return str(e)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="cuda-vmm,cuda-ipc")
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--strict", action="store_true", help="fail when a backend is unavailable")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device"}))
        return 1
    device = cuda_ready(args.device)
    rows: list[tuple[str, str, bool, str]] = []
    results: dict[str, dict[str, Any]] = {}
    for name in args.backends.split(","):
        why = _available(name)
        if why is not None:
            rows.append((name, "available", not args.strict, why[:110]))
            continue
        results[name] = run_backend(name, device, rows)
    print(f"\n{'backend':<10} {'check':<22} {'ok':<5} detail")
    for name, label, ok, detail in rows:
        print(f"{name:<10} {label:<22} {'yes' if ok else 'NO':<5} {detail}")
    summary = _summary(results)
    summary["torch"] = torch.__version__
    summary["gpu"] = torch.cuda.get_device_name(args.device)
    summary["all_ok"] = all(ok for _, _, ok, _ in rows)
    print(json.dumps(summary))
    return 0 if summary["all_ok"] else 1


def _summary(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    def ms(name: str, key: str = "import_ms") -> float | None:
        value = results.get(name, {}).get("import 1 GiB", {}).get(key)
        return None if value is None else round(value, 3)

    return {
        "cuda_vmm_import_ms_1gib": ms("cuda-vmm"),
        "cuda_ipc_import_ms_1gib": ms("cuda-ipc"),
        "cuda_vmm_warmup_ms_once_per_process": ms("cuda-vmm", "warmup_ms"),
        "vmm_read_only": results.get("cuda-vmm", {}).get("roundtrip 64 MiB", {}).get("read_only"),
        "survives_sigkill": {name: bool(r.get("survives SIGKILL", {}).get("ok")) for name, r in results.items()},
        "roundtrip_ok": {name: bool(r.get("roundtrip 64 MiB", {}).get("ok")) for name, r in results.items()},
        "vmm_importer_can_write": results.get("cuda-vmm", {}).get("forced read-write", {}).get("importer_can_write"),
        "wrong_device_refused": {
            name: bool(r.get("wrong device refused", {}).get("ok")) for name, r in results.items()
        },
    }


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # never wait on a stray child or CUDA teardown at interpreter exit
