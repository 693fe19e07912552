"""The fused elementwise kernels (``standby.fusedkernels``) against the plain torch functions of ``standby.fused``.

``mismatches(device)`` runs every case and returns what differed beyond its dtype's tolerance, and any RMSNorm row
whose bits change with the rows computed beside it. The CPU tests run it as a script with a Python that has Triton,
under Triton's interpreter (``python tests/fusedhelpers.py cpu`` with ``TRITON_INTERPRET=1``: one JSON list on
stdout); the CUDA tests call it on the GPU, and run ``python tests/fusedhelpers.py probe OUT`` in fresh processes:
each kernel's first call timed, the outputs saved to OUT.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable

import torch

from hotweights.standby import fused
from hotweights.standby.kvpool import BLOCK_SIZE
from hotweights.standby.model import rope_tables

ROWS = (1, 3, 64)
HIDDEN = (64, 200, 5120)  # a power of two, neither, wider than a norm tile
SILU_WIDTHS = (64, 1000, 2752)  # gate (and up) columns: within one block, several, a partial last one
HEAD_DIMS = (64, 128)
HEADS, KV_HEADS = 4, 2
TOLERANCES = {  # dtype -> (atol, rtol) against the plain function in that dtype (which rounds between its steps)
    torch.float32: (2e-5, 2e-5),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3.2e-2, 1.6e-2),
}
EPS = 1e-6
Case = tuple[str, tuple[torch.Tensor, ...], Callable[..., object]]  # name, arguments, the plain function


def _pairs(sizes: tuple[int, ...], turn: int) -> list[tuple[int, int]]:
    """Each row count with one of ``sizes``, the pairing shifted by ``turn`` (a dtype's index), so that every row count
    meets every size across the dtypes (the interpreter takes milliseconds a program on a loaded CPU)."""
    return [(rows, sizes[(i + turn) % len(sizes)]) for i, rows in enumerate(ROWS)]


def _norm_cases(device: str, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    cases = []
    for rows, hidden in _pairs(HIDDEN, list(TOLERANCES).index(dtype)):
        x, delta = (torch.randn((rows, hidden), generator=g).to(device, dtype) for _ in range(2))
        weight = torch.randn(hidden, generator=g).to(device, dtype)
        name = f"{rows}x{hidden}"
        cases.append((f"rms_norm {name}", (x, weight, EPS), fused.rms_norm))
        cases.append((f"add_rms_norm {name}", (x, delta, weight, EPS), fused.add_rms_norm))
    return cases


def _rope_cases(device: str, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    """Decode's layout (the q and k heads of a fused qkv projection, (B, nh + nkv, hd), cos (B, 1, hd)) at 1 and 5
    rows, and prefill's ((B, T, nh + nkv, hd), cos (T, 1, hd))."""
    cases = []
    heads = HEADS + KV_HEADS
    for hd in HEAD_DIMS:
        for rows in (1, 5):
            qkv = torch.randn((rows, (heads + KV_HEADS) * hd), generator=g).to(device, dtype)
            positions = torch.randint(0, 4096, (rows,), generator=g).to(device)
            cos, sin = rope_tables(positions, hd, 10000.0, dtype)
            x = qkv[:, : heads * hd].view(rows, heads, hd)
            cases.append((f"rope decode {rows}x{hd}", (x, cos[:, None], sin[:, None]), fused.rope))
        B, T = 2, 3
        qkv = torch.randn((B, T, (heads + KV_HEADS) * hd), generator=g).to(device, dtype)
        cos, sin = rope_tables(torch.arange(7, 7 + T, device=device), hd, 10000.0, dtype)
        x = qkv[..., : heads * hd].view(B, T, heads, hd)
        cases.append((f"rope prefill {B}x{T}x{hd}", (x, cos[:, None], sin[:, None]), fused.rope))
    return cases


def _silu_cases(device: str, dtype: torch.dtype, g: torch.Generator) -> list[Case]:
    return [
        (f"silu_mul {rows}x{width}", (torch.randn((rows, 2 * width), generator=g).to(device, dtype),), fused.silu_mul)
        for rows, width in _pairs(SILU_WIDTHS, list(TOLERANCES).index(dtype))
    ]


def cases(device: str) -> list[tuple[torch.dtype, Case]]:
    """Every kernel's cases in every dtype, seeded."""
    g = torch.Generator().manual_seed(0)
    return [
        (dtype, case)
        for dtype in TOLERANCES
        for make in (_norm_cases, _rope_cases, _silu_cases)
        for case in make(device, dtype, g)
    ]


def kernel(plain: Callable[..., object]) -> Callable[..., object]:
    """The kernel's wrapper (``standby.fusedkernels``) that ``plain`` runs within ``fusing()`` on CUDA; Triton is
    imported here, on first use (this module is imported where it is not installed)."""
    from hotweights.standby import fusedkernels

    kernels = (fusedkernels.rms_norm, fusedkernels.add_rms_norm, fusedkernels.rope, fusedkernels.silu_mul)
    return dict(zip((fused.rms_norm, fused.add_rms_norm, fused.rope, fused.silu_mul), kernels, strict=True))[plain]


def _outputs(result: object) -> tuple[torch.Tensor, ...]:
    return result if isinstance(result, tuple) else (result,)


def _differences(dtype: torch.dtype, case: Case) -> list[str]:
    name, args, plain = case
    atol, rtol = TOLERANCES[dtype]
    found = []
    for got, want in zip(_outputs(kernel(plain)(*args)), _outputs(plain(*args)), strict=True):
        if got.shape != want.shape or got.dtype != want.dtype:
            found.append(f"{name}, {dtype}: {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}")
        elif not torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol):
            worst = (got.float() - want.float()).abs().max().item()
            found.append(f"{name}, {dtype}: differs from plain torch by up to {worst:.3g}")
    return found


