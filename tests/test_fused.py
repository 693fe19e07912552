"""The fused elementwise steps (``standby.fused``) on CPU: plain torch outside a CUDA graph's capture, and their Triton
kernels (``standby.fusedkernels``) under Triton's interpreter, in the Python of the SGLang venv (the only one here
with Triton; skipped without it unless ``HOTWEIGHTS_REQUIRE_SGLANG=1``). ``tests/test_engine_cuda.py`` runs the same
cases on a GPU, and a later process's first call of each kernel."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hotweights.standby import fused
from tests.cachehelpers import ENV, engine_python

HELPERS = Path(__file__).with_name("fusedhelpers.py")
# Within fusing(), on CPU tensors: the plain functions, and neither the kernels' module nor Triton imported.
CPU_FUSING = """
import sys, torch
from hotweights.standby import fused
x = torch.randn(3, 8)
with fused.fusing():
    got = fused.rms_norm(x, torch.ones(8), 1e-6), fused.rope(x, x, x), fused.silu_mul(x)
assert torch.equal(got[2], torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
print(sorted(m for m in ("triton", "hotweights.standby.fusedkernels") if m in sys.modules))
"""


def test_fusing_on_cpu_runs_plain_torch_without_importing_triton() -> None:
    checked = subprocess.run([sys.executable, "-c", CPU_FUSING], env=ENV, capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert checked.stdout.split() == ["[]"]


@pytest.mark.sglang
def test_the_kernels_compute_the_plain_functions_under_the_triton_interpreter() -> None:
    """RMSNorm with and without the residual add at 1, 3 and 64 rows of 64, 200 and 5120, RoPE in decode's and
    prefill's layouts, SwiGLU at 64, 1000 and 2752 columns, in float32, float16 and bfloat16: within the dtype's
    tolerance of plain torch, and RMSNorm's rows bitwise the same alone as in a batch."""
    python = engine_python("SGLang", "Triton")
    env = ENV | {"TRITON_INTERPRET": "1"}
    checked = subprocess.run([python, str(HELPERS), "cpu"], env=env, capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert json.loads(checked.stdout.splitlines()[-1]) == []


@pytest.mark.parametrize(
    "shapes",
    [
        [(2, 1, 3), (1, 4, 3)],
        [(5,), (3, 1, 5)],
        [(1,), (1,)],
        [(2, 3, 4, 8), (1, 3, 1, 8), (3, 1, 8)],
        [(0, 4), (1, 4)],
    ],
)
def test_the_kernels_broadcast_as_torch_does(shapes: list[tuple[int, ...]]) -> None:
    assert fused.broadcast(*map(torch.Size, shapes)) == torch.broadcast_shapes(*shapes)


def test_shapes_that_do_not_broadcast_are_named() -> None:
    with pytest.raises(ValueError, match=r"shapes \[\(2, 3\), \(4, 3\)\] do not broadcast"):
        fused.broadcast(torch.Size((2, 3)), torch.Size((4, 3)))
