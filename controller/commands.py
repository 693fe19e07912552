"""``hotweights controller``, ``up``, ``down`` and ``rollout``: run the controller, run the whole stack, stop it,
restart a group's engines one at a time through the running controller.

What stops when (SIGTERM or Ctrl-C):

- ``controller``: the HA loop and the REST API stop; daemons, engines and gateway keep serving
  (the data path never depends on the controller) and the next controller adopts them.
- ``up`` owns the stack: the gateway, then the engines (SIGTERM, in-flight requests finish,
  SIGKILL after a deadline), then the daemons; a second Ctrl-C SIGKILLs what is left.

Both take SIGINT and SIGTERM from their first instant (``hotweights.cli`` records them before this module is
imported): one that comes before anything started (while the configuration, the ports and the model are checked,
``controller.preflight``) ends the command at once, with nothing started or adopted. ``up`` also stops its stack,
and exits 2 with one line (``GaveUp``), once a slot failed to start the same way ``decide.GIVE_UP_AFTER`` times
in a row (``controller.startfailures``).

``down`` stops everything recorded in the state dir: the controller first (so it restarts nothing),
then the gateway, the engines and the daemons. Signal handlers only set flags; the code after
the server returns does the work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import httpx
import uvicorn

from hotweights.contract import Endpoint, Role
from hotweights.controller.api import build_app
from hotweights.controller.checks import Stopped
from hotweights.controller.cluster import Cluster
from hotweights.controller.clusterctl import controller_client, controller_url
from hotweights.controller.config import ClusterConfig, load_config
from hotweights.controller.dcs import leadership
from hotweights.controller.decide import GiveUp
from hotweights.controller.engineapi import EngineApi
from hotweights.controller.events import EventLog
from hotweights.controller.ha import Ha
from hotweights.controller.health import HealthChecker
from hotweights.controller.metrics import ControllerMetrics
from hotweights.controller.preflight import preflight
from hotweights.controller.snapshot import Snapshot
from hotweights.controller.sockets import remove_dead_sockets, run_dir
from hotweights.controller.stack import Layout, controller_lock
from hotweights.controller.statedir import StateDirHealth
from hotweights.controller.supervisor import (
    STOP_TIMEOUT_S,
    ControllerLock,
    controller_holding,
    stack_marker,
    stop_leftovers,
    stop_recorded,
)
from hotweights.errors import ConfigError, HotweightsError
from hotweights.eventkinds import EventKind
from hotweights.httpguard import ErrorShape, HttpLimits, server_config
from hotweights.limits import raise_open_files
from hotweights.paths import private_dir
from hotweights.state import ClusterState, ServiceKind, StateCorrupt, read_state, write_state

log = logging.getLogger(__name__)

CONTROLLER_STOP_TIMEOUT_S = 60.0  # `down` waits this long for a controller (an `up` tears its stack down first)
FOLLOW_S = 0.5  # how often `rollout` asks for new events while the controller works


class ApiServer(uvicorn.Server):
    """uvicorn without its own signal handlers: ours set flags and the controller decides what stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class GaveUp(HotweightsError):
    """``up`` stopped its stack: a slot kept failing to start the same way (``controller.startfailures``)."""


@dataclass
class ShutdownFlags:
    """SIGINT and SIGTERM for the controller's whole life, from before its configuration is read until
    the process exits; the handlers only set flags and the code that runs next acts on them. ``give_up``
    ends the API server as a first signal does, with the reason kept for the exit."""

    server: uvicorn.Server | None = None  # the API server, once there is one
    signals: list[int] = field(default_factory=list)  # ``hotweights.cli``'s, with those it recorded
    force: asyncio.Event | None = None  # set by a second signal, once the event loop runs
    gave_up: str | None = None  # why ``up`` stopped its stack on its own

    def stopped(self) -> bool:
        """Whether a signal asked to stop (``controller.checks``' question, while nothing is started)."""
        return bool(self.signals)

    def give_up(self, decision: GiveUp) -> None:
        """Stop as on a first signal, for ``decision`` (``controller.startfailures``)."""
        self.gave_up = decision.sentence
        if self.server is not None:
            self.server.should_exit = True

    def capture(self) -> None:
        """Route both signals here until the event loop takes them over."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda sig, _frame: self.handle(sig))

    def attach(self, loop: asyncio.AbstractEventLoop, server: uvicorn.Server) -> None:
        """The loop's handlers call ``handle`` from now on; a signal that came before stops the server at once."""
        self.server, self.force = server, asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.handle, sig)
        if self.signals:
            server.should_exit = True
        if len(self.signals) > 1:
            self.force.set()

    def detach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Back to ``capture``'s handlers before the loop closes: asyncio closes its wake-up pipe before it
        removes its own handlers, and a signal in between is written to a closed descriptor (a traceback)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
        self.force = None
        self.capture()

    def handle(self, sig: int) -> None:
        """Only flags: the first signal ends the API server, a second one asks for SIGKILL of what is
        left (and stops waiting for the API's open connections)."""
        if self.signals and self.force is not None:
            self.force.set()
        self.signals.append(sig)
        if self.server is not None:
            self.server.should_exit = True
            self.server.force_exit = len(self.signals) > 1