def _batch_dependence(device: str) -> list[str]:
    """RMSNorm's rows (alone, with and without the residual add) bitwise as in a batch of 16, in bfloat16."""
    g = torch.Generator().manual_seed(1)
    found = []
    for hidden in HIDDEN[1:]:
        x, delta = (torch.randn((16, hidden), generator=g).to(device, torch.bfloat16) for _ in range(2))
        weight = torch.randn(hidden, generator=g).to(device, torch.bfloat16)
        norm, add_norm = kernel(fused.rms_norm), kernel(fused.add_rms_norm)
        batch = norm(x, weight, EPS), add_norm(x, delta, weight, EPS)[1]
        for rows in (slice(5, 6), slice(0, 3)):
            alone = norm(x[rows], weight, EPS), add_norm(x[rows], delta[rows], weight, EPS)[1]
            for what, whole, part in zip(("rms_norm", "add_rms_norm"), batch, alone, strict=True):
                if not torch.equal(whole[rows], part):
                    found.append(f"{what} {hidden}: rows {rows.start}..{rows.stop - 1} differ computed apart")
    return found


def _rope_store_differences(device: str) -> list[str]:
    """``rope_store`` (decode's q, and k and v written into paged blocks at each row's position) at 1 and 5 rows in
    every dtype: q and the whole blocks after the write, kernel against plain torch, each on its own copy of them."""
    from hotweights.standby import fusedkernels
    from hotweights.standby.model import slots

    g = torch.Generator().manual_seed(2)
    found = []
    for dtype, (atol, rtol) in TOLERANCES.items():
        for hd, rows in zip(HEAD_DIMS, (1, 5), strict=True):
            qkv = torch.randn((rows, (HEADS + 2 * KV_HEADS) * hd), generator=g).to(device, dtype)
            positions = torch.randperm(6 * BLOCK_SIZE, generator=g)[:rows].to(device)  # distinct positions of 6 blocks
            table = torch.randperm(6, generator=g).to(device, torch.int32).expand(rows, 6)
            cos, sin = rope_tables(positions, hd, 10000.0, dtype)
            at = slots(table, positions[:, None])
            blocks = torch.randn((2, 6, BLOCK_SIZE, KV_HEADS, hd), generator=g).to(device, dtype)
            got, want = blocks.clone(), blocks.clone()
            args = (cos[:, None], sin[:, None])
            outputs = (
                (fusedkernels.rope_store(qkv, HEADS, *args, got[0], got[1], at=at), got),
                (fused.rope_store(qkv, HEADS, *args, want[0], want[1], at), want),
            )
            for what, kernel_out, plain_out in zip(("q", "blocks"), *outputs, strict=True):
                if not torch.allclose(kernel_out.float(), plain_out.float(), atol=atol, rtol=rtol):
                    worst = (kernel_out.float() - plain_out.float()).abs().max().item()
                    found.append(
                        f"rope_store {rows}x{hd}, {dtype}: {what} differs from plain torch by up to {worst:.3g}"
                    )
    return found


def mismatches(device: str) -> list[str]:
    """Every case's differences beyond tolerance (``rope_store``'s too), and every RMSNorm row whose bits depend on
    its batch."""
    found = [d for dtype, case in cases(device) for d in _differences(dtype, case)]
    return found + _rope_store_differences(device) + _batch_dependence(device)


def probe(out: str) -> None:
    """The bfloat16 cases run as an engine's decode graphs run them (``standby.fused``'s functions within
    ``fusing()``), the outputs saved to ``out`` (safetensors); on stdout ``{"import_s": s, "first_call_s": {name:
    s}}``: the kernels' import, then each kernel's first call in this process, timed to its end."""
    from safetensors.torch import save_file

    torch.zeros(1, device="cuda")  # the CUDA context, not a kernel's first call
    started = time.perf_counter()
    kernel(fused.rms_norm)  # Triton's import and its key of itself: once per process (``standby.fusedkernels``)
    imported = round(time.perf_counter() - started, 4)
    timings, outputs = {}, {}
    for dtype, (name, args, function) in cases("cuda"):
        if dtype != torch.bfloat16:
            continue
        started = time.perf_counter()
        with fused.fusing():
            result = _outputs(function(*args))
        torch.cuda.synchronize()
        timings.setdefault(function.__name__, round(time.perf_counter() - started, 4))
        outputs |= {f"{name} {i}": t.contiguous() for i, t in enumerate(result)}
    save_file(outputs, out)
    print(json.dumps({"import_s": imported, "first_call_s": timings}))


if __name__ == "__main__":
    if sys.argv[1] == "probe":
        probe(sys.argv[2])
    else:
        print(json.dumps(mismatches(sys.argv[1])))
