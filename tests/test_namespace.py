"""hotweights runs its own code, whatever folders lie in the working directory.

The design's folders install as ``hotweights.cache`` etc.; a user's project with its own ``controller/``
or ``cache/`` package must never be imported by ``hotweights`` or by any process it spawns.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV, wait_until
from tests.controllerhelpers import ControllerStack

FOREIGN = ("cache", "standby", "controller", "gateway", "chaos")


def foreign_project(root: Path, marker: Path) -> Path:
    """A directory holding packages named like hotweights' folders; importing any of them writes ``marker``."""
    project = root / "project"
    for name in FOREIGN:
        package = project / name
        package.mkdir(parents=True)
        code = f"open({str(marker)!r}, 'a').write({name!r} + ' imported\\n')\n"
        for module in ("__init__.py", "cli.py", "daemon.py", "engine.py"):
            (package / module).write_text(code)
    return project


def test_the_foreign_packages_are_importable_there(tmp_path: Path) -> None:
    """The trap is real: plain ``python -m controller.cli`` in that directory runs the foreign code."""
    marker = tmp_path / "marker"
    project = foreign_project(tmp_path, marker)
    subprocess.run([sys.executable, "-m", "controller.cli"], cwd=project, env=ENV, timeout=60, check=True)
    assert marker.read_text().startswith("controller imported\n")


def test_an_installed_layer_name_is_not_a_top_level_package(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-c", "import cache"], cwd=tmp_path, env=ENV, capture_output=True)
    assert result.returncode != 0 and b"No module named 'cache'" in result.stderr


def test_generate_in_daemon_mode_never_imports_a_foreign_package(tiny_model: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    project = foreign_project(tmp_path, marker)
    runtime = tmp_path / "run"
    env = {**ENV, "HOTWEIGHTS_RUNTIME_DIR": str(runtime)}
    command = hotweights_command("generate", "--model", str(tiny_model), "--prompt", "hi", "--max-tokens", "4")
    try:
        result = subprocess.run(
            [*command, "--weight-cache", "daemon"], cwd=project, env=env, capture_output=True, text=True, timeout=240
        )
        assert result.returncode == 0, result.stderr
        assert list(runtime.glob("*.ready")), "no daemon was started"
    finally:
        for ready in runtime.glob("*.ready"):
            os.kill(json.loads(ready.read_text())["pid"], signal.SIGTERM)
            wait_until(lambda r=ready: not r.exists(), what="the detached daemon's exit")
    assert not marker.exists(), marker.read_text()


def test_up_never_imports_a_foreign_package(tiny_model: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    project = foreign_project(tmp_path, marker)
    stack = ControllerStack(tiny_model, engines=2)
    try:
        stack.start_controller("up", cwd=project)
        stack.wait_up(90)
        gateway = f"http://127.0.0.1:{stack.config.gateway.port}"
        response = httpx.post(f"{gateway}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=30)
        assert response.status_code == 200, response.text
        assert stack.recorded_pids(), "up started no processes"
    finally:
        stack.close()
    assert not marker.exists(), marker.read_text()
