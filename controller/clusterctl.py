"""``hotweights status``, ``switchover``, ``failover``, ``drain`` and ``cache restart``: the cluster CLI, a client of
the running controller's REST API (what ``patronictl list``, ``switchover`` and ``failover`` are to Patroni).

The controller's address and token come from ``--config`` (``cluster.host``, ``cluster.port``,
``cluster.token_file``), or from ``--url`` and ``--token-file``, which win. A ``--url`` that is not an
``http(s)://HOST:PORT`` URL, and a token file that is not one line of visible characters, are refused (exit 2);
a controller that refuses the connection, cannot be reached within CONNECT_TIMEOUT_S or does not answer a read
within READ_TIMEOUT_S has not answered (exit 1). Every action first asks (``--yes``
answers for the operator; no answer on stdin, EOF, is a no), then waits for the outcome and prints it in one line.

Exit status, every command:

====  ==========================================================================================================
0     done (``status``: the cluster was read and printed)
1     tried and failed, or the outcome is unknown: the controller answered 503 (an engine or the HA loop did not
      answer, a step failed; the group keeps serving), did not answer at all, or a restarted daemon did not serve
      within ``--timeout``
2     nothing was done: the controller refused (a 4xx: no such engine, no ready standby ...; its one-line reason
      is printed), the question was answered no, or the command line or the configuration is wrong
====  ==========================================================================================================
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import httpx

from hotweights.contract import Endpoint, Role, State, read_token
from hotweights.controller.config import ClusterConfig, load_config
from hotweights.controller.graydecide import last_gray_failure
from hotweights.errors import ConfigError
from hotweights.eventkinds import EventField, EventKind, FailoverKind
from hotweights.standby.kvpool import cells
from hotweights.waiting import wait_until

WATCH_INTERVAL_S = 2.0  # how often `status --watch` refreshes unless told
EVENTS_POLL_S = 0.25  # how often `cache restart` asks for new events while the daemon restarts
DAEMON_WAIT_S = 600.0  # how long `cache restart` waits for the new daemon to serve (a fill from disk may be slow)
EVENTS_WINDOW = 1000  # the most events one GET /events returns
CONNECT_TIMEOUT_S = 5.0  # a controller that takes longer to accept the connection (unroutable) did not answer
READ_TIMEOUT_S = 30.0  # a controller that takes longer to answer a read (GET) did not answer
READ_TIMEOUT = httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
CLEAR_SCREEN = "\x1b[H\x1b[2J"


class Exit(IntEnum):
    """The cluster CLI's exit statuses (the module docstring says when each)."""

    DONE = 0
    FAILED = 1
    REFUSED = 2


def exit_for(status_code: int) -> Exit:
    """The exit status for the controller's answer: 2xx done, 5xx (503) failed, 4xx refused."""
    if status_code < 300:
        return Exit.DONE
    return Exit.FAILED if status_code >= 500 else Exit.REFUSED


def reason(body: Any) -> str:
    """The API's reason in one line: its ``detail`` string, a validation error's first complaint, else the body."""
    detail = body.get("detail", body) if isinstance(body, dict) else body
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):  # FastAPI's 422
        first = detail[0]
        return f"{'.'.join(str(part) for part in first.get('loc', []))}: {first.get('msg')}"
    return detail if isinstance(detail, str) else json.dumps(detail)


# --- the controller's address, and a client of it ---------------------------------------------------------------


def controller_url(config: ClusterConfig) -> str:
    """Where a client on this host reaches the controller (a wildcard listen address is reached on loopback)."""
    host = "127.0.0.1" if config.cluster.host in ("0.0.0.0", "::") else config.cluster.host
    return f"http://{host}:{config.cluster.port}"


def controller_client(url: str, token: str | None) -> httpx.Client:
    """A client of the controller at ``url``, with its bearer token if any; CONNECT_TIMEOUT_S to connect, no other
    timeout (the controller bounds each action itself; a read passes its own)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.Client(
        base_url=url, headers=headers, timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S), trust_env=False
    )


def checked_url(url: str) -> str:
    """``--url`` without a trailing slash; ConfigError unless it is an ``http(s)://HOST:PORT`` URL (a path after it
    is kept: a proxy may serve the controller under one)."""
    if problem := url_problem(url):
        raise ConfigError(f"--url {url!r}: {problem}; expected http(s)://HOST:PORT, e.g. http://10.0.0.1:8100")
    return url.rstrip("/")


def url_problem(url: str) -> str | None:
    """What keeps ``url`` from being a controller's address, or None."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # ValueError: out of range, or not a number
        httpx.URL(url)
    except (ValueError, httpx.InvalidURL) as exc:
        return str(exc)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        return "not an http(s)://HOST:PORT URL"
    return "port 0" if port == 0 else None


