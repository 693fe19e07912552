"""The engine contract in code: roles, states, endpoint paths, the bearer token, open binds.

``docs/engine-contract.md`` describes the contract; every server that speaks it (the engine, the
controller, the gateway) and every client (the controller's checks, HAProxy's config, the drills,
the tests) takes its words from here, so renaming an endpoint is a change to one line.
"""

from __future__ import annotations

import ipaddress
import re
import secrets
from enum import StrEnum
from pathlib import Path

from hotweights.errors import ConfigError


class Role(StrEnum):
    """Who an engine is: the one that serves, or a warm standby (weights bound, no KV cache)."""

    PRIMARY = "primary"
    STANDBY = "standby"


class State(StrEnum):
    """What a primary is doing; a standby is always ready."""

    READY = "ready"
    DRAINING = "draining"
    DRAINED = "drained"


class Endpoint(StrEnum):
    """Every path of the contract. Health endpoints answer GET, HEAD and OPTIONS; role changes POST."""

    LIVE = "/health/live"
    READY = "/health/ready"
    PRIMARY = "/primary"  # load balancers route on this: 200 only on the serving primary
    STANDBY = "/standby"
    PROMOTE = "/promote"
    DRAIN = "/drain"
    DEMOTE = "/demote"
    LEASE = "/lease"  # POST: a multi-host controller renews its primary's lease under its fencing token
    CANARY = "/canary"  # POST: the reference engine's known-answer check (the controller's, behind the token)
    METRICS = "/metrics"  # Prometheus text format (also the controller's and the gateway's)
    MODELS = "/v1/models"
    COMPLETIONS = "/v1/completions"
    CHAT_COMPLETIONS = "/v1/chat/completions"
    GATEWAY_HEALTH = "/gateway/health"  # the gateway's own view: upstreams, primaries, held requests
    GATEWAY_EVENTS = "/gateway/events"  # the gateway's own timeline: its request migrations
    GATEWAY_WAKE = "/gateway/wake"  # POST: probe every upstream now (the controller's push after a role change)
    ROLLOUT = "/rollout"  # the controller's: POST restarts every engine of a group one at a time
    EVENTS = "/events"  # the controller's timeline


