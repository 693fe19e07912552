"""``hotweights haproxy-config`` checked by the real ``haproxy`` binary, then run in front of real engines:
it routes to the primary and follows a demote/promote flip within a bounded time."""

from __future__ import annotations

import contextlib
import csv
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hotweights.cli import main
from hotweights.contract import Endpoint
from hotweights.controller.config import load_config
from hotweights.ports import free_port
from tests.cachehelpers import wait_until
from tests.enginehelpers import ChildService, EngineProcess
from tests.gatewayhelpers import primary_and_standby, roles, write_cluster

HAPROXY = shutil.which("haproxy")
pytestmark = pytest.mark.skipif(
    HAPROXY is None, reason="the haproxy binary is not installed (apt-get install -y haproxy)"
)
CONVERGE_S = 2.0  # fall (2) x inter (50 ms) for the old primary, with a wide margin for 2 loaded cores


def generate(config: Path, out: Path, *flags: str) -> Path:
    assert main(["haproxy-config", "--config", str(config), "-o", str(out), *flags]) == 0
    return out


def check(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([HAPROXY, "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)


class HAProxyProcess(ChildService):
    """``haproxy -db`` (foreground) as a child."""

    name = "haproxy"

    def __init__(self, config: Path, port: int, stats_port: int) -> None:
        super().__init__([HAPROXY, "-db", "-f", str(config)], f"http://127.0.0.1:{port}", env=None)
        self.stats_url = f"http://127.0.0.1:{stats_port}/;csv"

    def up(self) -> set[str] | None:
        """The engines HAProxy marks UP, from its stats page (None while it does not answer yet)."""
        try:
            rows = csv.DictReader(httpx.get(self.stats_url, timeout=5).text.removeprefix("# ").splitlines())
        except httpx.TransportError:
            return None
        return {row["svname"] for row in rows if row["pxname"] == "engines" and row["status"] == "UP"} - {"BACKEND"}

    def served_by(self) -> str | None:
        """The server that answered GET /v1/models with 200, or None."""
        with contextlib.suppress(httpx.TransportError):
            response = self.client.get(Endpoint.MODELS)
            if response.status_code == 200:
                return response.headers["x-hotweights-server"]
        return None

    def converge(self, server: str, timeout: float) -> tuple[float, float, int]:
        """Wait until ``server`` is the only one UP and has answered five requests in a row: (seconds until
        requests went there, seconds until HAProxy marked only it UP, how many answers were not 200)."""
        started = time.monotonic()
        routed = marked = None
        streak = failed = 0
        while streak < 5 or marked is None:
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"HAProxy did not converge to {server} within {timeout} s:\n{self.logs()}")
            if marked is None and self.up() == {server}:
                marked = time.monotonic() - started
            answered = self.served_by()
            failed += answered is None
            streak = streak + 1 if answered == server else 0
            if streak == 1:
                routed = time.monotonic() - started  # the first answer of the streak that lasted
            time.sleep(0.002)
        return routed, marked, failed


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[list[EngineProcess]]:
    with primary_and_standby(tiny_model) as engines:
        yield engines


def test_generated_configs_are_valid(tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path / "cluster.toml", [free_port(), free_port()])
    variants = [
        (tmp_path / "plain.cfg", ()),
        (tmp_path / "stats.cfg", ("--stats-port", str(free_port()))),
        (tmp_path / "cut.cfg", ("--shutdown-sessions-on-down",)),
    ]
    for out, flags in variants:
        result = check(generate(cluster, out, *flags))
        assert result.returncode == 0, result.stdout + result.stderr
    text = (tmp_path / "stats.cfg").read_text()
    for line in (
        f"http-check send meth OPTIONS uri {Endpoint.PRIMARY} ver HTTP/1.1 hdr Host localhost",
        "http-check expect status 200",
        "inter 50ms fastinter 50ms downinter 50ms fall 2 rise 1\n",
        "listen stats",
    ):
        assert line in text, line
    assert "fall 2 rise 1 on-marked-down shutdown-sessions\n" in (tmp_path / "cut.cfg").read_text()
    for spec in load_config(cluster).engines():
        assert f"server {spec.id} 127.0.0.1:{spec.port} check" in text


def test_routes_to_the_primary_and_follows_a_flip(engines: list[EngineProcess], tmp_path: Path) -> None:
    cluster = write_cluster(tmp_path / "cluster.toml", [e.port for e in engines])
    names = {f"http://127.0.0.1:{spec.port}": spec.id for spec in load_config(cluster).engines()}
    port, stats_port = free_port(), free_port()
    config = generate(cluster, tmp_path / "haproxy.cfg", "--port", str(port), "--stats-port", str(stats_port))
    haproxy = HAProxyProcess(config, port, stats_port)
    try:
        primary, standby = roles(engines)
        haproxy.converge(names[primary.url], timeout=10.0)
        body = {"prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
        proxied = haproxy.client.post(Endpoint.COMPLETIONS, json=body)
        assert proxied.headers["x-hotweights-server"] == names[primary.url]
        assert proxied.json()["choices"] == primary.complete(**body).json()["choices"]

        assert primary.post(Endpoint.DEMOTE).status_code == 200
        assert standby.post(Endpoint.PROMOTE).status_code == 200
        routed, marked, failed = haproxy.converge(names[standby.url], timeout=CONVERGE_S)
        print(
            f"HAProxy routed to the new primary {routed * 1000:.0f} ms after the promotion and marked it the only "
            f"server UP after {marked * 1000:.0f} ms; {failed} requests were not answered 200 meanwhile"
        )
    finally:
        haproxy.close()


def host_config(path: Path, host: str, address: str, ports: list[int], cluster: str = "multi") -> Path:
    """One host of a ``[dcs]`` cluster: ``write_cluster``'s groups, its own host name and address."""
    write_cluster(path, ports)
    dcs = f'[dcs]\netcd = ["http://127.0.0.1:{free_port()}"]\nhost = "{host}"\naddress = "{address}"\n'
    path.write_text(path.read_text().replace("[cluster]\n", f'[cluster]\nname = "{cluster}"\n') + dcs)
    return path


def test_several_hosts_configs_list_every_hosts_engines_and_refuse_another_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = host_config(tmp_path / "a.toml", "a", "127.0.0.2", [free_port()])
    b = host_config(tmp_path / "b.toml", "b", "127.0.0.3", [free_port()])
    out = generate(a, tmp_path / "hosts.cfg", "--config", str(b))
    assert check(out).returncode == 0, check(out).stderr
    text = out.read_text()
    for config, host in ((a, "a"), (b, "b")):
        spec = load_config(config).engines()[0]
        assert f"server {host}-g0-e0 {spec.host}:{spec.port} check" in text
    other = host_config(tmp_path / "c.toml", "c", "127.0.0.4", [free_port()], cluster="other")
    assert main(["haproxy-config", "--config", str(a), "--config", str(other)]) == 2
    error = capsys.readouterr().err.strip()
    assert "not hosts of one cluster" in error and str(other) in error and "\n" not in error


def test_with_several_hosts_the_primary_check_follows_the_primary_lease(
    engines: list[EngineProcess], tmp_path: Path
) -> None:
    """No watch of etcd: an engine whose primary lease (``[dcs]`` promote) runs out answers /primary 503, so
    HAProxy stops routing to it; the next leader's promote, carrying a higher fencing token, is routed to."""
    primary, standby = roles(engines)
    configs = [
        host_config(tmp_path / f"{h}.toml", h, "127.0.0.1", [e.port]) for h, e in (("a", primary), ("b", standby))
    ]
    port, stats_port = free_port(), free_port()
    out = generate(configs[0], tmp_path / "haproxy.cfg", "--config", str(configs[1]), "--port", str(port),
                   "--stats-port", str(stats_port))  # fmt: skip
    haproxy = HAProxyProcess(out, port, stats_port)
    try:
        haproxy.converge("a-g0-e0", timeout=10.0)
        assert primary.post(Endpoint.DEMOTE).status_code == 200
        lease = {"fencing_token": 7, "lease_s": 1.5}
        assert standby.post(Endpoint.PROMOTE, json=lease).status_code == 200
        haproxy.converge("b-g0-e0", timeout=CONVERGE_S)
        wait_until(lambda: haproxy.up() == set(), 10, "b's lease to run out and HAProxy to mark it down")
        assert haproxy.served_by() is None
        assert primary.post(Endpoint.PROMOTE, json={"fencing_token": 8, "lease_s": 600}).status_code == 200
        haproxy.converge("a-g0-e0", timeout=CONVERGE_S)
    finally:
        haproxy.close()
