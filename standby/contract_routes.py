"""The engine contract's HTTP routes, shared by every server that speaks it for an engine.

The reference engine (``standby.server``) and the agent beside a vLLM or SGLang engine
(``standby.agent``) add these to their FastAPI apps: the four health endpoints (GET, HEAD,
OPTIONS), promote / drain / demote behind the bearer check, ``/metrics``, OpenAI-shaped errors (400,
never FastAPI's 422) and a request counter. What differs between them comes in through a
``ContractHost``: its roles, its metrics, and its own health body and refusals.
"""

from __future__ import annotations

import logging
from typing import Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException

from hotweights.bearer import UNAUTHORIZED, bearer_check
from hotweights.contract import HEALTH_METHODS, Endpoint, Role
from hotweights.requestschema import invalid
from hotweights.standby.fencing import Fencing
from hotweights.standby.metrics import EngineMetrics, RequestCounter
from hotweights.standby.roles import Outcome, Roles

log = logging.getLogger(__name__)


class ContractHost(Protocol):
    """What the shared routes read from the server they are added to."""

    roles: Roles
    metrics: EngineMetrics
    token: str | None  # bearer token for role changes; None: no auth

    def health(self) -> dict[str, object]:
        """The health endpoints' body (a 503 adds ``reason``)."""

    def liveness_refusal(self) -> str | None:
        """None while the engine lives, else why not (``/health/live`` turns 503)."""

    def readiness_refusal(self) -> str | None:
        """None while the engine can serve its role, else why not."""


class RoleChangeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict: a bool is not a number
    timeout_s: float | None = Field(default=None, ge=0.0, le=86400.0)


class PromoteRequest(BaseModel):
    """A multi-host controller's promote: its leader key's revision, and how long the primary may serve
    without a renewal (``standby.fencing``). A single-host controller sends no body."""

    model_config = ConfigDict(extra="forbid", strict=True)
    fencing_token: int | None = Field(default=None, ge=1)
    lease_s: float | None = Field(default=None, gt=0.0, le=3600.0)


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    fencing_token: int = Field(ge=1)
    lease_s: float = Field(gt=0.0, le=3600.0)


def error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param}}, status_code=status)


RETRY_AFTER_S = "1"  # what a 503 of the serving API tells clients to wait before they try again


def unavailable(message: str) -> JSONResponse:
    """503 for the serving API (not serving in this role or state, or cancelled by a drain): with ``Retry-After``,
    so a client that is not behind the gateway (a batch engine's) knows to come back rather than give up."""
    response = error(503, message, "unavailable")
    response.headers["Retry-After"] = RETRY_AFTER_S
    return response


STATUS_DESCRIPTIONS: dict[int, dict[str, object]] = {
    400: {"description": "a bad body or field, named in `error.param`"},
    404: {"description": "an unknown `model`"},
    408: {"description": "the body did not arrive in time"},
    409: {"description": "refused in this role or state; `message` says why"},
    413: {"description": "the body is larger than this server's limit (`--max-body-bytes`)"},
    429: {"description": "overloaded: more requests than it serves and queues; `Retry-After` says when to retry"},
    500: {"description": "the generation failed"},
    503: {"description": "not ready, not in that role, or not serving; the body says why"},
} | UNAUTHORIZED


def declare(*codes: int) -> dict[int | str, dict[str, object]]:
    """OpenAPI ``responses`` for the status codes an endpoint answers besides its 200."""
    return {code: STATUS_DESCRIPTIONS[code] for code in codes}


HEALTH = declare(503)
ROLE_CHANGE = declare(400, 401, 409)
SERVING = declare(503)


