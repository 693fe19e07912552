"""A real etcd (Debian's ``etcd-server``) on free loopback ports with a data dir of its own, always stopped.

``EtcdMember`` is one etcd process; ``etcd_cluster(n)`` starts ``n`` members that form one cluster. Tests
that use them are skipped when the ``etcd`` binary is missing (``apt-get install -y etcd-server``).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hotweights.chaos.hosts import etcd_command
from hotweights.ports import free_ports
from tests.enginehelpers import ChildService

ETCD = shutil.which("etcd")
needs_etcd = pytest.mark.skipif(
    ETCD is None, reason="the etcd binary is not installed (apt-get install -y etcd-server)"
)


class EtcdMember(ChildService):
    """One etcd member; ``url`` is its client URL. ``stop``/``restart`` keep its data dir (an etcd restart)."""

    name = "etcd"
    ready_path = "/health"

    def __init__(self, name: str, data_dir: Path, client_port: int, peer_port: int, initial_cluster: str) -> None:
        self.url = f"http://127.0.0.1:{client_port}"
        self.command = etcd_command(name, data_dir, client_port, peer_port, initial_cluster)
        super().__init__(self.command, self.url, env=None)

    def stop(self) -> None:
        """SIGKILL and reap (a crash); the data dir and the log stay for ``restart``."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def restart(self) -> EtcdMember:
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=self.log)
        return self


@contextlib.contextmanager
def etcd_cluster(size: int = 1) -> Iterator[list[EtcdMember]]:
    """``size`` etcd members forming one cluster, ready (each answers /health 200), killed and removed after."""
    root = Path(tempfile.mkdtemp(prefix="hwe-", dir="/tmp"))
    ports = free_ports(2 * size)
    names = [f"m{i}" for i in range(size)]
    initial = ",".join(f"{name}=http://127.0.0.1:{ports[size + i]}" for i, name in enumerate(names))
    members: list[EtcdMember] = []
    try:
        for i, name in enumerate(names):
            members.append(EtcdMember(name, root / name, ports[i], ports[size + i], initial))
        for member in members:
            member.wait_ready(30)
        yield members
    finally:
        for member in members:
            member.close()
        shutil.rmtree(root, ignore_errors=True)