@dataclass(frozen=True)
class Target:
    """The controller a command talks to."""

    url: str
    token: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Target:
        """``--url``/``--token-file`` where given, else ``--config``'s (ConfigError: an unreadable file)."""
        url = checked_url(args.url) if args.url else None
        if url and args.token_file:
            return cls(url, read_token(Path(args.token_file), "--token-file"))
        config = load_config(args.config)
        token = read_token(Path(args.token_file), "--token-file") if args.token_file else config.token()
        return cls(url or controller_url(config), token)


class Unanswered(Exception):
    """The controller did not answer; the message says where it was looked for."""


class Api:
    """The few calls the cluster CLI makes."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.client = controller_client(target.url, target.token)

    def get(self, path: str, **params: Any) -> Any:
        response = self._send("GET", path, params=params, timeout=READ_TIMEOUT)
        if response.status_code != 200:
            raise Unanswered(f"GET {path} answered {response.status_code}: {reason(self._json(response))}")
        return self._json(response)

    def post(self, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
        response = self._send("POST", path, json=body)
        return response.status_code, self._json(response)

    def last_seq(self) -> int:
        events = self.get(Endpoint.EVENTS, limit=1)["events"]
        return events[-1]["seq"] if events else 0

    def events_after(self, seq: int) -> list[dict[str, Any]]:
        return [e for e in self.get(Endpoint.EVENTS, limit=EVENTS_WINDOW)["events"] if e["seq"] > seq]

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            why = str(exc) or type(exc).__name__  # a timeout's text may be empty
            raise Unanswered(f"the controller at {self.target.url} did not answer ({why}); is it running?") from None

    @staticmethod
    def _json(response: httpx.Response) -> Any:
        try:
            return response.json()
        except ValueError:
            return {"detail": response.text.strip()[:200] or f"HTTP {response.status_code}"}

    def close(self) -> None:
        self.client.close()


# --- status: one table per group ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineRow:
    id: str
    role: str
    state: str
    health: str  # the controller's status of it, with failed checks in a row
    pid: int | None
    generation: int
    weights: str  # where its weights came from (the engine's weight_cache source)
    url: str
    kv_pool: tuple[str, str, str] = ("-", "-", "-")  # KV, RUN, WAIT: a reference engine's (``kvpool.cells``)


@dataclass(frozen=True)
class LastFailover:
    kind: FailoverKind
    time: str
    old: str | None
    new: str | None
    total_ms: float | None


@dataclass(frozen=True)
class GroupStatus:
    group: int
    generation: int
    model: str
    standbys_ready: int
    standbys_wanted: int
    spares_ready: int
    spares_wanted: int
    degraded_s: float | None  # None: not degraded
    alert: bool
    reason: str | None
    daemon: str
    last_failover: LastFailover | None
    engines: list[EngineRow]
    gray: str | None = None  # the last gray failure (``graydecide.last_gray_failure``)


def engine_row(member: dict[str, Any]) -> EngineRow:
    failures = member.get("consecutive_failures") or 0
    health = member["status"] + (f" ({failures} failed)" if failures else "")
    body = (member.get("health") or {}).get("body") or {}
    weights = (body.get("weight_cache") or {}).get("source") or "-"
    return EngineRow(
        member["id"], member["role"], member["state"], health, member["pid"], member.get("generation", 0), weights,
        member["url"], cells(body.get("kv_pool")),
    )  # fmt: skip


def daemon_summary(services: list[dict[str, Any]], group: int) -> str:
    """The group's current cache daemon(s) in a few words each."""
    daemons = [s for s in services if s["kind"] == "daemon" and s["group"] == group and s.get("current", True)]
    words = []
    for daemon in daemons:
        condition = "serving" if daemon["serving"] else "restarting" if daemon["restarting"] else "down"
        count = daemon["restarts"]
        restarts = f", {count} restart{'s' if count != 1 else ''}" if count else ""
        words.append(f"{daemon['id']} pid {daemon['pid']} {condition}{restarts}")
    return "; ".join(words) or "none"


