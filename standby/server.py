"""The engine's HTTP face: OpenAI completions, Patroni-style health checks, role changes, metrics.

Handlers never touch the model: compute runs on the scheduler's thread, and the health endpoints
read plain attributes, so they answer in milliseconds during long generations. Every error body
is OpenAI-shaped: ``{"error": {"message", "type", "param"}}``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from hotweights.standby.completions import CompletionRequest, CompletionRun, GenerationAborted
from hotweights.standby.metrics import EngineMetrics, RequestCounter
from hotweights.standby.roles import Outcome, Roles
from hotweights.standby.scheduler import Scheduler
from hotweights.standby.weights import LoadedModel
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.types import Receive, Scope, Send
from tokenizers import Tokenizer

from hotweights.contract import HEALTH_METHODS, UNAUTHORIZED, Endpoint, Role, bearer_check

log = logging.getLogger(__name__)

STALL_S = 30.0  # an inference thread that has not gone round its loop for this long is not ready


@dataclass
class EngineContext:
    """Everything the handlers read; built once by ``standby.engine``."""

    engine_id: str
    model_name: str
    loaded: LoadedModel
    tokenizer: Tokenizer
    stop_ids: frozenset[int]
    context_tokens: int  # prompt + max_tokens must fit in one KV slot
    scheduler: Scheduler
    roles: Roles
    metrics: EngineMetrics
    token: str | None  # bearer token for role changes; None: no auth
    fingerprint: str = field(init=False)  # the weights' digest, computed once
    started: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.fingerprint = self.loaded.fingerprint.digest()

    def readiness_refusal(self) -> str | None:
        """Weights are bound and warmed before the server listens, so readiness is the worker's health."""
        if not self.scheduler.is_alive:
            return "the inference thread has died"
        stalled = time.monotonic() - self.scheduler.heartbeat
        if stalled > STALL_S:
            return f"the inference thread has not gone round its loop for {stalled:.0f} s"
        return None

    def health(self) -> dict[str, object]:
        return {
            "engine_id": self.engine_id,
            "role": self.roles.role,
            "state": self.roles.state,
            "model": self.model_name,
            "fingerprint": self.fingerprint,
            "weight_cache": {"mode": self.loaded.mode, "source": self.loaded.source},
            "uptime_s": round(time.monotonic() - self.started, 3),
            "in_flight": self.roles.in_flight,
            "kv_cache_bytes": self.scheduler.kv_cache_bytes,
            "pid": os.getpid(),
        }


class RoleChangeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)  # strict: a bool is not a number
    timeout_s: float | None = Field(default=None, ge=0.0, le=86400.0)


