"""``hotweights agent``: the engine contract beside a vLLM or SGLang server (Patroni's model).

The agent starts the engine as its child (through ``hotweights agent-guard``, which kills the engine's
whole process group when the agent dies, however it dies), keeps the role and state the engine
does not have, serves the contract's health endpoints and role changes, and passes ``/v1/*`` through
to the engine while it is the primary (503 with the reason and ``Retry-After`` otherwise; streams
relayed unbuffered). A streamed completion or chat with ``return_token_ids`` (what the gateway asks for) is relayed
chunk by chunk with each choice's token ids kept with their text (``standby.tokenalign``), decoded with the engine's
tokenizer (its command's tokenizer or model directory). Ready = the engine's own health endpoint plus one one-token
completion, and, with requests pending, progress within a bound from the engine's own token times
(``standby.agentprogress``: an engine core stuck while its HTTP server answers is not ready). A drain stops
admitting, waits for the requests the agent passed on (and reports the engine's own running count from its
metrics), then cancels the rest at the deadline by closing them.

The engine command names the engine's port as ``{port}``; the agent picks a free loopback port for
it (``standby.agentengine``). When the engine exits the agent logs its exit and its last log lines and exits with
code 1, so its supervisor sees the slot end at once. With ``--start-fd`` it is a spare (``standby.agentspare``): its
engine starts and gets ready before the agent has a slot, and the start message names the slot it serves as.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import socket
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from tokenizers import Tokenizer

from hotweights.admission import ServingLimits
from hotweights.contract import (
    ENGINE_PORT,
    NOT_NORMALIZED,
    SHUTDOWN_TIMEOUT_S,
    WEIGHTS_HEADER,
    Endpoint,
    Role,
    forwardable_path,
    read_token,
    refuse_open_listener,
)
from hotweights.engines import KINDS, Engine, EngineKind
from hotweights.errors import CheckpointError, ConfigError
from hotweights.httpguard import ErrorShape, HttpLimits, parsed_json, server_config
from hotweights.proxying import HOP_BY_HOP, ProxiedStream, rewritten_events
from hotweights.spawn import READY_FLAG, START_FLAG, add_spare_arguments
from hotweights.standby.agentengine import (
    EngineChild,
    engine_client,
    engine_command,
    engine_exit,
    engine_log,
    start_engine,
    stop_engine,
    wait_ready,
)
from hotweights.standby.agentprogress import Relayed, RelayWatch, metric_total
from hotweights.standby.agentspare import Started, wait_as_spare
from hotweights.standby.chatbridge import TOKENIZE, ChatChunks, bridgeable, completion_body, tokenize_body
from hotweights.standby.contract_routes import SERVING, add_contract_routes, error, finish_app, unavailable
from hotweights.standby.metrics import EngineMetrics
from hotweights.standby.pacing import CpuShare
from hotweights.standby.roles import Roles
from hotweights.standby.serving import AnnouncingServer, bind_port, run_until_signal
from hotweights.standby.tokenalign import StreamIds, wants_aligned
from hotweights.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
PROBE_TIMEOUT_S = 5.0
LIVE_FAILURES = 3  # probes in a row the engine may miss before /health/live turns 503
EVENT_STREAM = "text/event-stream"
ALIGNED = (Endpoint.COMPLETIONS, Endpoint.CHAT_COMPLETIONS)  # the streams whose token ids are kept with their text
DECODED = ("content-encoding",)  # what a rewritten stream no longer has: its lines are read decoded


class PassThrough:
    """The ``Capacity`` of an engine the agent fronts: its KV cache is allocated when it starts and
    stays (vLLM's sleep mode is refused on CPU), so a role change only opens or closes the gate; a drain
    deadline closes the relayed requests, which cancels them on the engine. A finished drain reports
    the engine's own count of running requests, from its metrics, beside the agent's."""

    def __init__(self, kind: EngineKind, client: httpx.AsyncClient) -> None:
        self.kind, self.client = kind, client
        self.relayed: set[httpx.Response] = set()

    async def drained(self) -> dict[str, object]:
        return {"engine_running": await engine_running(self.kind, self.client)}

    def acquire(self) -> tuple[dict[str, object], str]:
        return {}, "the engine's KV cache stays allocated"

    def release(self, grace_s: float) -> tuple[dict[str, object], str]:
        return {}, "the engine keeps its KV cache"

    def cancel_all(self) -> int:
        for response in list(self.relayed):
            asyncio.get_running_loop().create_task(response.aclose())
        return len(self.relayed)

    def keep_cut(self, keep: bool) -> None:
        """Nothing to keep: the engine's KV cache is not shared with the next primary."""


@dataclass
class AgentContext:
    """What the contract routes read, and the agent's view of its engine."""

    engine_id: str
    kind: EngineKind
    child: EngineChild
    roles: Roles
    metrics: EngineMetrics
    token: str | None
    capacity: PassThrough
    model: str | None = None  # the served model id, once ready
    weights_id: str | None = None  # named on every relayed answer (WEIGHTS_HEADER); None: not named
    tokenizer: Tokenizer | None = None  # the engine's, which streamed token ids are aligned with; None: not aligned
    progress: RelayWatch = field(default_factory=RelayWatch)  # the engine's progress, as relayed
    ready: bool = False
    missed: int = 0  # health probes in a row the engine did not answer with 200
    started: float = field(default_factory=time.monotonic)

    def health(self) -> dict[str, object]:
        return {
            "engine_id": self.engine_id,
            "role": self.roles.role,
            "state": self.roles.state,
            "model": self.model,
            "weights": self.weights_id,  # what its answers name (WEIGHTS_HEADER)
            "engine": {"kind": self.kind.name, "pid": self.child.engine_pid, "port": self.child.port},
            "uptime_s": round(time.monotonic() - self.started, 3),
            "in_flight": self.roles.in_flight,
            "pid": os.getpid(),
        }

    def liveness_refusal(self) -> str | None:
        if self.child.process.poll() is not None:
            return self.child.exit_text()
        if self.missed >= LIVE_FAILURES:
            return f"the engine has not answered {self.kind.health} for {self.missed} probes"
        return None

    def readiness_refusal(self) -> str | None:
        if refusal := self.liveness_refusal():
            return refusal
        if not self.ready:
            return f"the engine is starting ({time.monotonic() - self.child.started:.0f} s)"
        # A slow probe or two under load is no reason to stop serving (liveness counts them); no progress is.
        return self.progress.refusal


def flag_value(command: list[str], flag: str) -> str | None:
    """What ``command`` gives ``flag`` (``--flag value`` or ``--flag=value``, the last one if several), else None."""
    value = None
    for arg, following in zip(command, [*command[1:], None], strict=True):
        if arg == flag:
            value = following
        elif arg.startswith(f"{flag}="):
            value = arg.removeprefix(f"{flag}=")
    return value


def engine_tokenizer(kind: EngineKind, command: list[str]) -> Tokenizer | None:
    """The tokenizer the engine decodes with: its command's tokenizer directory, else its model's. None, said in one
    warning, when that is no directory with a ``tokenizer.json`` (a hub name, say): streamed token ids then go as the
    engine sends them, and a completion cut inside a character may lose it on its way to the next primary."""
    named = flag_value(command, kind.tokenizer_flag) or flag_value(command, kind.model_flag)
    reason = f"the engine command names no {kind.model_flag}"
    if named is not None:
        try:
            return load_tokenizer(Path(named))
        except CheckpointError as exc:
            reason = str(exc)
    log.warning("%s: streamed token ids are relayed as the engine sends them, not kept with their text", reason)
    return None


async def probe_forever(ctx: AgentContext, client: httpx.AsyncClient) -> None:
    """The engine's health once a second: ``missed`` counts the probes in a row without a 200."""
    while True:
        try:
            ok = (await client.get(ctx.kind.health, timeout=PROBE_TIMEOUT_S)).status_code == 200
        except httpx.HTTPError:
            ok = False
        ctx.missed = 0 if ok else ctx.missed + 1
        await asyncio.sleep(PROBE_INTERVAL_S)


async def engine_running(kind: EngineKind, client: httpx.AsyncClient) -> float | None:
    """The engine's own count of running requests, from its metrics (None if unreadable)."""
    return await engine_metric(client, kind.running_metric, PROBE_TIMEOUT_S)


async def engine_metric(client: httpx.AsyncClient, name: str, timeout_s: float) -> float | None:
    """The total of the engine's metric ``name`` (None if unreadable within ``timeout_s``)."""
    try:
        return metric_total((await client.get(Endpoint.METRICS, timeout=timeout_s)).text, name)
    except httpx.HTTPError:
        return None


def build_agent_app(ctx: AgentContext, client: httpx.AsyncClient) -> FastAPI:
    app = FastAPI(title="hotweights agent", description="The engine contract for a vLLM or SGLang engine.")
    add_contract_routes(app, ctx)
    roles = ctx.roles

    not_found = {404: {"description": "not a normalized /v1 path"}}

    @app.api_route("/v1/{rest:path}", methods=["GET", "POST"], response_model=None, responses=SERVING | not_found)
    async def relay(request: Request, rest: str) -> Response:
        """The engine's OpenAI API, relayed while this agent fronts the ready primary; 503 (with the
        reason and ``Retry-After``) otherwise; 404 for a path that is not a normalized ``/v1/...``."""
        path = forwardable_path(request.scope.get("raw_path") or b"")
        if path is None:
            return error(404, NOT_NORMALIZED, "not_found_error")
        if reason := roles.serving_refusal() or ctx.readiness_refusal():
            response = unavailable(reason)
            return response
        bridging = not ctx.kind.chat_token_ids and path == Endpoint.CHAT_COMPLETIONS and request.method == "POST"
        if bridging and (chat := bridgeable(await request.body())) is not None:
            return await bridge(ctx, client, request, chat)
        return await send(ctx, client, request, path)

    return finish_app(app, ctx.metrics)


async def send(ctx: AgentContext, client: httpx.AsyncClient, request: Request, path: str) -> Response:
    """Relay one admitted request; the roles count it until its response is closed."""
    headers = [(k, v) for k, v in request.headers.items() if k not in HOP_BY_HOP]
    query = f"?{request.url.query}" if request.url.query else ""
    outgoing = client.build_request(request.method, path + query, headers=headers, content=await request.body())
    ctx.roles.admit()
    pending = ctx.progress.sent(parsed_json(request.scope))
    try:
        upstream = await client.send(outgoing, stream=True)
    except httpx.HTTPError as exc:  # nothing was answered: a gateway may send it to the next primary
        unrelayed(ctx, pending)
        response = unavailable(f"the engine did not answer: {type(exc).__name__} {exc}".strip())
        return response
    reply_headers = {k: v for k, v in upstream.headers.items() if k not in HOP_BY_HOP}
    ids = stream_ids(ctx, parsed_json(request.scope)) if path in ALIGNED else None
    if ids is None or not upstream.headers.get("content-type", "").startswith(EVENT_STREAM):
        return relayed(ctx, pending, upstream, upstream.aiter_raw(), upstream.status_code, reply_headers)
    reply_headers = {k: v for k, v in reply_headers.items() if k not in DECODED}
    events = rewritten_events(upstream.aiter_lines(), ids.chunk)
    return relayed(ctx, pending, upstream, events, upstream.status_code, reply_headers)


def stream_ids(ctx: AgentContext, request: object) -> StreamIds | None:
    """The alignment of a streamed response's token ids with their text (``standby.tokenalign``), for a ``request``
    (its body's JSON value) that asks for them on an agent that has the engine's tokenizer; None otherwise."""
    if ctx.tokenizer is None or not wants_aligned(request):
        return None
    return StreamIds(ctx.tokenizer, request.get("skip_special_tokens") is not False)


def relayed(
    ctx: AgentContext,
    pending: Relayed,
    upstream: httpx.Response,
    content: AsyncIterator[bytes],
    status: int,
    headers: dict[str, str],
) -> ProxiedStream:
    """``content`` of the engine's ``upstream`` response as the reply, naming this agent's weights (if it was
    given them), each piece counted as the engine's progress on ``pending``; the roles stop counting the request
    (``Roles.admit``) once it is closed."""
    ctx.capacity.relayed.add(upstream)
    streams = status == 200 and upstream.headers.get("content-type", "").startswith(EVENT_STREAM)
    content = ctx.progress.relay(pending, content, streams)
    headers = {k: v for k, v in headers.items() if k.lower() != WEIGHTS_HEADER}
    if ctx.weights_id is not None:
        headers[WEIGHTS_HEADER] = ctx.weights_id

    async def closed() -> None:
        ctx.capacity.relayed.discard(upstream)
        ctx.progress.ended(pending, finished=False)  # if it has not ended with its content
        ctx.roles.release()

    return ProxiedStream(content, status, headers, upstream, on_close=closed)


async def bridge(ctx: AgentContext, client: httpx.AsyncClient, request: Request, chat: dict) -> Response:
    """A streamed chat with token ids over the engine's completions (``standby.chatbridge``); the engine's
    own answer when it refuses to encode the messages or to complete them."""
    headers = [(k, v) for k, v in request.headers.items() if k not in HOP_BY_HOP]
    ctx.roles.admit()
    pending = ctx.progress.sent(chat)
    try:
        encoded = await client.post(TOKENIZE, json=tokenize_body(chat), headers=headers)
        if encoded.status_code != 200:
            unrelayed(ctx, pending)
            return Response(encoded.content, encoded.status_code, media_type=encoded.headers.get("content-type"))
        prompt_ids = encoded.json()["tokens"]
        body = completion_body(chat, prompt_ids)
        outgoing = client.build_request("POST", Endpoint.COMPLETIONS, headers=headers, json=body)
        upstream = await client.send(outgoing, stream=True)
    except httpx.HTTPError as exc:
        unrelayed(ctx, pending)
        return unavailable(f"the engine did not answer: {type(exc).__name__} {exc}".strip())
    if upstream.status_code != 200:
        content = b"".join([chunk async for chunk in upstream.aiter_raw()])
        await upstream.aclose()
        unrelayed(ctx, pending)
        return Response(content, upstream.status_code, media_type=upstream.headers.get("content-type"))
    chat, ids = ChatChunks(prompt_ids), stream_ids(ctx, body)
    events = rewritten_events(upstream.aiter_lines(), chat if ids is None else lambda chunk: chat(ids.chunk(chunk)))
    headers = {"content-type": "text/event-stream", "cache-control": "no-cache"}
    return relayed(ctx, pending, upstream, events, 200, headers)


def unrelayed(ctx: AgentContext, pending: Relayed) -> None:
    """An admitted request ends with no response of the engine's relayed: neither counted nor pending any more."""
    ctx.progress.ended(pending, finished=False)
    ctx.roles.release()


class AgentServer(AnnouncingServer):
    """uvicorn that also runs the agent's background work: readiness, probes, and the engine's end."""

    def __init__(self, config: uvicorn.Config, ctx: AgentContext, client: httpx.AsyncClient, ready_s: float) -> None:
        super().__init__(config, {"engine_id": ctx.engine_id, "role": ctx.roles.role.value, "kind": ctx.kind.name})
        self.ctx, self.client, self.ready_s = ctx, client, ready_s
        self.failure: str | None = None

    async def main_loop(self) -> None:
        tasks = [asyncio.create_task(self.become_ready()), asyncio.create_task(self.watch_engine())]
        try:
            await super().main_loop()
        finally:
            for task in tasks:
                task.cancel()

    async def become_ready(self) -> None:
        """Wait for the engine's readiness (unless a spare saw it before its start), then probe it and watch its
        progress."""
        if not self.ctx.ready:
            child = self.ctx.child
            try:
                self.ctx.model = await wait_ready(self.ctx.kind, child, self.ctx.engine_id, self.client, self.ready_s)
            except ConfigError as exc:
                self.stop(str(exc))
                return
            self.ctx.ready = True
            log.info("engine ready in %.1f s (model %s)", time.monotonic() - child.started, self.ctx.model)
        read = functools.partial(engine_metric, self.client, self.ctx.kind.step_metric, PROBE_TIMEOUT_S)
        await asyncio.gather(probe_forever(self.ctx, self.client), self.ctx.progress.watch(read))

    async def watch_engine(self) -> None:
        """The engine's end, the instant it happens."""
        await engine_exit(self.ctx.child)
        self.stop(f"{self.ctx.engine_id}: {self.ctx.child.exit_text()}")

    def stop(self, failure: str) -> None:
        if not self.should_exit:
            log.error("%s", failure)
            self.failure = failure
            self.should_exit = True


@dataclass(frozen=True)
class Serving:
    """What the agent serves with, once it has its slot."""

    kind: EngineKind
    engine_id: str
    token: str | None
    tokenizer: Tokenizer | None
    model: str | None = None  # the served model, when a spare saw its engine ready (None: wait for it)


def cmd_agent(args: argparse.Namespace) -> int:
    token = read_token(Path(args.token_file), "--token-file") if args.token_file else None
    refuse_open_listener(args.host, token is not None, "--host", "pass --token-file or listen on 127.0.0.1")
    command = args.engine_command[1:] if args.engine_command[:1] == ["--"] else args.engine_command
    if not command:
        raise ConfigError("no engine command: give it after --, e.g. -- python -m vllm.entrypoints.openai.api_server")
    engine_command(command, 0)  # its port placeholder, before anything starts
    if (args.start_fd is None) != (args.ready_fd is None):
        raise ConfigError(f"{START_FLAG} and {READY_FLAG} go together (a spare has both pipes)")
    kind = KINDS[args.kind]
    tokenizer = engine_tokenizer(kind, command)
    spare = args.start_fd is not None
    sock = None if spare else bind_port(args.host, args.port)  # a spare binds its slot's port at its start
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per probe would drown the log
    serving = Serving(kind, args.engine_id or f"{socket.gethostname()}-{os.getpid()}", token, tokenizer)
    cpus = CpuShare() if spare else None  # a spare's server starts on its share of the CPUs (``standby.pacing``)
    child = start_engine(command, engine_log(Path(args.log_dir), serving.engine_id, os.getpid() if spare else None))
    try:
        failure = serve(args, serving, child, sock) if cpus is None else run_spare(args, serving, child, cpus)
    finally:
        stop_engine(child, args.shutdown_timeout)
    if failure:
        print(f"hotweights agent: error: {failure}", file=sys.stderr)
        return 1
    return 0


def run_spare(args: argparse.Namespace, serving: Serving, child: EngineChild, cpus: CpuShare) -> str | None:
    """A spare (``standby.agentspare``): wait for the start, then give its engine's processes the whole CPU set back
    (``cpus``) and serve as the slot's engine; released, remove its engine's log (the caller stops the engine). The
    failure, if any (its engine exited, or was not ready in time)."""
    try:
        started = asyncio.run(wait_as_spare(serving.kind, child, serving.engine_id, args.ready_timeout,
                                            args.start_fd, args.ready_fd))  # fmt: skip
    except ConfigError as exc:
        return str(exc)
    if started is None:
        child.log_path.unlink(missing_ok=True)
        return None
    cpus.restore(child.process.pid)
    serving, sock = take_slot(args, serving, child, started)
    return serve(args, serving, child, sock)


def take_slot(
    args: argparse.Namespace, serving: Serving, child: EngineChild, started: Started
) -> tuple[Serving, socket.socket]:
    """A spare's start (``standby.agentspare``): its output to the slot's log, its engine's log named after the
    slot, the slot's port bound."""
    slot = started.slot
    slot.move_output()
    serving = replace(serving, engine_id=slot.engine_id or serving.engine_id, model=started.model)
    sock = bind_port(args.host, args.port if slot.port is None else slot.port)
    child.move_log(engine_log(Path(args.log_dir), serving.engine_id, os.getpid()))
    log.info("spare started as %s (engine %s); the engine logs to %s", serving.engine_id,
             "ready" if started.model else "not ready yet", child.log_path)  # fmt: skip
    return serving, sock


def serve(args: argparse.Namespace, serving: Serving, child: EngineChild, sock: socket.socket) -> str | None:
    """Serve the contract on ``sock`` for ``child`` until a signal or the engine's end: the failure, if any."""
    client = engine_client(child)
    capacity = PassThrough(serving.kind, client)
    roles = Roles(Role(args.role), capacity, args.drain_timeout)
    metrics = EngineMetrics()
    metrics.bind(roles, lambda: 0, {"engine_id": serving.engine_id, "mode": "agent", "source": args.kind})
    ctx = AgentContext(
        serving.engine_id, serving.kind, child, roles, metrics, serving.token, capacity,
        model=serving.model, weights_id=args.weights_id, tokenizer=serving.tokenizer, ready=serving.model is not None,
    )  # fmt: skip
    config = server_config(
        build_agent_app(ctx, client), HttpLimits(), ErrorShape.OPENAI, host=args.host, lifespan="off"
    )
    server = AgentServer(config, ctx, client, args.ready_timeout)
    run_until_signal(server, sock)
    return server.failure


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "agent",
        help="serve the engine contract for a vLLM or SGLang engine that runs as its child",
        description="Start the engine command (after --; it must take its port as {port}) as a child, serve "
        "the engine contract (health endpoints, promote/drain/demote, /metrics) and pass /v1/* through "
        "while primary. The engine dies with the agent. Prints a JSON ready line to stdout once listening.",
    )
    p.add_argument("--kind", choices=sorted(KINDS), default=Engine.VLLM, help="the engine's kind (default vllm)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=ENGINE_PORT, help=f"port to listen on (default {ENGINE_PORT})")
    p.add_argument("--role", choices=list(Role), default=Role.STANDBY, help="starting role (default standby)")
    p.add_argument("--engine-id", help="name in health replies and logs (default HOST-PID)")
    p.add_argument("--token-file", help="file holding the bearer token that promote/drain/demote require")
    drain = ServingLimits.drain_timeout_s
    p.add_argument("--drain-timeout", type=float, default=drain, help=f"seconds a drain waits (default {drain:g})")
    p.add_argument("--ready-timeout", type=float, default=900.0, help="seconds the engine gets to be ready (900)")
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=SHUTDOWN_TIMEOUT_S,
        help=f"seconds the engine gets to stop (default {SHUTDOWN_TIMEOUT_S:g})",
    )
    p.add_argument("--log-dir", default=".", help="where the engine's log goes (default: here)")
    p.add_argument(
        "--weights-id",
        help="an id of the weights the engine serves, named on every answer it relays, so that a gateway continues "
        "a cut completion only on an engine with the same weights (default: none named, never checked)",
    )
    add_spare_arguments(p, "binding --port (or the start message's) and serving the engine, ready")
    p.add_argument("engine_command", nargs=argparse.REMAINDER, help="-- the engine command, with {port}")
    p.set_defaults(func=cmd_agent)
