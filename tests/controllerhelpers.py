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
from typing import Any, TypeVar

import httpx

from hotweights.chaos.hosts import pids_naming
from hotweights.chaos.load import LoadGenerator, completion_body
from hotweights.chaos.splitbrain import SplitBrainDetector
from hotweights.contract import Endpoint
from hotweights.controller.commands import stop_everything
from hotweights.controller.config import load_config
from hotweights.errors import ConfigError
from hotweights.ports import free_port, free_ports
from hotweights.spawn import hotweights_command
from hotweights.state import read_state
from tests.cachehelpers import ENV, wait_until

T = TypeVar("T")

TOKEN = "controller-test-token"


class ControllerStack:
    """``groups`` groups of ``engines`` engines each; state dir and sockets in a short /tmp directory."""

    def __init__(
        self,
        model: Path,
        engines: int = 3,
        *,
        groups: int = 1,
        failure_threshold: int = 2,
        drain_timeout_s: float = 5.0,
        max_batch: int = 2,
        engine_extra: str = "",
        group_extra: str = "",
        gateway_extra: str = "",
        extra: str = "",
    ) -> None:
        """``group_extra``: more keys for every ``[[groups]]`` table (e.g. a vLLM group's); ``engine_extra``: more
        keys for ``[engine]``; ``gateway_extra``: more keys for ``[gateway]``; ``extra``: more sections (e.g.
        ``[dcs]``). The engines generate ``max_batch`` (2) sequences at once and queue the rest as shipped (by its
        expected start: ``engine.queue_budget_s``)."""
        self.env = ENV  # the controller's environment
        self.root = Path(tempfile.mkdtemp(prefix="hwc-", dir="/tmp"))
        self.port = free_port()
        self.base_ports = [free_ports(engines + 2, consecutive=True)[0] for _ in range(groups)]
        self.base_port = self.base_ports[0]
        token_file = self.root / "token"
        token_file.write_text(TOKEN + "\n")
        self.config_path = self.root / "cluster.toml"
        self.config_path.write_text(
            f'[cluster]\nname = "test"\nport = {self.port}\nstate_dir = "{self.root / "state"}"\n'
            f'token_file = "{token_file}"\n\n'
            f'[model]\npath = "{model}"\n\n'
            + "".join(
                f"[[groups]]\nengines = {engines}\nbase_port = {base}\n{group_extra}\n" for base in self.base_ports
            )
            + f"[engine]\nkv_cache_tokens = 256\nmax_batch = {max_batch}\n"
            f"drain_timeout_s = {drain_timeout_s}\n{engine_extra}\n"
            # a 500 ms timeout: two cores shared with the whole stack make 250 ms checks flaky in CI
            f"[health]\ninterval_ms = 100\ntimeout_ms = 500\nfailure_threshold = {failure_threshold}\n\n"
            f"[gateway]\nport = {free_port()}\n{gateway_extra}\n{extra}"
        )
        self.config = load_config(self.config_path)
        self.url = f"http://127.0.0.1:{self.port}"
        self.client = httpx.Client(base_url=self.url, timeout=60.0, headers={"Authorization": f"Bearer {TOKEN}"})
        self.anonymous = httpx.Client(base_url=self.url, timeout=60.0)
        self.log = self.root / "controller.log"
        self.controller: subprocess.Popen | None = None

    def start_controller(self, command: str = "controller", cwd: Path | None = None) -> None:
        """``hotweights controller`` (or ``up``, which adds the gateway and owns the stack), run in ``cwd``."""
        with open(self.log, "ab") as out:
            self.controller = subprocess.Popen(
                hotweights_command(command, "--config", str(self.config_path)),
                cwd=cwd,
                env=self.env,
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

    def daemon(self, group: int = 0) -> dict[str, Any]:
        return next(s for s in self.cluster()["services"] if s["kind"] == "daemon" and s["group"] == group)

    def primary(self, group: int = 0, timeout: float = 30.0) -> dict[str, Any]:
        """The group's one primary. A failover leaves a group without one for an instant (between the
        fence and the promotion): wait that out rather than read it as a failure."""

        def one() -> dict[str, Any] | None:
            primaries = [m for m in self.members().values() if m["role"] == "primary" and m["group"] == group]
            return primaries[0] if len(primaries) == 1 else None

        return wait_until(one, timeout, f"one primary in group {group}", interval=0.05)

    def is_steady(self) -> bool:
        """One serving primary per group, every other engine a healthy standby, every daemon serving."""
        if self.controller is not None and self.controller.poll() is not None:
            raise RuntimeError(f"controller exited with {self.controller.returncode}:\n{self.logs()}")
        cluster = self.cluster()
        members = cluster["members"]
        primaries = [m for m in members if m["role"] == "primary" and m["state"] == "ready"]
        daemons = [s for s in cluster["services"] if s["kind"] == "daemon"]  # one per group, or per rank
        return (
            sorted(m["group"] for m in primaries) == sorted({d["group"] for d in daemons})
            and all(m["status"] == "healthy" for m in members)
            and all(d["serving"] for d in daemons)
            and all(self.engine_primary_status(p["url"]) == 200 for p in primaries)
        )

    def wait_up(self, timeout: float = 120.0, what: str = "the ready summary") -> None:
        """Wait for ``up``'s ready summary ("is up"); past ``timeout``, or once the controller has exited, raise
        with the tail of its log (what it was waiting for)."""

        def up() -> bool:
            if self.controller is not None and self.controller.poll() is not None:
                raise RuntimeError(f"controller exited with {self.controller.returncode}:\n{self.logs()}")
            return "is up" in self.logs()

        try:
            wait_until(up, timeout, what, interval=0.1)
        except TimeoutError as late:
            raise TimeoutError(f"{late}; the controller's log ends:\n{self.logs()}") from None

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
        return [process.pid for _, process in read_state(self.config.state_file).processes()]

    # --- teardown ---------------------------------------------------------------------------------

    def down(self) -> subprocess.CompletedProcess[str]:
        """``hotweights down`` of this stack, to its end (what it printed, its exit status)."""
        command = hotweights_command("down", "--config", str(self.config_path))
        return subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=180)

    def pids_naming_root(self) -> list[int]:
        """Every process whose command line names this stack's directory: also those the state file
        no longer records (a test may have made orphans on purpose)."""
        return pids_naming(str(self.root))

    def close(self) -> None:
        """Kill the controller, stop everything the state file records, SIGKILL any leftover."""
        with contextlib.suppress(Exception):
            if self.controller is not None and self.controller.poll() is None:
                self.kill_controller()
        with contextlib.suppress(Exception):
            stop_everything(self.config, timeout=5.0)
        recorded = []
        with contextlib.suppress(ConfigError):  # a test may have left a state file we cannot read
            recorded = self.recorded_pids()
        for pid in {*recorded, *self.pids_naming_root()}:
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(pid) == pid:  # a group leader (an engine behind an agent): its children too
                    os.killpg(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
        self.client.close()
        self.anonymous.close()
        shutil.rmtree(self.root, ignore_errors=True)


@contextlib.contextmanager
def running_on_a_thread(worker: T, join_timeout_s: float) -> Iterator[T]:
    """``async with worker.running()`` (a chaos load or detector) on an event loop of its own thread, for
    the ``with`` block's duration."""
    stop = threading.Event()

    async def run() -> None:
        async with worker.running():  # type: ignore[attr-defined]
            await asyncio.to_thread(stop.wait)

    thread = threading.Thread(target=asyncio.run, args=(run(),), daemon=True)
    thread.start()
    try:
        yield worker
    finally:
        stop.set()
        thread.join(timeout=join_timeout_s)


def split_brain_watch(urls: list[str]) -> contextlib.AbstractContextManager[SplitBrainDetector]:
    """chaos.splitbrain's detector (every engine's /primary every 10 ms) on a thread of its own."""
    return running_on_a_thread(SplitBrainDetector(urls), 10)


def gateway_load(url: str, rps: float, also: tuple[str, ...] = ()) -> contextlib.AbstractContextManager[LoadGenerator]:
    """chaos.load's open-loop load (``rps`` completions a second) through ``url``, on a thread of its own;
    every answer is checked against the completion the cluster gave before (or one of ``also``)."""
    reference = wait_until(lambda: _completion(url), 60, "a first completion through the gateway")
    return running_on_a_thread(LoadGenerator(url, rps, reference, also=also), 60)


def completion_text(url: str) -> str:
    """The greedy completion ``url`` gives now; HTTPStatusError unless it answers 200."""
    response = httpx.post(url + Endpoint.COMPLETIONS, json=completion_body(), timeout=30)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def _completion(url: str) -> str | None:
    with contextlib.suppress(httpx.HTTPStatusError):
        return completion_text(url)
    return None