def bind(host: str, port: int) -> socket.socket:
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
    except OSError as exc:
        listener.close()
        raise ConfigError(f"the controller cannot listen on {host}:{port} ({exc.strerror}); set cluster.port") from None
    return listener


def run_controller(config_arg: str | None, *, with_gateway: bool, owns_stack: bool, signals: list[int]) -> int:
    """Run until SIGINT or SIGTERM, which may come at any moment: before anything started (nothing is then
    started or adopted; ``signals``: those recorded since the command's first instant, taken over), during the
    start-up, adoption or the stop itself (a second one escalates). ConfigError before anything starts
    (``controller.preflight``); GaveUp after ``up`` stopped its stack on its own."""
    flags = ShutdownFlags(signals=signals)
    flags.capture()
    try:
        config_path = Path(config_arg) if config_arg else None
        config = load_config(config_path)
        raise_open_files(config.open_files_needed(), f"cluster {config.cluster.name!r}", config.open_files_wanted())
        layout = Layout.create(config, config_path, flags.stopped)
        lock = ControllerLock(layout.lock_file)
        lock.acquire()
        try:
            with contextlib.closing(bind(config.cluster.host, config.cluster.port)) as listener:
                if not flags.stopped():
                    preflight(layout, with_gateway, flags.stopped)
                asyncio.run(serve(layout, listener, flags, with_gateway=with_gateway, owns_stack=owns_stack))
        finally:
            lock.release()
    except Stopped:
        log.info("stopped by signal %d before starting or adopting anything", flags.signals[0])
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):  # all stopped: nothing left to act on while the process exits
            signal.signal(sig, signal.SIG_IGN)
    if flags.gave_up is not None:
        raise GaveUp(f"gave up: {flags.gave_up}; stopped everything it started")
    return 0


async def until_forced(work: Awaitable[None], flags: ShutdownFlags) -> None:
    """Await ``work``, cancelled by a second signal (the stop then kills what is left)."""
    assert flags.force is not None
    task, forced = asyncio.ensure_future(work), asyncio.create_task(flags.force.wait())
    await asyncio.wait({task, forced}, return_when=asyncio.FIRST_COMPLETED)
    forced.cancel()
    if not task.done():
        log.warning("second signal: not waiting for the HA loop's actions in progress")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def serve(
    layout: Layout, listener: socket.socket, flags: ShutdownFlags, *, with_gateway: bool, owns_stack: bool
) -> int:
    config = layout.config
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per health check would drown the decisions
    wake = asyncio.Event()
    metrics = ControllerMetrics()
    events = EventLog(layout.events_file, health=StateDirHealth(layout.state_dir, metrics))
    async with httpx.AsyncClient(trust_env=False) as client:
        checker = HealthChecker(
            client,
            config.health.interval_ms / 1000,
            config.health.timeout_ms / 1000,
            config.health.failure_threshold,
            wake.set,
            metrics.health_check_latency.observe,
        )
        engines = EngineApi(client, config.token())
        cluster = Cluster(layout, checker, wake.set, engines, events)
        on_ready = partial(announce, layout, with_gateway)
        leader_keys = leadership(config, client, engines, layout)
        await leader_keys.start(wake.set)  # ConfigError: etcd out of reach, or its prefix is another cluster's
        on_give_up = flags.give_up if owns_stack else None
        ha = Ha(cluster, engines, events, metrics, wake, on_ready, leader_keys, on_give_up)
        app = build_app(ha, cluster, events, metrics, config.token())
        limits = HttpLimits(body_bytes=config.cluster.api_max_body_bytes)
        server = ApiServer(server_config(app, limits, ErrorShape.DETAIL, lifespan="off"))
        flags.attach(asyncio.get_running_loop(), server)
        try:
            if flags.signals:
                log.info("stopped by signal %d before starting or adopting anything", flags.signals[0])
                await leader_keys.stop(revoke=False)
                return 0
            adopted = cluster.load(with_gateway)
            events.record(
                EventKind.CONTROLLER_START,
                f"controller started; adopted {len(adopted)} running process(es)"
                + (f": {', '.join(adopted)}" if adopted else ""),
                adopted=adopted,
            )
            ha.start()
            await server.serve(sockets=[listener])
            await until_forced(ha.stop(), flags)
            if owns_stack:
                for line in await stop_stack(cluster, flags):
                    log.info("stopped %s", line)
                events.record(EventKind.CONTROLLER_STOP, "controller stopped with its stack")
            else:
                await cluster.release()
                kept = ", ".join(sorted(cluster.members) + sorted(cluster.services))
                log.info("controller stopped; left the data path running (%s); `hotweights down` stops it", kept)
                events.record(EventKind.CONTROLLER_STOP, "controller stopped; the data path keeps running")
            await leader_keys.stop(revoke=owns_stack)
        finally:
            flags.detach(asyncio.get_running_loop())
    return 0


