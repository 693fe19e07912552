"""SGLang on a CPU machine without the NVIDIA driver: a stand-in ``libcuda.so.1`` (``sglang_nodriver.c``).

SGLang's CPU engine imports ``sgl_kernel``, which links against ``libcuda.so.1``; where no driver is
installed the stand-in, built here with gcc and put first on ``LD_LIBRARY_PATH``, reports no device.
A host with the driver never needs it (``needed`` is False there)."""

from __future__ import annotations

import subprocess
from pathlib import Path

SOURCE = Path(__file__).with_name("sglang_nodriver.c")
LIBRARY = "libcuda.so.1"


def needed() -> bool:
    """No NVIDIA driver here (its kernel module is not loaded)."""
    return not Path("/proc/driver/nvidia").exists()


def build(directory: Path) -> Path:
    """``directory/libcuda.so.1`` compiled from the stand-in's source (gcc); the directory to put first on
    ``LD_LIBRARY_PATH``."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(directory / LIBRARY), str(SOURCE)], check=True)
    return directory


def environment(directory: Path, base: dict[str, str]) -> dict[str, str]:
    """``base`` with SGLang's CPU engine on and, where there is no driver, the stand-in built in ``directory``
    leading ``LD_LIBRARY_PATH``."""
    env = {**base, "SGLANG_USE_CPU_ENGINE": "1"}
    if needed():
        first = str(build(directory))
        env["LD_LIBRARY_PATH"] = ":".join(p for p in (first, base.get("LD_LIBRARY_PATH", "")) if p)
    return env