def without_422(app: FastAPI) -> None:
    """The engine answers invalid input with 400 (OpenAI's shape), never FastAPI's 422: say so."""

    def openapi() -> dict[str, object]:
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def add_contract_routes(app: FastAPI, host: ContractHost) -> None:
    """Health, role changes and ``/metrics`` on ``app``; call ``finish_app`` after the app's own routes."""
    roles, metrics = host.roles, host.metrics
    fencing = Fencing(roles)
    require_token = Depends(bearer_check(host.token))

    def health(reason: str | None) -> JSONResponse:
        body = host.health() | ({"reason": reason} if reason else {})
        return JSONResponse(body, status_code=503 if reason else 200)

    @app.api_route(Endpoint.LIVE, methods=HEALTH_METHODS, responses=HEALTH)
    async def live() -> JSONResponse:
        """200 while the event loop answers and the inference thread runs; 503 once that thread died."""
        return health(host.liveness_refusal())

    @app.api_route(Endpoint.READY, methods=HEALTH_METHODS, responses=HEALTH)
    async def ready() -> JSONResponse:
        """200 when the weights are bound and warmed and the inference thread is responsive; else 503."""
        return health(host.readiness_refusal())

    @app.api_route(Endpoint.PRIMARY, methods=HEALTH_METHODS, responses=HEALTH)
    async def primary() -> JSONResponse:
        """200 iff ready, role primary and not draining or drained (load balancers route on this); else 503."""
        return health(host.readiness_refusal() or roles.serving_refusal())

    @app.api_route(Endpoint.STANDBY, methods=HEALTH_METHODS, responses=HEALTH)
    async def standby() -> JSONResponse:
        """200 iff ready and a warm standby (weights bound, no KV cache); else 503."""
        return health(host.readiness_refusal() or roles.standby_refusal())

    def role_change(name: str, outcome: Outcome) -> JSONResponse:
        log.info("%s: %s", name, outcome.message)
        body = {
            "accepted": outcome.accepted,
            "changed": outcome.changed,
            "message": outcome.message,
            "role": roles.role,
            "state": roles.state,
        }
        return JSONResponse(body | outcome.details, status_code=200 if outcome.accepted else 409)

    @app.post(Endpoint.PROMOTE, dependencies=[require_token], responses=ROLE_CHANGE)
    async def promote(request: PromoteRequest | None = None) -> JSONResponse:
        """standby -> primary: allocate the KV cache, then serve. Idempotent (a ready primary answers
        "already primary"); a drained primary resumes serving. The reply carries ``duration_ms``. With
        ``fencing_token`` (multi-host): refused below the highest token seen; ``lease_s``: the primary demotes
        itself unless ``/lease`` renews it within that many seconds.

        200 done or nothing to do; 401 bad or missing token; 409 a drain is in progress, or a stale fencing
        token; 400 bad body."""
        request = request or PromoteRequest()
        if refusal := fencing.promote_refusal(request.fencing_token):
            return role_change("promote", Outcome(False, False, refusal))
        was_standby = roles.role is Role.STANDBY
        outcome = await roles.promote()
        if outcome.accepted:
            fencing.promoted(request.fencing_token, request.lease_s)
        if outcome.changed and was_standby:
            metrics.promotions.inc()
            metrics.promotion_duration.observe(float(outcome.details["duration_ms"]) / 1000)
        return role_change("promote", outcome)

    @app.post(Endpoint.LEASE, dependencies=[require_token], responses=ROLE_CHANGE)
    async def lease(request: LeaseRequest) -> JSONResponse:
        """Renew the primary's lease for ``lease_s`` seconds under ``fencing_token`` (multi-host controllers,
        every loop). A higher token than the primary's own makes it demote itself (a newer leader exists).

        200 renewed, recorded, or demoting; 401 bad or missing token; 409 a stale token, or not a primary;
        400 bad body."""
        return role_change("lease", fencing.renew(request.fencing_token, request.lease_s))

    @app.post(Endpoint.DRAIN, dependencies=[require_token], responses=ROLE_CHANGE)
    async def drain(request: RoleChangeRequest | None = None) -> JSONResponse:
        """Stop taking requests at once (/primary turns 503 before anything else happens), let in-flight
        ones finish until ``timeout_s`` (default --drain-timeout), cancel the rest, report "drained".

        200 drained (or already drained); 401 bad or missing token; 409 a standby, or requests that
        would not stop; 400 bad body."""
        return role_change("drain", await roles.drain(request.timeout_s if request else None))

    @app.post(Endpoint.DEMOTE, dependencies=[require_token], responses=ROLE_CHANGE)
    async def demote(request: RoleChangeRequest | None = None) -> JSONResponse:
        """primary -> standby: drain as /drain does, then release the KV cache. Idempotent.

        200 done or already standby; 401 bad or missing token; 409 requests that would not stop;
        400 bad body."""
        return role_change("demote", await roles.demote(request.timeout_s if request else None))

    @app.get(Endpoint.METRICS, response_class=PlainTextResponse)
    async def prometheus() -> Response:
        """200 the engine's metrics in the Prometheus text format."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def finish_app(app: FastAPI, metrics: EngineMetrics) -> FastAPI:
    """OpenAI-shaped errors, the OpenAPI document without 422, and the request counter over every route."""

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        return invalid([e | {"loc": e["loc"][1:]} for e in exc.errors()]).response()  # loc[0]: body, header...

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(exc.status_code, "invalid_request_error")
        response = error(exc.status_code, str(exc.detail), kind)
        response.headers.update(exc.headers or {})
        return response

    without_422(app)
    endpoints = frozenset(route.path for route in app.routes)
    app.add_middleware(RequestCounter, counter=metrics.requests, endpoints=endpoints)
    return app
