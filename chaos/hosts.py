"""Several hosts simulated on one machine, coordinating through a real etcd (``[dcs]``), for drills and benchmarks.

A simulated host is a directory of its own (cluster.toml, state dir, ``HOTWEIGHTS_HOME`` and runtime dir), a
loopback address of its own (host i: ``127.0.0.<i+2>``; its engines listen there) and one controller that runs
its cache daemon and engines; every host's groups are the same failover groups. ``kill`` SIGKILLs every process
of the host at once (its controller, daemon and engines: a host lost); ``start`` brings it back.

``EtcdServer`` is one etcd member (Debian's ``etcd-server``) on free loopback ports with its own data dir.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from hotweights.contract import Endpoint
from hotweights.ports import free_port, free_ports
from hotweights.spawn import hotweights_command

ETCD_READY_S = 30.0


def etcd_command(name: str, data_dir: Path, client_port: int, peer_port: int, initial_cluster: str) -> list[str]:
    """One member of an etcd cluster on loopback (fast raft timings: a lost leader is replaced in ~0.5 s)."""
    url = f"http://127.0.0.1:{client_port}"
    return [
        shutil.which("etcd") or "etcd", "--name", name, "--data-dir", str(data_dir),
        "--listen-client-urls", url, "--advertise-client-urls", url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer_port}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer_port}",
        "--initial-cluster", initial_cluster, "--initial-cluster-state", "new",
        "--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "warn",
    ]  # fmt: skip


def etcd_ready(url: str) -> bool:
    """Whether the member at ``url`` answers ``/health`` 200 (it is part of a cluster with a leader)."""
    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


class EtcdServer:
    """A one-member etcd in ``root``; ``stop``/``start`` keep its data (an etcd restart)."""

    def __init__(self, root: Path) -> None:
        client_port, peer_port = free_ports(2)
        self.url = f"http://127.0.0.1:{client_port}"
        self.log = root / "etcd.log"
        self.command = etcd_command("m0", root / "etcd", client_port, peer_port, f"m0=http://127.0.0.1:{peer_port}")
        self.process: subprocess.Popen | None = None

    def start(self) -> EtcdServer:
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=log)
        deadline = time.monotonic() + ETCD_READY_S
        while not etcd_ready(self.url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start; see {self.log}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


HOST_CONFIG = """\
# Written for simulated host {name} (hotweights.chaos.hosts).
[cluster]
name = "{cluster}"
port = {controller_port}
state_dir = "{root}/state"

[model]
path = "{model}"

[[groups]]
device = "{device}"
engines = {engines}
base_port = {base_port}

[engine]
kv_cache_tokens = 256
max_batch = 4
drain_timeout_s = 5.0

[health]
timeout_ms = 250

[gateway]
port = {gateway_port}
hold_timeout_s = 15.0

[dcs]
etcd = {etcd}
prefix = "{prefix}"
host = "{name}"
address = "{address}"
ttl_s = {ttl_s}
loop_wait_s = {loop_wait_s}
retry_timeout_s = {retry_timeout_s}
"""


class SimulatedHost:
    """Host ``index`` of a multi-host cluster: ``engines`` engines of group 0 on ``127.0.0.<index+2>``."""

    def __init__(self, index: int, etcd: list[str], model: Path, *, engines: int = 1, device: str = "cpu",
                 prefix: str = "/hotweights", ttl_s: int = 2, loop_wait_s: float = 0.25,
                 retry_timeout_s: float = 0.5) -> None:  # fmt: skip
        self.name = f"host{index}"
        self.address = f"127.0.0.{index + 2}"
        self.root = Path(tempfile.mkdtemp(prefix=f"hwh{index}-", dir="/tmp"))
        self.base_port = free_ports(engines, consecutive=True)[0]
        self.port = free_port()
        self.config = self.root / "cluster.toml"
        self.config.write_text(
            HOST_CONFIG.format(
                name=self.name, cluster="multihost", controller_port=self.port, root=self.root, model=model.resolve(),
                device=device, engines=engines, base_port=self.base_port, gateway_port=free_port(),
                etcd=json.dumps(etcd), prefix=prefix, address=self.address, ttl_s=ttl_s, loop_wait_s=loop_wait_s,
                retry_timeout_s=retry_timeout_s,
            )
        )  # fmt: skip
        self.urls = [f"http://{self.address}:{self.base_port + i}" for i in range(engines)]
        self.env = {**os.environ, "HOTWEIGHTS_HOME": str(self.root / "home"),
                    "HOTWEIGHTS_RUNTIME_DIR": str(self.root / "rt"), "OMP_NUM_THREADS": "1"}  # fmt: skip
        self.controller: subprocess.Popen | None = None

    def start(self) -> SimulatedHost:
        """``hotweights controller`` for this host (it starts the daemon and the engines as standbys)."""
        with open(self.root / "controller.log", "ab") as log:
            command = hotweights_command("controller", "--config", str(self.config))
            self.controller = subprocess.Popen(command, stdout=log, stderr=log, env=self.env, start_new_session=True)
        return self

    def ready_standbys(self) -> list[str]:
        return [url for url in self.urls if answers(url, Endpoint.STANDBY)]

    def primaries(self) -> list[str]:
        return [url for url in self.urls if answers(url, Endpoint.PRIMARY)]

    def pids(self) -> list[int]:
        """Every process whose command line names this host's directory (controller, daemon, engines)."""
        marker, pids = str(self.root).encode(), []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit() and int(proc.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if marker in (proc / "cmdline").read_bytes():
                        pids.append(int(proc.name))
        return pids

    def kill(self) -> None:
        """The host is lost: SIGKILL every one of its processes at once."""
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.controller is not None:
            self.controller.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)


def answers(url: str, path: str) -> bool:
    """Whether the engine at ``url`` answers 200 on ``path`` now (within 1 s)."""
    try:
        return httpx.get(url + path, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False