# What a chat request may hold to be continued as a completion of its rendered prompt's ids (the gateway's
# migration, the agent's chat bridge).
CHAT_KEYS = frozenset(
    {"messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "seed"}
    | {"stop", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty"}
    | {"stream", "stream_options", "return_token_ids", "user", "n"}
)
CHAT_ONLY = ("messages", "max_completion_tokens")  # left out of a chat's continuation (a completion)


def choice_text(choice: dict) -> str:
    """A streamed or whole completion choice's text, or a chat choice's delta content ('' when it has none)."""
    return choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content") or ""


SUSPECT_REQUEST = "suspect_request"  # the error type of a request the gateway will not re-send (gateway.suspect_after)
# On a migrated completion's continuation: how many of its prompt's last token ids an engine generated before the cut.
# A batch-invariant reference engine feeds them through decode steps, as they were first computed; others ignore it.
REPLAY_HEADER = "x-hotweights-replay"
# On an engine's completion answers: an opaque id of the weights it computes with (the reference engine's fingerprint,
# an agent's --weights-id). A migrated completion continues only on an engine that names the same weights.
WEIGHTS_HEADER = "x-hotweights-weights"
# On a request the gateway owes to a failover (held through it, re-sent or continued after it): the engine queues it
# whatever its expected start, never refusing it for want of queue (``hotweights.admission``).
OWED_HEADER = "x-hotweights-owed"
# On a streamed completion the gateway asks an engine for on behalf of a client that asked for no stream (it relays no
# chunk of it, only the whole answer at the end): the engine may gather up to this many milliseconds of tokens into
# one chunk, so the gateway's event loop reads fewer chunks (``standby.completions``); an engine may ignore it.
GATHER_MS_HEADER = "x-hotweights-gather-ms"
GATHER_MS = 100  # what the gateway asks for: tokens a failover would generate again if it lost them, at most
MAX_GATHER_MS = 1000  # the most an engine takes (400 beyond)
# On an engine's 429: in how many milliseconds it expects to queue a fresh request again. Until then a gateway sends it
# no fresh request and answers those 429 itself (``gateway.discovery``), so refusals cost its event loop nothing.
ADMITS_IN_HEADER = "x-hotweights-admits-in-ms"
UPSTREAM_HEADER = "x-hotweights-upstream"  # on what a gateway relays from an engine: that engine's URL
ENGINE_PORT = (
    8200  # an engine's, and a cluster's first engine's (``base_port``); the controller's 8100, the gateway's 8000
)
SERVING_PREFIX = "/v1/"  # what a load balancer or the gateway forwards to the primary, and nothing else
# The gateway's listening socket: connections the kernel queues while no worker accepts (one respawning); capped by
# somaxconn. The controller listens with it on the socket its workers inherit, a standalone gateway on its own.
GATEWAY_BACKLOG = 4096
# Seconds open requests get after SIGTERM before they are cancelled: the engine's, the agent's engine's, the gateway's.
SHUTDOWN_TIMEOUT_S = 30.0
HEALTH_METHODS = ("GET", "HEAD", "OPTIONS")  # HAProxy checks with OPTIONS, Kubernetes with GET

TOKEN_REQUIRED = "a valid bearer token is required"
CHALLENGE = {"WWW-Authenticate": "Bearer"}


def token_matches(given: str, token: str | None) -> bool:
    """Whether ``given`` (the bearer credentials, "" when none) passes: anything when ``token`` is None,
    else exactly ``token``, compared in constant time."""
    return token is None or secrets.compare_digest(given.encode(), token.encode())


def bearer_credentials(authorization: str | None) -> str:
    """The credentials of an ``Authorization: Bearer <credentials>`` header ("" for none or another scheme)."""
    scheme, _, credentials = (authorization or "").partition(" ")
    return credentials.strip() if scheme.lower() == "bearer" else ""


def is_loopback(host: str) -> bool:
    """Whether ``host`` only listens to this machine ("localhost", 127.0.0.0/8, ::1); a name or "" is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def refuse_open_listener(host: str, has_token: bool, setting: str, fix: str) -> None:
    """The one rule for every server: a listener on a non-loopback address needs a token. Raises
    ConfigError naming ``setting`` (where the address came from) and ``fix`` when it has none."""
    if not has_token and not is_loopback(host):
        raise ConfigError(f"{setting} {host!r} is not loopback and no bearer token is set: {fix}")


SEGMENT = re.compile(r"[A-Za-z0-9_~-][A-Za-z0-9._~-]*")  # unreserved characters, not led by a dot
NOT_NORMALIZED = f"only {SERVING_PREFIX}... paths of plain segments are forwarded: no '.', '..', '//' or % escapes"


def forwardable_path(raw_path: bytes) -> str | None:
    """The path to forward when ``raw_path`` (undecoded, without the query) is a normalized ``/v1/...``
    path; else None."""
    path = raw_path.decode("ascii", errors="replace")
    if not path.startswith(SERVING_PREFIX):
        return None
    segments = path.removeprefix(SERVING_PREFIX).split("/")
    return path if all(SEGMENT.fullmatch(segment) for segment in segments) else None


TOKEN_BYTES = re.compile(rb"[\x21-\x7e]+")  # visible ASCII: what an Authorization header carries as is


def read_token(path: Path, setting: str) -> str:
    """The bearer token in ``path``: one line of visible ASCII characters, surrounding whitespace (the final
    newline) ignored. ConfigError naming ``setting``, the file and what is wrong with it: unreadable, empty, more
    than one line, or a character a bearer token cannot hold (a space, a control or non-ASCII character)."""
    try:
        raw = Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise ConfigError(f"{setting} {path}: cannot read it: {exc.strerror}") from None
    token = raw.strip()
    if not token:
        raise ConfigError(f"{setting} {path} is empty; put the bearer token in it, on one line")
    if b"\n" in token or b"\r" in token:
        lines = len(token.splitlines())
        raise ConfigError(f"{setting} {path} holds {lines} lines; a token file holds the token on one line")
    if not TOKEN_BYTES.fullmatch(token):
        bad = next(b for b in token if not 0x21 <= b <= 0x7E)
        raise ConfigError(
            f"{setting} {path}: the token holds byte 0x{bad:02x} at offset {token.index(bad)}; a bearer token is "
            "visible ASCII characters only (no spaces, control or non-ASCII characters)"
        )
    return token.decode("ascii")
