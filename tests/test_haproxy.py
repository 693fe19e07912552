"""``hotweights haproxy-config`` checked by the real ``haproxy`` binary, then run in front of real engines:
it routes to the primary and follows a demote/promote flip within a bounded time."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from controller.cli import main
from controller.config import load_config
from tests.enginehelpers import EngineProcess, free_port
from tests.gatewayhelpers import primary_and_standby, roles, write_cluster

HAPROXY = shutil.which("haproxy")
pytestmark = pytest.mark.skipif(
    HAPROXY is None, reason="the haproxy binary is not installed (apt-get install -y haproxy)"
)
CONVERGE_S = 2.0  # fall (2) x inter (50 ms) plus rise, with a wide margin for 2 loaded cores


def generate(config: Path, out: Path, *flags: str) -> Path:
    assert main(["haproxy-config", "--config", str(config), "-o", str(out), *flags]) == 0
    return out


def check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([HAPROXY, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)


class HAProxyProcess:
    """``haproxy -db`` (foreground) as a child; its output goes to a file, shown when it fails."""

    def __init__(self, config: Path, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile(prefix="haproxy-", suffix=".log", delete=False)  # noqa: SIM115
        self.process = subprocess.Popen([HAPROXY, "-db", "-f", str(config)], stdout=self.log, stderr=self.log)
        self.client = httpx.Client(base_url=self.url, timeout=10.0)

    def served_by(self) -> str | None:
        """The server that answered GET /v1/models with 200, or None."""
        with contextlib.suppress(httpx.TransportError):
            response = self.client.get("/v1/models")
            if response.status_code == 200:
                return response.headers["x-hotweights-server"]
        return None

    def logs(self) -> str:
        return Path(self.log.name).read_text()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.client.close()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[list[EngineProcess]]:
    with primary_and_standby(tiny_model) as engines:
        yield engines


def test_generated_configs_are_valid(tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path / "cluster.toml", [free_port(), free_port()])
    for out, flags in [(tmp_path / "plain.cfg", ()), (tmp_path / "stats.cfg", ("--stats-port", str(free_port())))]:
        result = check(generate(cluster, out, *flags))
        assert result.returncode == 0, result.stdout + result.stderr
    text = (tmp_path / "stats.cfg").read_text()
    for line in (
        "http-check send meth OPTIONS uri /primary ver HTTP/1.1 hdr Host localhost",
        "http-check expect status 200",
        "inter 50ms fastinter 50ms downinter 50ms fall 2 rise 1 on-marked-down shutdown-sessions",
        "listen stats",
    ):
        assert line in text, line
    for spec in load_config(cluster).engines():
        assert f"server {spec.id} 127.0.0.1:{spec.port} check" in text


def test_routes_to_the_primary_and_follows_a_flip(engines: list[EngineProcess], tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path / "cluster.toml", [e.port for e in engines])
    names = {f"http://127.0.0.1:{spec.port}": spec.id for spec in load_config(cluster).engines()}
    port = free_port()
    haproxy = HAProxyProcess(generate(cluster, tmp_path / "haproxy.cfg", "--port", str(port)), port)
    try:
        primary, standby = roles(engines)
        converge(haproxy, names[primary.url], timeout=10.0)
        body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
        assert (
            haproxy.client.post("/v1/completions", json=body).json()["choices"]
            == primary.complete(**body).json()["choices"]
        )

        assert primary.post("/demote").status_code == 200
        assert standby.post("/promote").status_code == 200
        seconds, failed = converge(haproxy, names[standby.url], timeout=CONVERGE_S)
        print(f"HAProxy converged to the new primary {seconds * 1000:.0f} ms after the promotion ({failed} non-200s)")
    except BaseException:
        print(haproxy.logs())
        raise
    finally:
        haproxy.close()


def converge(haproxy: HAProxyProcess, server: str, timeout: float) -> tuple[float, int]:
    """Seconds until ``server`` answered five requests in a row, and how many answers were not 200."""
    started = time.monotonic()
    streak, failed, first = 0, 0, 0.0
    while streak < 5:
        if time.monotonic() - started > timeout:
            raise TimeoutError(f"HAProxy did not route to {server} within {timeout} s")
        answered = haproxy.served_by()
        failed += answered is None
        if answered == server:
            first = first if streak else time.monotonic() - started
            streak += 1
        else:
            streak = 0
            time.sleep(0.005)
    return first, failed
