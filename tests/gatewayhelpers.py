"""A primary and a standby engine, a cluster TOML naming them, and the gateway as a real process."""

from __future__ import annotations

import contextlib
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from hotweights.contract import Endpoint
from hotweights.ports import free_port
from hotweights.spawn import hotweights_command
from tests.enginehelpers import ChildService, EngineProcess

FLAGS = ("--kv-cache-tokens", "512", "--max-batch", "4")


@contextlib.contextmanager
def primary_and_standby(model: Path) -> Iterator[list[EngineProcess]]:
    """Engines "a" (primary) and "b" (standby), started side by side, killed however the test ends."""
    with contextlib.ExitStack() as stack:
        engines = []
        for engine_id, role in (("a", "primary"), ("b", "standby")):
            engine = EngineProcess(model, *FLAGS, "--engine-id", engine_id, "--role", role)
            stack.callback(engine.close)
            engines.append(engine)
        for engine in engines:
            engine.wait_ready()
        yield engines


def metric(server: ChildService, name: str, **labels: str) -> float:
    """The sum of the samples of a gateway's or an engine's metric ``name`` that carry ``labels``."""
    families = text_string_to_metric_families(server.client.get(Endpoint.METRICS).text)
    return sum(s.value for f in families for s in f.samples if s.name == name and labels.items() <= s.labels.items())


def roles(engines: list[EngineProcess]) -> tuple[EngineProcess, EngineProcess]:
    """(primary, standby) as the engines say now."""
    primary = [e for e in engines if e.client.get(Endpoint.PRIMARY).status_code == 200]
    assert len(primary) == 1, f"expected one primary, found {len(primary)}"
    return primary[0], next(e for e in engines if e is not primary[0])


def write_cluster(path: Path, ports: list[int], **gateway: object) -> Path:
    """A cluster TOML with one group per engine port (the helpers pick each engine's port, so they are
    not consecutive), a state dir of its own next to it (the gateway follows the state file there: the default
    one is a real cluster's) and fast health timings; ``gateway`` overrides the [gateway] keys."""
    groups = "".join(f'[[groups]]\ndevice = "cpu"\nengines = 1\nbase_port = {port}\n\n' for port in ports)
    section = {"host": "127.0.0.1", "port": free_port()} | gateway
    lines = "".join(f"{key} = {value!r}\n".replace("'", '"') for key, value in section.items())
    path.write_text(
        f'[cluster]\nport = {free_port()}\nstate_dir = "{path.parent / "state"}"\n\n{groups}'
        "[health]\ninterval_ms = 50\ntimeout_ms = 250\nfailure_threshold = 2\n\n"
        f"[gateway]\n{lines}"
    )
    return path


class GatewayProcess(ChildService):
    """``hotweights gateway`` as a child process."""

    name = "gateway"
    ready_path = Endpoint.GATEWAY_HEALTH

    def __init__(self, config: Path, *extra: str, listener: socket.socket | None = None) -> None:
        """``listener``: a listening socket of ours it serves on (``--fd``), instead of binding a port."""
        self.port = listener.getsockname()[1] if listener else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = hotweights_command("gateway", "--config", str(config))
        command += ["--fd", str(listener.fileno())] if listener else ["--port", str(self.port)]
        super().__init__([*command, *extra], self.url, pass_fds=(listener.fileno(),) if listener else ())

    def health(self) -> dict:
        return self.client.get(Endpoint.GATEWAY_HEALTH).json()

    def wait_health(self, predicate, timeout: float = 10.0, what: str = "gateway state") -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(health := self.health()):
                return health
            time.sleep(0.01)
        raise TimeoutError(f"timed out waiting for {what}; last: {health}\n{self.logs()}")

    def stop(self) -> int:
        """SIGTERM, as a supervisor stops it; the exit status."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=15)