def last_failover(events: list[dict[str, Any]], group: int) -> LastFailover | None:
    """The group's newest ``failover`` or ``switchover`` event."""
    moves = (EventKind.FAILOVER, EventKind.SWITCHOVER)
    mine = [e for e in events if e["kind"] in moves and e.get(EventField.GROUP) == group]
    if not mine:
        return None
    event = max(mine, key=lambda e: e["seq"])
    kind = (
        FailoverKind(event.get(EventField.MODE, FailoverKind.SWITCHOVER))
        if event["kind"] == EventKind.FAILOVER
        else FailoverKind.SWITCHOVER
    )
    old, new, total_ms = (event.get(f) for f in (EventField.OLD, EventField.NEW, EventField.TOTAL_MS))
    return LastFailover(kind, event["time"], old, new, total_ms)


def unassessed(cluster: dict[str, Any], group: int) -> dict[str, Any]:
    """A redundancy row for a group the controller has not assessed yet (its first cycle is still to come)."""
    engines = sum(m["group"] == group for m in cluster["members"])
    return {
        "standbys_ready": 0, "standbys_wanted": engines - 1, "spares_ready": 0, "spares_wanted": 0, "degraded": False,
        "degraded_s": 0.0, "alert": False, "reason": "not assessed yet",
    }  # fmt: skip


def summarize(cluster: dict[str, Any], events: list[dict[str, Any]]) -> list[GroupStatus]:
    """One ``GroupStatus`` per group of ``GET /cluster`` (from its ``redundancy`` rows), with the last failovers
    from ``events``."""
    rows = {row["group"]: row for row in cluster["redundancy"]}
    groups = sorted(rows.keys() | {m["group"] for m in cluster["members"]})
    return [group_status(cluster, events, group, rows.get(group) or unassessed(cluster, group)) for group in groups]


def group_status(cluster: dict[str, Any], events: list[dict[str, Any]], group: int, row: dict) -> GroupStatus:
    generation = next((g for g in cluster.get("generations", []) if g["group"] == group), {})
    return GroupStatus(
        group=group,
        generation=generation.get("generation", 0),
        model=Path(generation.get("model", "")).name,
        standbys_ready=row["standbys_ready"],
        standbys_wanted=row["standbys_wanted"],
        spares_ready=row["spares_ready"],
        spares_wanted=row["spares_wanted"],
        degraded_s=row["degraded_s"] if row["degraded"] else None,
        alert=row["alert"],
        reason=row["reason"],
        daemon=daemon_summary(cluster["services"], group),
        last_failover=last_failover(events, group),
        engines=[engine_row(m) for m in cluster["members"] if m["group"] == group],
        gray=last_gray_failure(events, group),
    )


COLUMNS = ("ENGINE", "ROLE", "STATE", "HEALTH", "PID", "GEN", "WEIGHTS", "KV", "RUN", "WAIT", "URL")


