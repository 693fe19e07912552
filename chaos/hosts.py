"""Several hosts simulated on one machine, coordinating through a real etcd (``[dcs]``), for drills and benchmarks.

A simulated host is a directory of its own (cluster.toml, state dir, ``HOTWEIGHTS_HOME`` and runtime dir), a
loopback address of its own (host i: ``127.0.0.<i+2>``; its engines listen there) and one controller that runs
its cache daemon and engines; every host's groups are the same failover groups. ``kill`` SIGKILLs every process
of the host at once (its controller, daemon and engines: a host lost); ``start`` brings it back.

``EtcdServer`` is one etcd member (Debian's ``etcd-server``) on free loopback ports with its own data dir.
``HostsStack`` and ``HostsApi`` are what ``hotweights drill --hosts N --dcs etcd`` runs against and asks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

import httpx

from hotweights.chaos.clusterview import ClusterView, ControlApi, event_time
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


def pids_naming(marker: str) -> list[int]:
    """Every process but this one whose command line contains ``marker`` (e.g. a stack's directory)."""
    needle, pids = marker.encode(), []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                if needle in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
    return pids


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
{listen_base_port}
[engine]
kv_cache_tokens = 256
max_batch = 4
drain_timeout_s = 5.0

# Every host's processes, etcd and the proxies share this machine's cores: a false alarm on a host's one engine
# costs an engine restart; the faults drilled here never wait on these checks (a lost process is seen at once).
[health]
timeout_ms = 1000
failure_threshold = 3

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
    """Host ``index`` of a multi-host cluster: ``engines`` engines of group 0 on ``127.0.0.<index+2>``, in
    ``root`` (default: a fresh temp dir). ``proxied``: the engines listen on private ports (``direct_urls``)
    and everyone, this host's controller too, reaches them on ``urls`` through a fault proxy the caller runs."""

    def __init__(self, index: int, etcd: list[str], model: Path, *, engines: int = 1, device: str = "cpu",
                 prefix: str = "/hotweights", ttl_s: int = 2, loop_wait_s: float = 0.25,
                 retry_timeout_s: float = 0.5, root: Path | None = None, proxied: bool = False) -> None:  # fmt: skip
        self.name = f"host{index}"
        self.address = f"127.0.0.{index + 2}"
        self.root = root or Path(tempfile.mkdtemp(prefix=f"hwh{index}-", dir="/tmp"))
        self.root.mkdir(parents=True, exist_ok=True)
        ports = free_ports(2 * engines if proxied else engines, consecutive=True)  # public, then private
        self.base_port, self.listen_base_port = ports[0], ports[engines] if proxied else ports[0]
        self.port = free_port()
        self.config = self.root / "cluster.toml"
        self.config.write_text(
            HOST_CONFIG.format(
                name=self.name, cluster="multihost", controller_port=self.port, root=self.root, model=model.resolve(),
                device=device, engines=engines, base_port=self.base_port, gateway_port=free_port(),
                listen_base_port=f"listen_base_port = {self.listen_base_port}\n" if proxied else "",
                etcd=json.dumps(etcd), prefix=prefix, address=self.address, ttl_s=ttl_s, loop_wait_s=loop_wait_s,
                retry_timeout_s=retry_timeout_s,
            )
        )  # fmt: skip
        self.urls = [f"http://{self.address}:{self.base_port + i}" for i in range(engines)]
        self.direct_urls = [f"http://{self.address}:{self.listen_base_port + i}" for i in range(engines)]
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

    @property
    def marker(self) -> str:
        """What the command line of each of its processes holds: its directory."""
        return f"{self.root}/"

    def pids(self) -> list[int]:
        """Every process whose command line names this host's directory (controller, daemon, engines)."""
        return pids_naming(self.marker)

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


PARTITION_S = 1e6  # a partition: the fault proxy takes bytes and delivers none (until healed)


class HostsStack:
    """What ``hotweights drill --hosts N --dcs etcd`` runs against, in ``workdir``: one etcd, N simulated hosts
    (one engine each, all of group 0, ``host<i>/``), one fault-proxy process that holds each host's path to
    etcd and each engine's public port, and one gateway outside every host (its own config: etcd directly)
    that follows the leader keys by watch. It answers the drill's questions as ``DrillStack`` does (``lb_url``,
    ``direct_urls``, ``markers``, ``start``, ``teardown``); ``control_api`` asks every host's controller."""

    lb = "gateway"
    owned = True
    proxy_map: ClassVar[dict[int, int]] = {}  # no per-engine delay (slow-primary skips): partitions are per host

    def __init__(self, workdir: Path, hosts: int, model: Path, device: str = "cpu", ttl_s: int = 2) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir, self.ttl_s = workdir, ttl_s
        self.etcd = EtcdServer(workdir)
        self.etcd_paths = free_ports(hosts)  # host i reaches etcd at 127.0.0.1:<etcd_paths[i]>, through the proxy
        self.hosts = [
            SimulatedHost(i, [f"http://127.0.0.1:{self.etcd_paths[i]}"], model, device=device, ttl_s=ttl_s,
                          root=workdir / f"host{i}", proxied=True)
            for i in range(hosts)
        ]  # fmt: skip
        self.lb_port = free_port()
        self.proxy: subprocess.Popen | None = None
        self.gateway: subprocess.Popen | None = None

    # --- what the drill asks ----------------------------------------------------------------------

    @property
    def lb_url(self) -> str:
        return f"http://127.0.0.1:{self.lb_port}"

    def direct_urls(self) -> list[str]:
        """Every host's engines behind their proxies: where the split-brain detector asks."""
        return [url for host in self.hosts for url in host.direct_urls]

    @property
    def markers(self) -> tuple[str, ...]:
        return tuple(host.marker for host in self.hosts)

    def control_api(self) -> HostsApi:
        return HostsApi({host.name: f"http://127.0.0.1:{host.port}" for host in self.hosts})

    def start_failure(self) -> str | None:
        """None while every host's controller runs; else which one exited, and where its log is."""
        for host in self.hosts:
            if host.controller is not None and host.controller.poll() is not None:
                return f"{host.name}'s controller exited with {host.controller.returncode}; see {host.root}"
        return None

    def controller_target(self) -> None:
        """kill-controller is one host's scenario; here it is controller-loss."""
        return None

    # --- start and stop ---------------------------------------------------------------------------

    def start(self) -> None:
        """etcd, the proxies (waiting until etcd answers through each host's path), the hosts, the gateway."""
        self.etcd.start()
        etcd_port = int(self.etcd.url.rsplit(":", 1)[1])
        pairs = [f"127.0.0.1:{path}={etcd_port}" for path in self.etcd_paths]
        pairs += [
            f"{host.address}:{host.base_port + i}={host.listen_base_port + i}"
            for host in self.hosts
            for i in range(len(host.urls))
        ]
        self.proxy = self._spawn("proxy", hotweights_command("drill-proxy", *pairs), stdin=subprocess.PIPE)
        deadline = time.monotonic() + ETCD_READY_S
        while not all(etcd_ready(f"http://127.0.0.1:{path}") for path in self.etcd_paths):
            if self.proxy.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the drill's fault proxy did not start; see {self.workdir / 'proxy.log'}")
            time.sleep(0.05)
        for host in self.hosts:
            host.start()
        config = self.workdir / "gateway.toml"  # not in a host's directory: a host killed leaves it running
        etcd = f"etcd = {json.dumps([self.etcd.url])}"
        config.write_text(re.sub(r"^etcd = .*$", etcd, self.hosts[0].config.read_text(), flags=re.M))
        command = hotweights_command("gateway", "--config", str(config), "--port", str(self.lb_port))
        self.gateway = self._spawn("gateway", command, env=self.hosts[0].env)

    def _spawn(self, name: str, command: list[str], **kwargs: Any) -> subprocess.Popen:
        with open(self.workdir / f"{name}.log", "ab") as log:
            return subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True, **kwargs)

    def teardown(self) -> list[str]:
        """SIGKILL the gateway, every host's processes and the proxy; stop etcd."""
        lines = []
        for process in (self.gateway, self.proxy):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(timeout=10)
            if process is not None and process.stdin:
                process.stdin.close()
        for host in self.hosts:
            lines.append(f"{host.name}: killed {len(host.pids())} process(es)")
            host.kill()
        self.etcd.stop()
        return lines

    # --- faults -----------------------------------------------------------------------------------

    def host(self, member_id: str) -> SimulatedHost:
        """The host of a member as the merged view names it (``host1/g0-e0``)."""
        name = member_id.split("/", 1)[0]
        return next(host for host in self.hosts if host.name == name)

    def partition(self, host: SimulatedHost, cut: bool) -> None:
        """Cut ``host`` from etcd and from every peer (its engines' public ports: the gateway, and its own
        controller, which reaches them the same way on one machine), or heal it (cutting the connections
        the partition held)."""
        ports = [self.etcd_paths[self.hosts.index(host)], *(host.base_port + i for i in range(len(host.urls)))]
        actions = [f"{PARTITION_S:g}"] if cut else ["0", "reset"]
        assert self.proxy is not None and self.proxy.stdin is not None, "start() first"
        self.proxy.stdin.write("".join(f"{port} {action}\n" for action in actions for port in ports).encode())
        self.proxy.stdin.flush()

    def restart_etcd(self) -> None:
        """SIGKILL etcd, start it again with its data (blocks until it answers)."""
        self.etcd.stop()
        self.etcd.start()