class ClosingStream(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends: done, client gone, or cancelled."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param}}, status_code=status)


STATUS_DESCRIPTIONS: dict[int, dict[str, object]] = {
    400: {"description": "a bad body or field, named in `error.param`"},
    404: {"description": "an unknown `model`"},
    409: {"description": "refused in this role or state; `message` says why"},
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


def build_app(ctx: EngineContext) -> FastAPI:
    app = FastAPI(title="hotweights engine", description="The engine contract: docs/engine-contract.md.")
    roles, metrics = ctx.roles, ctx.metrics
    require_token = Depends(bearer_check(ctx.token))

    def health(reason: str | None) -> JSONResponse:
        body = ctx.health() | ({"reason": reason} if reason else {})
        return JSONResponse(body, status_code=503 if reason else 200)

    @app.api_route(Endpoint.LIVE, methods=HEALTH_METHODS, responses=HEALTH)
    async def live() -> JSONResponse:
        """200 while the event loop answers and the inference thread runs; 503 once that thread died."""
        return health(None if ctx.scheduler.is_alive else "the inference thread has died")

    @app.api_route(Endpoint.READY, methods=HEALTH_METHODS, responses=HEALTH)
    async def ready() -> JSONResponse:
        """200 when the weights are bound and warmed and the inference thread is responsive; else 503."""
        return health(ctx.readiness_refusal())

    @app.api_route(Endpoint.PRIMARY, methods=HEALTH_METHODS, responses=HEALTH)
    async def primary() -> JSONResponse:
        """200 iff ready, role primary and not draining or drained (load balancers route on this); else 503."""
        return health(ctx.readiness_refusal() or roles.serving_refusal())

    @app.api_route(Endpoint.STANDBY, methods=HEALTH_METHODS, responses=HEALTH)
    async def standby() -> JSONResponse:
        """200 iff ready and a warm standby (weights bound, no KV cache); else 503."""
        return health(ctx.readiness_refusal() or roles.standby_refusal())

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

    @app.post(Endpoint.PROMOTE, dependencies=[require_token], responses=declare(401, 409))
    async def promote() -> JSONResponse:
        """standby -> primary: allocate the KV cache, then serve. Idempotent (a ready primary answers
        "already primary"); a drained primary resumes serving. The reply carries ``duration_ms``.

        200 done or nothing to do; 401 bad or missing token; 409 a drain is in progress."""
        was_standby = roles.role is Role.STANDBY
        outcome = await roles.promote()
        if outcome.changed and was_standby:
            metrics.promotions.inc()
            metrics.promotion_duration.observe(float(outcome.details["duration_ms"]) / 1000)
        return role_change("promote", outcome)

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

    @app.get(Endpoint.MODELS, responses=SERVING)
    async def models() -> JSONResponse:
        """200 the served model; 503 when not serving (standby, draining, drained)."""
        if reason := roles.serving_refusal():
            return error(503, reason, "unavailable")
        model = {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "hotweights"}
        return JSONResponse({"object": "list", "data": [model]})

    @app.post(
        Endpoint.COMPLETIONS,
        response_model=None,
        responses=declare(400, 404, 500, 503)
        | {200: {"content": {"application/json": {}, "text/event-stream": {}}, "description": "the completion"}},
    )
    async def completions(request: CompletionRequest) -> Response:
        """OpenAI completions; ``stream`` gives server-sent events ending in ``data: [DONE]``.

        200 the completion (or the stream); 400 a bad field, named in ``error.param``; 404 an unknown
        ``model``; 503 not serving (standby, draining, drained) or cancelled by a drain deadline or
        shutdown; 500 the generation failed."""
        if reason := roles.serving_refusal():
            return error(503, reason, "unavailable")
        if request.model is not None and request.model != ctx.model_name:
            return error(
                404, f"model {request.model!r} is not served here; try {ctx.model_name!r}", "not_found_error", "model"
            )
        prompt_ids = [ctx.tokenizer.encode(prompt).ids for prompt in request.prompts]
        for ids in prompt_ids:
            if not ids:
                return error(400, "prompt is empty after tokenization", "invalid_request_error", "prompt")
            if len(ids) + request.max_tokens > ctx.context_tokens:
                message = (
                    f"prompt ({len(ids)} tokens) + max_tokens ({request.max_tokens}) exceeds this engine's "
                    f"{ctx.context_tokens}-token context (--kv-cache-tokens)"
                )
                return error(400, message, "invalid_request_error", "max_tokens")
        roles.admit()
        run = CompletionRun.start(request, ctx.model_name, prompt_ids, ctx.tokenizer, ctx.stop_ids, ctx.scheduler)

        def close() -> None:
            run.cancel()
            roles.release()
            usage = run.usage()
            metrics.prompt_tokens.inc(usage["prompt_tokens"])
            metrics.completion_tokens.inc(usage["completion_tokens"])
            metrics.request_latency.observe(time.perf_counter() - run.started)
            if run.first_token_s is not None:
                metrics.time_to_first_token.observe(run.first_token_s)

        if request.stream:
            return ClosingStream(run.sse(), close)
        try:
            return JSONResponse(await run.collect())
        except GenerationAborted as exc:
            if exc.finish.reason == "cancelled":
                return error(503, f"{exc}: the engine is draining or shutting down", "unavailable")
            return error(500, str(exc), "internal_error")
        finally:
            close()

    @app.get(Endpoint.METRICS, response_class=PlainTextResponse)
    async def prometheus() -> Response:
        """200 the engine's metrics in the Prometheus text format."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [(".".join(str(p) for p in e["loc"][1:]) or "body", e["msg"]) for e in exc.errors()]
        message = "; ".join(f"{where}: {msg}" for where, msg in problems)
        return error(400, message, "invalid_request_error", problems[0][0].split(".")[0])

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
