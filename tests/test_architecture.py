"""The import layers of pyproject.toml's import-linter contracts hold, and a violation is caught.

import-linter finds a package by walking its one directory, and the design's folders install as
``hotweights.<folder>`` from the repository root (setuptools' package-dir mapping), so the test
stages the installed layout (a copy of the sources, mapped as pyproject.toml maps them) and lints that.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def stage(root: Path) -> Path:
    """Copy every package to where it installs under ``root`` (e.g. cache/ -> root/hotweights/cache/)."""
    mapping = PYPROJECT["tool"]["setuptools"]["package-dir"]
    for package in PYPROJECT["tool"]["setuptools"]["packages"]:
        top = package.split(".")[1] if "." in package else package
        source = REPO / mapping[package if package in mapping else f"hotweights.{top}"]
        if package not in mapping:  # a subpackage: below its parent's folder
            source = source / Path(*package.split(".")[2:])
        target = root / Path(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for module in source.glob("*.py"):
            shutil.copy(module, target / module.name)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    return root


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` in ``root``, where the staged copy comes first on sys.path."""
    code = "import sys; sys.path.insert(0, '.'); import importlinter.cli as c; c.lint_imports_command()"
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)


def test_layers_import_one_way(tmp_path: Path) -> None:
    result = lint_imports(stage(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "added", "broken"),
    [
        (
            "cache/arena.py",
            "from hotweights.standby import model",
            "hotweights.cache.arena -> hotweights.standby.model",
        ),
        ("controller/checks.py", "import torch", "hotweights.controller.checks -> torch"),
        (
            "controller/cluster.py",
            "from hotweights.gateway import policy",
            "hotweights.controller.cluster -> hotweights.gateway.policy",
        ),
        ("controller/decide.py", "from hotweights.controller import executor", "hotweights.controller.decide ->"),
        (
            "controller/intents.py",
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from hotweights.controller.ha import Ha",
            ".intents -> .ha",
        ),
    ],
)
def test_a_forbidden_import_breaks_a_contract(tmp_path: Path, module: str, added: str, broken: str) -> None:
    """An upward import between layers, torch in the controller, the gateway in the controller, mechanism in the
    decision core, and a cycle among the controller's modules (one made only for type checking too) each break a
    contract that names it."""
    root = stage(tmp_path)
    path = root / "hotweights" / module
    path.write_text(path.read_text() + f"\n{added}  # noqa\n")
    result = lint_imports(root)
    assert result.returncode != 0
    assert broken in result.stdout


def test_the_gateway_the_agent_and_the_config_import_no_torch() -> None:
    """A gateway's start (and its respawn after a crash) never waits for torch's second of imports, and an agent
    in front of vLLM or SGLang holds no torch of its own (about 200 MB of memory)."""
    code = (
        "import sys; import hotweights.gateway.server, hotweights.controller.config; "
        "import hotweights.standby.agent; "
        "from hotweights.dtypes import MODEL_DTYPE_NAMES; from hotweights.quant import QUANT_METHODS; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]", result.stdout[:500]


def test_the_daemon_and_the_gateway_start_without_fastapi_or_the_controller_layer() -> None:
    """Each test run and each respawn starts them many times: ``cache serve`` parses its command line without
    the controller's ``cache restart`` client, and the gateway's worker needs no FastAPI (a fifth of its start)."""
    code = (
        "import sys; from hotweights.cli import build_parser; build_parser('cache', 'serve'); "
        "import hotweights.gateway.server as g; "
        "print(sorted(m for m in sys.modules if m == 'fastapi' or m == 'hotweights.controller.clusterctl'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]", result.stdout[:500]


def test_the_controller_imports_neither_torch_nor_the_reference_engine_nor_the_gateway() -> None:
    """Every module of the controller process imports without torch and the reference engine's modules: its
    checks that need them run in a process of their own (``controller.checks``); the gateway is a program of
    its own, which the controller starts by name (``hotweights gateway``)."""
    engine = ("engine", "model", "decoder", "scheduler", "tpgroup", "weights", "sampling", "fused")
    code = (
        "import importlib, pkgutil, sys; import hotweights.controller as c\n"
        "names = [m.name for m in pkgutil.walk_packages(c.__path__, 'hotweights.controller.')]\n"
        "for name in names: importlib.import_module(name)\n"
        f"banned = {['torch', *(f'hotweights.standby.{m}' for m in engine)]!r}\n"
        "print(len(names), sorted(m for m in sys.modules if m in banned or m.startswith('hotweights.gateway')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    count, imported = result.stdout.strip().split(" ", 1)
    assert int(count) > 30 and imported == "[]", result.stdout[:500]


def test_the_torch_tables_come_on_first_use() -> None:
    from hotweights import dtypes, quant

    assert dtypes.MODEL_DTYPES["bf16"] is torch.bfloat16 and dtypes.ARENA_DTYPES["float8_e4m3fn"] is quant.FP8_DTYPE
    assert tuple(dtypes.MODEL_DTYPES) == dtypes.MODEL_DTYPE_NAMES
    assert dtypes.config_name(torch.float16) == "float16" and dtypes.model_config_name("fp32") == "float32"
