"""``hotweights gateway``, the process: its routes, the listening sockets it serves on, its command line.

``gateway.policy`` holds the policy (where a request goes, how long it waits, when it is re-sent)."""

from __future__ import annotations

import argparse
import logging
import os
import socket
from pathlib import Path

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hotweights.contract import (
    CHALLENGE,
    GATEWAY_BACKLOG,
    SERVING_PREFIX,
    SHUTDOWN_TIMEOUT_S,
    TOKEN_REQUIRED,
    Endpoint,
    bearer_credentials,
    refuse_open_listener,
    token_matches,
)
from hotweights.controller.config import GATEWAY_TOKEN_FIX, load_config
from hotweights.controller.dcs import LeaderUrls
from hotweights.controller.events import EventLog
from hotweights.errors import ConfigError
from hotweights.gateway.policy import Gateway, default_admission
from hotweights.gateway.suspectjournal import JOURNAL_FILE
from hotweights.httpguard import ErrorShape, HttpLimits, server_config
from hotweights.standby.serving import AnnouncingServer, bind_port, is_listening, run_until_signal

log = logging.getLogger(__name__)

GATEWAY_EVENTS_FILE = "gateway-events.jsonl"  # in the state dir, every worker appending
SUPERVISOR_BACKLOG = 16
EVENTS_LIMIT = 100  # events GET /gateway/events returns by default


def build_app(gateway: Gateway, token: str | None = None) -> Starlette:
    """The gateway's routes; with ``token``, POST /gateway/wake (its one mutation) needs it as a bearer token."""

    async def health(_: Request) -> JSONResponse:
        """200 and the gateway's view: each upstream's last /primary answer, the primaries, held requests."""
        return JSONResponse(gateway.health())

    async def metrics(_: Request) -> Response:
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def events(request: Request) -> JSONResponse:
        """200 and this worker's last migrations (``?limit=N``, default 100): kind ``migration`` (the
        request, the upstreams, tokens replayed, cut to reopened) or ``migration_failed`` (why)."""
        try:
            limit = int(request.query_params.get("limit", EVENTS_LIMIT))
        except ValueError:
            return JSONResponse({"error": "limit: expected an integer"}, status_code=400)
        return JSONResponse({"events": gateway.events.recent(limit)})

    async def wake(request: Request) -> Response:
        """204: every upstream is probed now (a wake during a probe adds one probe); 401 without the token."""
        if not token_matches(bearer_credentials(request.headers.get("authorization")), token):
            return JSONResponse({"detail": TOKEN_REQUIRED}, status_code=401, headers=CHALLENGE)
        gateway.discovery.wake_all()
        return Response(status_code=204)

    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    return Starlette(
        routes=[
            Route(Endpoint.GATEWAY_HEALTH, health, methods=["GET"]),
            Route(Endpoint.GATEWAY_WAKE, wake, methods=["POST"]),
            Route(Endpoint.GATEWAY_EVENTS, events, methods=["GET"]),
            Route(Endpoint.METRICS, metrics, methods=["GET"]),
            Route(SERVING_PREFIX + "{path:path}", gateway.proxy, methods=methods),
        ],
        lifespan=gateway.running,
    )


def inherited_listener(fd: int) -> socket.socket:
    """The listening TCP socket a supervisor handed over as ``fd`` (``--fd``); ConfigError if it is not one."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        raise ConfigError(f"--fd {fd}: not an open socket ({exc.strerror})") from None
    is_tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
    if not (is_tcp and is_listening(sock)):
        sock.detach()
        raise ConfigError(f"--fd {fd}: not a listening TCP socket; pass the fd of one bound and listening")
    return sock


def probe_listener(path: Path) -> socket.socket:
    """A Unix socket at ``path`` (owner-only) where the supervisor reaches this one worker; a socket left
    there by a killed predecessor is replaced. ConfigError when it cannot be made there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        if path.is_socket():
            path.unlink()
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"--probe-socket {path}: {exc.strerror}; give a socket path in a directory of ours") from None
    finally:
        os.umask(old_umask)
    sock.listen(SUPERVISOR_BACKLOG)
    return sock


def cmd_gateway(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    host, port = args.host or config.gateway.host, config.gateway.port if args.port is None else args.port
    refuse_open_listener(host, config.token() is not None, "--host", GATEWAY_TOKEN_FIX)  # gateway.host: by load_config
    sock = bind_port(host, port) if args.fd is None else inherited_listener(args.fd)
    sockets = [sock, *([probe_listener(Path(args.probe_socket))] if args.probe_socket else [])]
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per probe would drown the log
    urls = args.upstream or config.engine_urls()
    gateway = Gateway(
        urls,
        interval_s=config.gateway.probe_interval_ms / 1000,
        timeout_s=config.health.timeout_ms / 1000,
        queue_limit=config.gateway.queue_limit,
        hold_s=config.gateway.hold_timeout_s,
        state_file=None if args.upstream else config.state_file,
        engine_host=config.dcs.address,
        leaders=LeaderUrls(config, httpx.AsyncClient(trust_env=False)) if config.dcs.enabled else None,
        events=EventLog(None if args.upstream else config.state_dir / GATEWAY_EVENTS_FILE),
        admission=default_admission(config),
        suspects=config.gateway.suspect_limits(),
        suspects_file=None if args.upstream else config.state_dir / JOURNAL_FILE,
    )
    log.info("routing /v1 to the primary among %s", ", ".join(urls))
    server = AnnouncingServer(
        server_config(
            build_app(gateway, config.token()),
            HttpLimits(body_bytes=config.gateway.max_body_bytes),
            ErrorShape.OPENAI,
            host=host,
            port=port,
            backlog=GATEWAY_BACKLOG,
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
    )
    run_until_signal(server, *sockets)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "gateway",
        help="proxy /v1 to the current primary engine, holding and retrying requests across a failover",
        description="Find the primary by polling GET /primary on every engine (no controller needed), proxy "
        "/v1/* to it (streaming included), hold requests while there is none and re-send those whose "
        "upstream failed before any byte was relayed. GET /gateway/health and /metrics describe it.",
    )
    p.add_argument("--config", help="cluster TOML: engines, health timings, [gateway] (default: built-in defaults)")
    p.add_argument("--host", help="address to listen on (default gateway.host)")
    p.add_argument("--port", type=int, help="port to listen on; 0 picks a free one (default gateway.port)")
    p.add_argument(
        "--fd",
        type=int,
        help="serve on this inherited, already listening TCP socket instead of binding one (how the controller "
        "starts its gateway workers: the socket outlives each of them, so a crash refuses no connection)",
    )
    p.add_argument("--probe-socket", help="also serve on this Unix socket, where a supervisor reaches this worker")
    p.add_argument(
        "--upstream",
        action="append",
        metavar="URL",
        help="an engine's base URL, repeatable (default: every engine of the config)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=SHUTDOWN_TIMEOUT_S,
        help=f"seconds open requests get after SIGTERM before they are cancelled (default {SHUTDOWN_TIMEOUT_S:g})",
    )
    p.set_defaults(func=cmd_gateway)
