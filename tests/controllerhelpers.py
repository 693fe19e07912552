"""A real controller stack (cache daemon + engines + ``hotweights controller``) on loopback, always torn down."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from hotweights.chaos.splitbrain import SplitBrainDetector
from hotweights.chaos.stack import free_ports
from hotweights.controller.commands import stop_everything
from hotweights.controller.config import load_config
from hotweights.controller.supervisor import StateFile

from hotweights.contract import Endpoint
from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV, wait_until
from tests.enginehelpers import free_port

TOKEN = "controller-test-token"


class ControllerStack:
    """One group of ``engines`` engines; state dir and sockets in a short /tmp directory."""

    def __init__(self, model: Path, engines: int = 3) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="hwc-", dir="/tmp"))
        self.port = free_port()
        self.base_port = free_ports(engines + 2, consecutive=True)[0]
        token_file = self.root / "token"
        token_file.write_text(TOKEN + "\n")
        self.config_path = self.root / "cluster.toml"
        self.config_path.write_text(
            f'[cluster]\nname = "test"\nport = {self.port}\nstate_dir = "{self.root / "state"}"\n'
            f'token_file = "{token_file}"\n\n'
            f'[model]\npath = "{model}"\n\n'
            f"[[groups]]\nengines = {engines}\nbase_port = {self.base_port}\n\n"
            "[engine]\nkv_cache_tokens = 256\nmax_batch = 2\ndrain_timeout_s = 5.0\n\n"
            # a 500 ms timeout: two cores shared with the whole stack make 250 ms checks flaky in CI
            "[health]\ninterval_ms = 100\ntimeout_ms = 500\nfailure_threshold = 2\n\n"
            f"[gateway]\nport = {free_port()}\n"
        )
        self.config = load_config(self.config_path)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=60.0, headers={"Authorization": f"Bearer {TOKEN}"})
        self.anonymous = httpx.Client(base_url=self.url, timeout=60.0)
        self.log = self.root / "controller.log"
        self.controller: subprocess.Popen | None = None

    def start_controller(self, command: str = "controller") -> None:
        """``hotweights controller`` (or ``up``, which adds the gateway and owns the stack)."""
        with open(self.log, "ab") as out:
            self.controller = subprocess.Popen(
                hotweights_command(command, "--config", str(self.config_path)),
                env=ENV,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )

    def kill_controller(self) -> None:
        assert self.controller is not None
        self.controller.kill()
        self.controller.wait(timeout=10)

    # --- reading the cluster ----------------------------------------------------------------------

    def cluster(self) -> dict[str, Any]:
        response = self.client.get("/cluster")
        response.raise_for_status()
        return response.json()

    def members(self) -> dict[str, dict[str, Any]]:
        return {m["id"]: m for m in self.cluster()["members"]}

    def daemon(self) -> dict[str, Any]:
        return next(s for s in self.cluster()["services"] if s["kind"] == "daemon")

    def primary(self) -> dict[str, Any]:
        (primary,) = [m for m in self.members().values() if m["role"] == "primary"]
        return primary

    def is_steady(self) -> bool:
        """One serving primary, every other engine a healthy standby, the daemon serving."""
        if self.controller is not None and self.controller.poll() is not None:
            raise RuntimeError(f"controller exited with {self.controller.returncode}:\n{self.logs()}")
        members = self.members().values()
        primaries = [m for m in members if m["role"] == "primary" and m["state"] == "ready"]
        return (
            len(primaries) == 1
            and all(m["status"] == "healthy" for m in members)
            and self.daemon()["serving"]
            and self.engine_primary_status(primaries[0]["url"]) == 200
        )

    def wait_steady(self, timeout: float = 90.0) -> dict[str, dict[str, Any]]:
        wait_until(self.is_steady, timeout, "a steady cluster", interval=0.1)
        return self.members()

    def engine_primary_status(self, url: str) -> int | None:
        try:
            return httpx.get(url + Endpoint.PRIMARY, timeout=2.0).status_code
        except httpx.TransportError:
            return None

    def events(self, kind: str) -> list[dict[str, Any]]:
        return self.client.get("/events", params={"kind": kind}).json()["events"]

    def logs(self, tail: int = 5000) -> str:
        return self.log.read_text(errors="replace")[-tail:]

    def recorded_pids(self) -> list[int]:
        state = StateFile(self.root / "state" / "state.json").load()
        rows = [*state.get("members", {}).values(), *state.get("services", {}).values()]
        return [row["process"]["pid"] for row in rows if row.get("process")]

    # --- teardown ---------------------------------------------------------------------------------

    def pids_naming_root(self) -> list[int]:
        """Every process whose command line names this stack's directory: also those the state file
        no longer records (a test may have made orphans on purpose)."""
        marker = str(self.root).encode()
        pids = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit() and int(proc.name) != os.getpid():
                with contextlib.suppress(OSError):
                    if marker in (proc / "cmdline").read_bytes():
                        pids.append(int(proc.name))
        return pids

    def close(self) -> None:
        """Kill the controller, stop everything the state file records, SIGKILL any leftover."""
        with contextlib.suppress(Exception):
            if self.controller is not None and self.controller.poll() is None:
                self.kill_controller()
        with contextlib.suppress(Exception):
            stop_everything(self.config, timeout=5.0)
        for pid in {*self.recorded_pids(), *self.pids_naming_root()}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.client.close()
        self.anonymous.close()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def split_brain_watch(urls: list[str]) -> Iterator[SplitBrainDetector]:
    """chaos.splitbrain's detector (every engine's /primary every 10 ms) on a thread of its own."""
    detector = SplitBrainDetector(urls)
    stop = threading.Event()

    async def sweep() -> None:
        async with detector.running():
            await asyncio.to_thread(stop.wait)

    thread = threading.Thread(target=asyncio.run, args=(sweep(),), daemon=True)
    thread.start()
    try:
        yield detector
    finally:
        stop.set()
        thread.join(timeout=10)