class HostsApi(ControlApi):
    """The drill's view of several hosts: every host's controller asked at once, their answers merged into
    one ``ClusterView`` (ids prefixed with the host's name: ``host1/g0-e0``); None while any controller does
    not answer (a host lost is not whole). Events likewise, oldest first."""

    def __init__(self, controllers: dict[str, str]) -> None:
        super().__init__(next(iter(controllers.values())), None)
        self.apis = {name: ControlApi(url, None) for name, url in controllers.items()}

    async def cluster(self) -> ClusterView | None:
        views = await asyncio.gather(*(api.cluster() for api in self.apis.values()))
        if any(view is None for view in views):
            return None
        members, services, spares, daemon_spares = [], [], [], []
        for name, view in zip(self.apis, views, strict=True):
            assert view is not None
            members += [m | {"id": f"{name}/{m['id']}"} for m in view.members]
            services += [s | {"id": f"{name}/{s['id']}"} for s in view.services]
            spares += [s | {"group": f"{name}/{s['group']}"} for s in view.spares]
            daemon_spares += [s | {"service": f"{name}/{s['service']}"} for s in view.daemon_spares]
        return ClusterView(members, services, spares, daemon_spares=daemon_spares)

    async def events(self, since: float) -> list[dict[str, Any]]:
        found = await asyncio.gather(*(api.events(since) for api in self.apis.values()))
        merged = [
            e | {key: f"{name}/{e[key]}" for key in ("member", "service") if e.get(key)}
            for name, events in zip(self.apis, found, strict=True)
            for e in events
        ]
        return sorted(merged, key=event_time)

    async def aclose(self) -> None:
        await asyncio.gather(super().aclose(), *(api.aclose() for api in self.apis.values()))