def render_group(status: GroupStatus) -> list[str]:
    """The group's heading, its redundancy and last failover, then a row per engine."""
    lines = [
        f"group {status.group}  generation {status.generation} ({status.model or '?'})  "
        f"standbys {status.standbys_ready}/{status.standbys_wanted} ready  "
        f"spares {status.spares_ready}/{status.spares_wanted} ready  daemon {status.daemon}"
    ]
    if status.degraded_s is not None:
        alert = "ALERT: " if status.alert else ""
        lines.append(f"  {alert}degraded for {status.degraded_s:.1f} s: {status.reason}")
    elif status.reason:
        lines.append(f"  not full yet: {status.reason}")
    if status.last_failover is not None:
        last = status.last_failover
        took = f" in {last.total_ms:g} ms" if last.total_ms is not None else ""
        lines.append(f"  last failover: {last.kind} {last.old or '-'} -> {last.new or '-'}{took} at {last.time}")
    if status.gray is not None:
        lines.append(f"  last gray failure: {status.gray}")
    rows = [COLUMNS] + [
        (e.id, e.role, e.state, e.health, str(e.pid or "-"), str(e.generation), e.weights, *e.kv_pool, e.url)
        for e in status.engines
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return lines


def render(cluster: dict[str, Any], groups: list[GroupStatus], url: str) -> str:
    mode = (cluster.get("dcs") or {}).get("mode", "single-host")
    lines = [f"cluster {cluster['name']!r} ({mode}), controller {url}"]
    for status in groups:
        lines += ["", *render_group(status)]
    seeding = (cluster.get("dcs") or {}).get("seeding")
    if seeding:
        lines += ["", "seeding (every host's daemons)", *(render_seed(record) for record in seeding)]
    return "\n".join(lines)


def render_seed(record: dict[str, Any]) -> str:
    """One daemon's seeding record (``controller.seedplacement.SeedRecord``): a source, or a copy's progress."""
    where = f"  {record['host']} g{record['group']} r{record['rank']} {record['address']}: {record['state']}"
    if record["state"] != "seeding":
        return where + (f" ({record['fingerprint']})" if record["fingerprint"] else "")
    done, total = record["bytes_done"], max(record["bytes_total"], 1)
    return (f"{where} from {record['source']} {100 * done / total:.0f}% ({done / 1e9:.2f} of {total / 1e9:.2f} GB) "
            f"at {record['rate_gbps']:.2f} GB/s")  # fmt: skip


def read_status(api: Api, group: int | None) -> tuple[dict[str, Any], list[GroupStatus]]:
    cluster = api.get("/cluster")
    events = api.get(Endpoint.EVENTS, limit=EVENTS_WINDOW)["events"]
    groups = [g for g in summarize(cluster, events) if group is None or g.group == group]
    return cluster, groups


def show_status(api: Api, args: argparse.Namespace) -> Exit:
    cluster, groups = read_status(api, args.group)
    if args.group is not None and not groups:
        print(f"hotweights status: no group {args.group} in cluster {cluster['name']!r}", file=sys.stderr)
        return Exit.REFUSED
    if args.json:
        print(json.dumps({"name": cluster["name"], "dcs": cluster.get("dcs"), "groups": [asdict(g) for g in groups]}))
    else:
        print(render(cluster, groups, api.target.url), flush=True)
    return Exit.DONE


def watch_status(api: Api, args: argparse.Namespace) -> Exit:
    """Refresh every ``--watch`` seconds until Ctrl-C (exit 0); a controller that does not answer is reported on
    each refresh, not fatal."""
    clear = sys.stdout.isatty() and not args.json
    with contextlib.suppress(KeyboardInterrupt):
        while True:
            print(CLEAR_SCREEN if clear else "", end="")
            try:
                show_status(api, args)
            except Unanswered as exc:
                print(f"{time.strftime('%H:%M:%S')} {exc}", flush=True)
            time.sleep(args.watch)
    return Exit.DONE


def cmd_status(api: Api, args: argparse.Namespace) -> Exit:
    return watch_status(api, args) if args.watch else show_status(api, args)


# --- actions: ask, do, wait, one line -----------------------------------------------------------------------------


def confirm(question: str, assume_yes: bool) -> bool:
    """Ask ``question`` on stderr and read the answer from stdin: only y or yes is a yes (EOF is a no)."""
    if assume_yes:
        return True
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


def primary_of(cluster: dict[str, Any], group: int) -> str:
    primaries = [m["id"] for m in cluster["members"] if m["group"] == group and m["role"] == Role.PRIMARY]
    return primaries[0] if primaries else "no primary"


def group_of(cluster: dict[str, Any], engine: str) -> int | None:
    return next((m["group"] for m in cluster["members"] if m["id"] == engine), None)


def ready_standbys(cluster: dict[str, Any]) -> str:
    """Every group's ready standbys, for a refusal that asks the operator to name one."""
    ready = [
        m["id"]
        for m in cluster["members"]
        if m["role"] == Role.STANDBY and m["state"] == State.READY and m["status"] == "healthy"
    ]
    return ", ".join(ready) or "none"


def act(api: Api, name: str, path: str, body: dict[str, Any] | None) -> tuple[Exit, Any]:
    """POST ``path`` and print its outcome in one line (stdout when done, stderr with ``name`` otherwise)."""
    status, answer = api.post(path, body)
    code = exit_for(status)
    if code == Exit.DONE:
        print(answer.get("message") if isinstance(answer, dict) else answer, flush=True)
    else:
        print(f"hotweights {name}: {reason(answer)}", file=sys.stderr)
    return code, answer


def declined(name: str) -> Exit:
    print(f"hotweights {name}: not confirmed; nothing done (--yes answers for you)", file=sys.stderr)
    return Exit.REFUSED


def cmd_switchover(api: Api, args: argparse.Namespace) -> Exit:
    cluster = api.get("/cluster")
    group = args.group if args.group is not None else group_of(cluster, args.candidate or "") or 0
    to = args.candidate or "the best ready standby"
    if not confirm(f"switch over group {group} from {primary_of(cluster, group)} to {to}?", args.yes):
        return declined("switchover")
    body = {k: v for k, v in (("group", args.group), ("candidate", args.candidate)) if v is not None}
    return act(api, "switchover", "/switchover", body)[0]


def cmd_failover(api: Api, args: argparse.Namespace) -> Exit:
    cluster = api.get("/cluster")
    if args.candidate is None:
        print(
            f"hotweights failover: name the engine to promote with --candidate (ready standbys: "
            f"{ready_standbys(cluster)}); for a planned change without fencing, use `hotweights switchover`",
            file=sys.stderr,
        )
        return Exit.REFUSED
    group = group_of(cluster, args.candidate)
    old = primary_of(cluster, group) if group is not None else "its group's primary"
    question = f"fail over: fence (SIGKILL) {old}, whatever its state, and promote {args.candidate}?"
    if not confirm(question, args.yes):
        return declined("failover")
    return act(api, "failover", "/failover", {"candidate": args.candidate})[0]


def cmd_drain(api: Api, args: argparse.Namespace) -> Exit:
    cluster = api.get("/cluster")
    member = next((m for m in cluster["members"] if m["id"] == args.engine), None)
    what = f"{args.engine} ({member['role']} of group {member['group']})" if member else args.engine
    if not confirm(f"drain {what}: it takes no new requests and finishes those in flight?", args.yes):
        return declined("drain")
    body = {"timeout_s": args.timeout} if args.timeout is not None else None
    return act(api, "drain", f"/engines/{args.engine}/drain", body)[0]


def restarted_daemons(events: list[dict[str, Any]], group: int) -> list[str]:
    restarts = [e for e in events if e["kind"] == EventKind.CACHE_RESTART and e.get(EventField.GROUP) == group]
    return [e[EventField.SERVICE] for e in restarts]


def respawn_outcome(events: list[dict[str, Any]], services: list[str]) -> tuple[list[str], str | None]:
    """The respawn messages of ``services`` seen in ``events`` (all or nothing), and the last failed start's."""
    mine = [e for e in events if e.get(EventField.SERVICE) in services]
    respawned = {e[EventField.SERVICE]: e["message"] for e in mine if e["kind"] == EventKind.RESPAWN}
    failures = [e["message"] for e in mine if e["kind"] == EventKind.START_FAILED]
    done = [respawned[s] for s in services] if services and all(s in respawned for s in services) else []
    return done, failures[-1] if failures else None


def cmd_cache_restart(api: Api, args: argparse.Namespace) -> Exit:
    """POST /cache/G/restart (202: the old daemon stopped), then wait for each new daemon's ``respawn`` event."""
    cluster = api.get("/cluster")
    daemons = daemon_summary(cluster["services"], args.group)
    if not confirm(f"restart group {args.group}'s cache daemon ({daemons}); engines keep serving?", args.yes):
        return declined("cache restart")
    seen = api.last_seq()
    status, answer = api.post(f"/cache/{args.group}/restart")
    if exit_for(status) != Exit.DONE:
        print(f"hotweights cache restart: {reason(answer)}", file=sys.stderr)
        return exit_for(status)
    failures: list[str] = []

    def respawned() -> list[str]:
        events = api.events_after(seen)
        done, failure = respawn_outcome(events, restarted_daemons(events, args.group))
        failures[:] = [failure] if failure else []
        return done

    try:
        done = wait_until(respawned, args.timeout, "the restarted daemon", interval=EVENTS_POLL_S)
    except TimeoutError:
        last = f"; its last start failed: {failures[0]}" if failures else ""
        print(
            f"hotweights cache restart: group {args.group}'s daemon does not serve {args.timeout:g} s after its "
            f"restart{last}; `hotweights status` shows it",
            file=sys.stderr,
        )
        return Exit.FAILED
    print("; ".join(done), flush=True)
    return Exit.DONE


# --- the parsers ---------------------------------------------------------------------------------------------------


def runs(work: Callable[[Api, argparse.Namespace], Exit], name: str) -> Callable[[argparse.Namespace], int]:
    """``work`` with a client of the controller; a controller that does not answer is exit 1, in one line."""

    def run(args: argparse.Namespace) -> int:
        logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request would bury the one that matters
        with contextlib.closing(Api(Target.from_args(args))) as api:
            try:
                return int(work(api, args))
            except Unanswered as exc:
                print(f"hotweights {name}: {exc}", file=sys.stderr)
                return int(Exit.FAILED)

    return run


def target_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="cluster.toml: the controller's cluster.host, cluster.port and cluster.token_file")
    p.add_argument("--url", help="the controller's address, e.g. http://10.0.0.1:8100 (default: from --config)")
    p.add_argument("--token-file", help="the bearer token for actions (default: --config's cluster.token_file)")