async def stop_stack(cluster: Cluster, flags: ShutdownFlags) -> list[str]:
    """Stop everything in order; a second signal fences (SIGKILLs) whatever is still running."""
    stopping = asyncio.create_task(cluster.stop_all(STOP_TIMEOUT_S))
    assert flags.force is not None
    forced = asyncio.create_task(flags.force.wait())
    await asyncio.wait({stopping, forced}, return_when=asyncio.FIRST_COMPLETED)
    forced.cancel()
    if stopping.done():
        return stopping.result()
    log.warning("second signal: killing what is still running")
    stopping.cancel()
    processes = list(cluster.supervisor.processes.values())
    await asyncio.gather(*(cluster.supervisor.fence(p) for p in processes))
    cluster.save()
    return [f"{p.id}: killed" for p in processes]


def announce(layout: Layout, with_gateway: bool, snap: Snapshot) -> None:
    """The "ready" summary on stderr, printed once when every group first has a primary and warm standbys."""
    config = layout.config
    lines = [f"hotweights: cluster {config.cluster.name!r} is up"]
    lines.append(f"  controller  http://{config.cluster.host}:{config.cluster.port}   (API docs /docs, events /events)")
    if with_gateway:
        lines.append(f"  gateway     http://{config.gateway.host}:{config.gateway.port}/v1   (OpenAI completions)")
    for member in snap.members:
        lines.append(f"  {member.id:<10}  {member.url}   {member.role} (pid {member.pid})")
    lines.append(f"  state       {layout.state_dir}")
    print("\n".join(lines), file=sys.stderr, flush=True)


def stop_everything(config: ClusterConfig, timeout: float, config_path: Path | None = None) -> list[str]:
    """``down``: the controller first (so it restarts nothing; ``up``'s stops its stack itself), found by
    state.json or by the lock it holds; then the gateway, the engines and the daemons recorded in state.json; then
    every other process of the stack, whatever state.json says (stale, missing, corrupt: ``stack_orphans``, e.g.
    a warming spare, or an engine started while state.json could not be written); then the sockets they left.

    A corrupt state.json records nothing to go by: it is moved aside. A state dir that takes no writes
    stops nothing from being stopped (the records are then left as they are, naming dead processes)."""
    state = _recorded_state(config.state_file)
    lines = []
    controllers = [state.controller, controller_holding(controller_lock(config.state_dir))]
    if running := [("controller", record) for record in dict.fromkeys(controllers) if record is not None]:
        lines += stop_recorded(running, CONTROLLER_STOP_TIMEOUT_S)
        state = _recorded_state(config.state_file)  # the controller rewrote it on its way out
    kinds = {name: row.kind for name, row in state.services.items()}
    processes = state.processes()
    for batch in (
        [(name, p) for name, p in processes if kinds.get(name) == ServiceKind.GATEWAY],
        [(name, p) for name, p in processes if name in state.members or kinds.get(name) == ServiceKind.BATCH],
        [(name, p) for name, p in processes if kinds.get(name) == ServiceKind.DAEMON],
    ):
        lines += stop_recorded(batch, timeout)
    markers = [str(config.state_dir), *([str(config_path.resolve())] if config_path else [])]
    lines += stop_leftovers(stack_marker(config.state_dir), markers, timeout)
    remove_dead_sockets(run_dir(config.state_dir))
    if processes and config.state_file.exists():
        members = {name: replace(row, process=None, role=Role.STANDBY) for name, row in state.members.items()}
        services = {name: replace(row, process=None) for name, row in state.services.items()}
        try:
            write_state(config.state_file, replace(state, controller=None, members=members, services=services))
        except OSError as exc:
            log.warning("%s keeps naming the stopped processes (cannot write it: %s)", config.state_file, exc.strerror)
    return lines


def _recorded_state(path: Path) -> ClusterState:
    """state.json for ``down``; an empty state when it is missing or corrupt (moved aside, when it can be)."""
    try:
        return read_state(path)
    except StateCorrupt as exc:
        aside = path.with_name(path.name + ".corrupt")
        with contextlib.suppress(OSError):
            path.replace(aside)
        log.warning("%s; moved it to %s and stopping the stack's processes found in /proc", exc, aside)
        return ClusterState()


def cmd_controller(args: argparse.Namespace) -> int:
    return run_controller(args.config, with_gateway=False, owns_stack=False, signals=args.signals)


