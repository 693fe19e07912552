"""Every command in the README's ``sh`` blocks runs as written: the install and test lines in ``.ci/run``,
the others here.

The README's stack uses the default ports (gateway 8000, controller 8100, engines 8200-8202), which a user's
own ``hotweights up`` may hold while the tests run. So the commands run in a network namespace of their own
(``unshare -rn``: a private loopback on which those ports are free), under this test's HOTWEIGHTS_HOME and
runtime dir, from a directory outside the repository; the text stays exactly the README's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
CI = REPO / ".ci" / "run"
# CI installs this same build from the machine's disk; .ci/run says so next to its own line.
CPU_TORCH = "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu"


def readme_lines() -> list[str]:
    """Every command line of the README's sh blocks, in order."""
    blocks = re.findall(r"```sh\n(.*?)```", README.read_text(), re.DOTALL)
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def is_ci_line(line: str) -> bool:
    """Installing and running the tests is CI's part."""
    return line.startswith("pip install")


def test_the_install_and_test_lines_are_the_ones_ci_runs() -> None:
    ci_commands = {line.strip() for line in CI.read_text().splitlines()}
    install = [line for line in readme_lines() if is_ci_line(line)]
    assert CPU_TORCH in install  # the CPU build from the PyTorch project's CPU index, not the CUDA one
    commands = [command for line in install for command in line.split(" && ") if command != CPU_TORCH]
    assert commands and [c for c in commands if c not in ci_commands] == []


def namespaces_work() -> bool:
    if not shutil.which("unshare") or not shutil.which("ip"):
        return False
    probe = subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30)
    return probe.returncode == 0


def script(lines: list[str]) -> str:
    """A bash script that starts ``hotweights up`` in the background, runs every other line once the stack
    is up (waiting for the failover before reading the events, as a person would), prints ``@@ <status>``
    after each, then stops the stack with SIGINT (Ctrl-C) and prints ``@@up <status>``."""
    out = ["ip link set lo up"]
    for line in lines:
        if line == "hotweights up":
            out += [f"{line} >up.log 2>&1 &", "up=$!"]
            out.append("until grep -q ' is up$' up.log; do kill -0 $up || exit 90; sleep 0.1; done")
            continue
        if line.startswith("curl -s localhost:8100/events"):
            out.append("until curl -s 'localhost:8100/events?kind=failover' | grep -q promoted; do sleep 0.1; done")
        if line.startswith("hotweights drill"):
            out += ["kill -INT $up", "wait $up", 'echo "@@up $?"']
        out += [f"echo {shlex.quote('@@> ' + line)}", line, 'status=$?; echo; echo "@@ $status"']
    return "\n".join(out) + "\n"


def steps(stdout: str) -> dict[str, tuple[str, int]]:
    """README line -> (its output, its exit status), from the script's markers."""
    found, command, output = {}, None, []
    for line in stdout.splitlines():
        if line.startswith("@@> "):
            command, output = line.removeprefix("@@> "), []
        elif line.startswith("@@ ") and command is not None:
            found[command] = ("\n".join(output).strip(), int(line.split()[1]))
        else:
            output.append(line)
    return found


@pytest.mark.timeout(600)
@pytest.mark.skipif(not namespaces_work(), reason="needs user and network namespaces (unshare -rn) and iproute2")
def test_the_try_it_commands_run_as_written(default_model: Path, own_world: Path) -> None:
    lines = [line for line in readme_lines() if not is_ci_line(line)]
    assert "hotweights up" in lines
    env = os.environ | {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    result = subprocess.run(
        ["unshare", "-rn", "bash", "-c", script(lines)],
        cwd=own_world,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    log = (own_world / "up.log").read_text(errors="replace")[-3000:] if (own_world / "up.log").exists() else ""
    ran = steps(result.stdout)
    assert result.returncode == 0 and list(ran) == [line for line in lines if line != "hotweights up"], (
        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}\n{log}"
    )
    failed = {line: (output[-3000:], status) for line, (output, status) in ran.items() if status}
    assert failed == {}, failed
    assert "@@up 0" in result.stdout, log  # Ctrl-C stopped the whole stack cleanly

    def output_of(prefix: str) -> str:
        (output,) = [out for line, (out, _) in ran.items() if line.startswith(prefix)]
        return output

    assert json.loads(output_of("curl -s localhost:8000/v1/completions"))["choices"][0]["text"]
    events = json.loads(output_of("curl -s localhost:8100/events"))["events"]
    assert [e for e in events if e["kind"] == "failover"], events
    assert "/run/g0.sock" in output_of("hotweights cache status")  # the stack's daemon, found without --socket
    assert "last failover: automatic" in output_of("hotweights status")  # the kill above, with its duration
    summary = own_world / "drill-out" / "summary.md"
    assert "![timeline](timeline.png)" in summary.read_text() and (summary.parent / "timeline.png").exists()