def action_parser(subparsers: argparse._SubParsersAction, name: str, text: str) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        name, help=text, description=f"{text}. Asks first (--yes does not); waits for the outcome and prints it in "
        "one line. Exit 0 done, 1 failed or no answer (the cluster keeps serving), 2 refused or not confirmed "
        "(nothing done).",
    )  # fmt: skip
    target_options(p)
    p.add_argument("-y", "--yes", action="store_true", help="do not ask")
    return p


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "status",
        help="the running cluster: a table per group (engines, roles, health, redundancy, daemon, last failover)",
        description="Read the controller's GET /cluster and /events: per group its engines (role, state, health, "
        "pid, weight generation and source), ready standbys against those wanted, spares, the cache daemon and "
        "the last failover with its duration. Exit 0 read, 1 the controller did not answer, 2 bad input.",
    )
    target_options(p)
    p.add_argument("--group", type=int, help="only this failover group")
    p.add_argument("--json", action="store_true", help="one JSON object, for scripts")
    p.add_argument(
        "--watch", nargs="?", type=float, const=WATCH_INTERVAL_S, metavar="SECONDS",
        help=f"refresh every SECONDS (default {WATCH_INTERVAL_S:g}) until Ctrl-C",
    )  # fmt: skip
    p.set_defaults(func=runs(cmd_status, "status"))

    p = action_parser(subparsers, "switchover", "planned change of primary: drain it, promote a ready standby")
    p.add_argument("--group", type=int, help="the failover group (default: the candidate's, else 0)")
    p.add_argument("--candidate", metavar="ENGINE", help="the ready standby to promote (default: the best one)")
    p.set_defaults(func=runs(cmd_switchover, "switchover"))

    p = action_parser(subparsers, "failover", "forced change of primary: fence (SIGKILL) it, promote a standby")
    p.add_argument("--candidate", metavar="ENGINE", help="the ready standby to promote (required)")
    p.set_defaults(func=runs(cmd_failover, "failover"))

    p = action_parser(subparsers, "drain", "drain an engine: no new requests, those in flight finish")
    p.add_argument("engine", metavar="ENGINE", help="the engine's id, e.g. g0-e0")
    p.add_argument("--timeout", type=float, help="seconds in-flight requests may take (default engine.drain_timeout_s)")
    p.set_defaults(func=runs(cmd_drain, "drain"))


def add_cache_parser(commands: argparse._SubParsersAction) -> None:
    """``hotweights cache restart G``, under the cache layer's ``cache`` command."""
    p = action_parser(
        commands, "restart", "restart a group's cache daemon through the controller; engines keep serving"
    )
    p.add_argument("group", type=int, metavar="GROUP", help="the failover group")
    p.add_argument(
        "--timeout", type=float, default=DAEMON_WAIT_S,
        help="seconds to wait for the new daemon to serve (default %(default)g)",
    )  # fmt: skip
    p.set_defaults(func=runs(cmd_cache_restart, "cache restart"))