def cmd_up(args: argparse.Namespace) -> int:
    return run_controller(args.config, with_gateway=not args.no_gateway, owns_stack=True, signals=args.signals)


def cmd_down(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    if config.state_dir.exists():  # its state.json names the processes to signal: only ours may write it
        private_dir(config.state_dir, "state directory")
    lines = stop_everything(config, args.timeout, Path(args.config) if args.config else None)
    for line in lines:
        print(line, file=sys.stderr)
    if not lines:
        print(f"nothing was running for cluster {config.cluster.name!r} ({config.state_dir})", file=sys.stderr)
    return 0


def print_new_events(client: httpx.Client, after: int) -> int:
    """Print the ``rollout`` events newer than sequence number ``after``; returns the newest one's."""
    for event in client.get(Endpoint.EVENTS, params={"kind": EventKind.ROLLOUT}).json()["events"]:
        if event["seq"] > after:
            print(f"{event['time']}  {event['message']}", flush=True)
            after = event["seq"]
    return after


def cmd_rollout(args: argparse.Namespace) -> int:
    """POST /rollout and print each step as the controller records it: 0 done, 1 the rollout failed (or the
    controller did not answer), 2 refused up front (nothing restarted)."""
    config = load_config(args.config)
    body = {} if args.group is None else {"group": args.group}
    if args.model:
        body["model"] = str(Path(args.model).expanduser().resolve())  # the controller's cwd is not ours
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per poll would drown the steps
    try:
        with controller_client(controller_url(config), config.token()) as client, ThreadPoolExecutor(1) as pool:
            latest = client.get(Endpoint.EVENTS, params={"limit": 1}).json()["events"]
            seen = latest[-1]["seq"] if latest else 0
            reply = pool.submit(client.post, Endpoint.ROLLOUT, json=body)
            while True:
                try:
                    response = reply.result(timeout=FOLLOW_S)
                    break
                except FutureTimeout:
                    seen = print_new_events(client, seen)
            print_new_events(client, seen)
    except httpx.HTTPError as exc:
        print(f"hotweights rollout: the controller at {config.cluster.host}:{config.cluster.port} did not answer "
              f"({exc}); is it running (`hotweights controller --config ...`)?", file=sys.stderr)  # fmt: skip
        return 1
    if response.status_code == 200:
        print(response.json()["message"])
        return 0
    print(f"hotweights rollout: {response.status_code}: {response.json().get('detail')}", file=sys.stderr)
    return 1 if response.status_code == 503 else 2


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "controller",
        help="supervise a cluster's cache daemons and engines, fail over, serve the REST API",
        description="Start (or adopt, after a restart) one cache daemon per group and its engines, health-check "
        "them, fence and promote on failure. SIGTERM stops only the controller: the engines keep serving.",
    )
    p.add_argument("--config", required=True, help="cluster.toml")
    p.set_defaults(func=cmd_controller)

    p = subparsers.add_parser(
        "up",
        help="run the whole stack in the foreground: controller, daemons, engines, gateway",
        description="Like `controller`, plus the gateway; owns the stack, so Ctrl-C or SIGTERM stops all of it. "
        "Without --config: the embedded tiny model on CPU, one primary and two standbys.",
    )
    p.add_argument("--config", help="cluster.toml (default: built-in defaults)")
    p.add_argument("--no-gateway", action="store_true", help="do not start the gateway")
    p.set_defaults(func=cmd_up)

    p = subparsers.add_parser(
        "down",
        help="stop everything a controller or `up` started for a cluster",
        description="Stop the controller, then the gateway, the engines (SIGTERM, then SIGKILL after --timeout) "
        "and the cache daemons recorded in the cluster's state dir.",
    )
    p.add_argument("--config", help="cluster.toml (default: built-in defaults)")
    p.add_argument("--timeout", type=float, default=STOP_TIMEOUT_S, help="seconds before SIGKILL (default %(default)g)")
    p.set_defaults(func=cmd_down)

    p = subparsers.add_parser(
        "rollout",
        help="restart a group's engines one at a time through the running controller (new engine settings too)",
        description="Standbys first, then a switchover to a restarted standby, then the old primary; each step "
        "waits until the engine is ready. Engine settings changed in cluster.toml are taken on. Exit 0 done, "
        "1 a step failed (the group keeps serving), 2 refused (nothing restarted).",
    )
    p.add_argument("--config", help="cluster.toml (default: built-in defaults)")
    p.add_argument("--group", type=int, help="the failover group (default 0)")
    p.add_argument(
        "--model",
        metavar="DIR",
        help="a model update: load this checkpoint into a second arena while the old one serves, restart the "
        "engines onto it (the switchover changes the answers, once), then free the old arena; refused up front "
        "when it is invalid or does not fit beside the old one",
    )
    p.set_defaults(func=cmd_rollout)
