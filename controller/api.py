"""The controller's REST API (FastAPI; OpenAPI at ``/docs``).

Reads come from a fresh snapshot. Mutations need ``Authorization: Bearer <token>`` when
``cluster.token_file`` is set; they never act themselves: they queue an intent for the HA loop
and wait for its answer, so they are serialised and never interleave with a failover. The loop's
refusals become status codes here and only here: NotFound 404, NotPossible 412, Conflict 409,
Unavailable 503 (also when the loop did not answer in time). A malformed body is 422 (FastAPI's
validation; the request models are strict, so ``{"group": false}`` is not group 0; the reason never
quotes the input), one that is not plain JSON 400 and one above ``cluster.api_max_body_bytes`` 413
(``hotweights.httpguard``). Each route
declares in ``responses`` every status code it answers, so the OpenAPI document is the whole truth.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any

from fastapi import Depends, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from hotweights.bearer import UNAUTHORIZED, bearer_check
from hotweights.contract import Endpoint
from hotweights.controller.cluster import Cluster
from hotweights.controller.decide import Intent
from hotweights.controller.events import EventLog
from hotweights.controller.ha import Ha
from hotweights.controller.intents import Conflict, NotFound, NotPossible, Refused, Unavailable
from hotweights.controller.metrics import ControllerMetrics
from hotweights.httpguard import short

STATUS = {NotFound: 404, NotPossible: 412, Conflict: 409, Unavailable: 503}
INTENT_TIMEOUT_S = 30.0  # plus the drain timeout for actions that drain
STALE_LOOP_S = 5.0  # /health turns 503 when the HA loop has not finished a cycle for this long
MAX_PROBLEMS = 10  # a 422 names at most this many bad fields
DETAIL_CHARS = 2000  # a refusal's detail (it may quote an engine name from the request) is cut to this
STRICT = ConfigDict(extra="forbid", strict=True)  # strict: a bool is not a number

STATUS_DESCRIPTIONS: dict[int, dict[str, object]] = {
    201: {"description": "added"},
    400: {"description": "a body that is not plain JSON (not UTF-8, NaN or out-of-range numbers, duplicate keys, ...)"},
    202: {"description": "accepted: it goes on in the background (watch GET /events)"},
    404: {"description": "unknown group or engine"},
    409: {"description": "conflicts with the cluster's state; `detail` says why"},
    412: {"description": "a precondition does not hold (no ready standby, no serving primary); `detail` says why"},
    503: {"description": "an engine or the HA loop did not answer in time, or an action failed; `detail` says why"},
} | UNAUTHORIZED


def declare(*codes: int) -> dict[int | str, dict[str, object]]:
    """OpenAPI ``responses``: the status codes an endpoint answers besides its success."""
    return {code: STATUS_DESCRIPTIONS[code] for code in codes}


class SwitchoverRequest(BaseModel):
    model_config = STRICT
    group: int | None = Field(default=None, ge=0, description="default: the candidate's group, else 0")
    candidate: str | None = Field(default=None, description="a ready standby; default: the best one")


class FailoverRequest(BaseModel):
    model_config = STRICT
    candidate: str = Field(description="the ready standby to promote")


class DrainRequest(BaseModel):
    model_config = STRICT
    timeout_s: float | None = Field(default=None, ge=0, le=86400, description="default: engine.drain_timeout_s")


class RolloutRequest(BaseModel):
    model_config = STRICT
    group: int | None = Field(default=None, ge=0, description="default: 0")
    model: str | None = Field(
        default=None,
        pattern=r"^/[^\x00]*$",
        description="a checkpoint directory on the controller's host, absolute: a model update onto these weights",
    )


class AddEngineRequest(BaseModel):
    model_config = STRICT
    group: int = Field(default=0, ge=0)


def build_app(ha: Ha, cluster: Cluster, events: EventLog, metrics: ControllerMetrics, token: str | None) -> FastAPI:
    app = FastAPI(
        title="hotweights controller",
        description="Supervises cache daemons and engines, fails over in under a second, and reports.",
    )
    started = time.monotonic()
    drain_timeout_s = cluster.config.engine.drain_timeout_s

    async def answer(outcome: Awaitable[dict[str, Any]], success: int = 200) -> JSONResponse:
        try:
            result = await outcome
        except Refused as exc:
            return JSONResponse({"detail": short(exc, DETAIL_CHARS)}, status_code=STATUS[type(exc)])
        return JSONResponse(result, status_code=success)

    async def act(action: Intent, timeout: float, success: int = 200, **params: object) -> JSONResponse:
        return await answer(ha.request(action, timeout, **params), success)

    mutation = [Depends(bearer_check(token))]

    @app.get("/health", responses=declare(503))
    async def health() -> JSONResponse:
        """200 while the HA loop goes round (liveness of the controller, not of the engines); 503 when
        its last cycle ended more than 5 s ago."""
        age = time.monotonic() - ha.heartbeat
        body = {"loop_age_ms": round(age * 1000, 1), "uptime_s": round(time.monotonic() - started, 3)}
        if age > STALE_LOOP_S:
            return JSONResponse(body | {"status": "stalled"}, status_code=503)
        return JSONResponse(body | {"status": "ok"})

    @app.get("/cluster")
    async def get_cluster() -> JSONResponse:
        """200: every engine (id, role, state, status, pid, port, device, last check, consecutive failures),
        every daemon or gateway process, the rollouts queued or running (group, step i of n, started), for
        each group's redundancy (``redundancy``: ready standbys wanted and had, warmed spares wanted and had,
        whether it is full, how long it has been degraded and why, whether that is alerting), every spare engine
        process each group has or wants (``spares``: pid, null for one not started yet, with the reason its last
        one failed; whether it is ready, i.e. attached and warmed up; how long it took or has taken to prepare;
        the device bytes it holds), each group's spare daemon process
        (``daemon_spares``: the daemon it waits to replace), each co-located batch engine (url, pid,
        whether it serves and why not, how often it yielded, how long its last return took), each group's weight
        generation (its number and checkpoint; each engine's ``generation`` says which one it maps), and ``dcs``:
        single-host, or this host's view of the leader keys in etcd."""
        snap = cluster.snapshot()
        return JSONResponse(
            {
                "name": cluster.config.cluster.name,
                "members": [m.to_json() for m in snap.members],
                "services": [s.to_json() for s in snap.services],
                "rollouts": [progress.to_json() for progress in ha.rollouts.values()],
                "redundancy": ha.redundancy.to_json(time.monotonic()),
                "spares": cluster.spares_json(snap),
                "daemon_spares": cluster.daemon_spares_json(),
                "batch": cluster.batch.describe(),
                "generations": cluster.generations_json(),
                "dcs": ha.leadership.describe(),
            }
        )

    @app.get("/primary", responses=declare(404, 503))
    async def get_primary(group: int | None = Query(default=None, ge=0)) -> JSONResponse:
        """200 with the serving primary of each group (or of ``group``); 503 when one has none (the body
        still lists the others); 404 unknown group."""
        snap = cluster.snapshot()
        groups = range(snap.groups) if group is None else [group]
        if group is not None and group >= snap.groups:
            return JSONResponse({"detail": f"no group {group}"}, status_code=404)
        primaries: dict[str, object] = {}
        for g in groups:
            serving = next((p for p in snap.primaries(g) if p.is_serving_primary), None)
            primaries[str(g)] = {"id": serving.id, "url": serving.url, "port": serving.port} if serving else None
        missing = [g for g, p in primaries.items() if p is None]
        body = {"groups": primaries} | (
            {"reason": f"no serving primary in group(s) {', '.join(missing)}"} if missing else {}
        )
        return JSONResponse(body, status_code=503 if missing else 200)

    @app.post("/switchover", dependencies=mutation, responses=declare(400, 401, 404, 409, 412, 503))
    async def switchover(request: SwitchoverRequest | None = None) -> JSONResponse:
        """Planned change of primary: drain it, promote ``candidate`` (or the best ready standby),
        demote the old primary to standby.

        200 done; 401 token; 404 unknown group or candidate; 412 no serving primary, or the candidate is
        not a ready standby (or none is); 409 the primary refused to drain or the promotion failed (the
        old primary resumed); 503 an engine did not answer; 422 bad body."""
        request = request or SwitchoverRequest()
        # Its steps may take a drain, a promotion and a demotion (which drains again): wait for all of them.
        wait_s = 2 * drain_timeout_s + 2 * INTENT_TIMEOUT_S
        return await act(Intent.SWITCHOVER, wait_s, group=request.group, candidate=request.candidate)

    @app.post(Endpoint.ROLLOUT, dependencies=mutation, responses=declare(400, 401, 404, 409, 412, 503))
    async def rollout(request: RolloutRequest | None = None) -> JSONResponse:
        """Rolling restart of ``group``: each standby in turn (stopped gracefully, started with cluster.toml's
        current engine settings, ready again), then a switchover to a restarted standby, then the old primary.

        200 done (``steps``, each with its durations; ``changed``: the engine settings taken on); 401 token;
        404 unknown group; 409 a rollout of the group is already running; 412 nothing restarted: no serving
        primary, no ready standby, or cluster.toml is invalid or changes more than engine settings; 503 a step
        failed and the rollout stopped there (the group keeps serving; ``detail`` names the step); 422 bad body.

        With ``model``, a model update: the group's next weight generation is loaded by a daemon of its own while
        the old one serves, the engines are restarted onto it as above, and the old generation's daemon is
        stopped at the end; 412 also when the model is invalid, is the one the group runs, or its arena does
        not fit beside the current one (the numbers are in ``detail``)."""
        switchover_wait_s = 2 * drain_timeout_s + 2 * INTENT_TIMEOUT_S
        request = request or RolloutRequest()
        return await answer(ha.rollout(request.group, switchover_wait_s, request.model))

    @app.post("/failover", dependencies=mutation, responses=declare(400, 401, 404, 412, 503))
    async def failover(request: FailoverRequest) -> JSONResponse:
        """Forced change of primary: fence (SIGKILL) the current one whatever its state, promote ``candidate``.

        200 done; 401 token; 404 unknown candidate; 412 the candidate is not a ready standby; 503 the
        promotion failed; 422 bad body (``candidate`` is required)."""
        return await act(Intent.FAILOVER, INTENT_TIMEOUT_S, candidate=request.candidate)

    @app.post("/engines/{engine_id}/drain", dependencies=mutation, responses=declare(400, 401, 404, 409, 503))
    async def drain(engine_id: str, request: DrainRequest | None = None) -> JSONResponse:
        """Drain an engine (a primary stops taking requests; in-flight ones finish until ``timeout_s``).

        200 drained; 401 token; 404 unknown engine; 409 the engine refused (a standby has nothing to
        drain); 503 the engine did not answer; 422 bad body."""
        timeout_s = request.timeout_s if request else None
        wait = (drain_timeout_s if timeout_s is None else timeout_s) + INTENT_TIMEOUT_S
        return await act(Intent.DRAIN, wait, engine_id=engine_id, timeout_s=timeout_s)

    @app.post("/engines/{engine_id}/promote", dependencies=mutation, responses=declare(401, 404, 409, 412, 503))
    async def promote(engine_id: str) -> JSONResponse:
        """Promote a standby of a group that has no primary, or resume a drained primary.

        200 done; 401 token; 404 unknown engine; 409 its group already has a live primary (use
        /switchover); 412 not a ready standby; 503 the promotion failed."""
        return await act(Intent.PROMOTE, INTENT_TIMEOUT_S, engine_id=engine_id)

    @app.post("/engines", dependencies=mutation, status_code=201, responses=declare(400, 401, 404, 409, 503))
    async def add_engine(request: AddEngineRequest | None = None) -> JSONResponse:
        """Add a standby to ``group`` on the next free port; it starts once the group's daemon serves.

        201 added (id, port, url); 401 token; 404 unknown group; 409 the group has ``max_engines`` engines;
        503 no answer in time; 422 bad body."""
        return await act(Intent.ADD, INTENT_TIMEOUT_S, success=201, group=(request or AddEngineRequest()).group)

    @app.delete("/engines/{engine_id}", dependencies=mutation, responses=declare(401, 404, 409, 503))
    async def delete_engine(engine_id: str) -> JSONResponse:
        """Stop an engine (SIGTERM, in-flight requests finish) and forget its slot.

        200 removed; 401 token; 404 unknown engine; 409 it is a live primary (switch over first); 503 it
        did not stop."""
        return await act(Intent.DELETE, INTENT_TIMEOUT_S, engine_id=engine_id)

    @app.post("/cache/{group}/restart", dependencies=mutation, status_code=202, responses=declare(401, 404, 503))
    async def restart_cache(group: int) -> JSONResponse:
        """Stop the group's cache daemon (each rank's, in a tensor-parallel group) and respawn it; engines keep
        serving.

        202 the old daemon stopped and a new one is loading (watch GET /events for "respawn"); 401
        token; 404 unknown group; 503 the old daemon did not stop; 422 ``group`` is not an integer."""
        return await act(Intent.RESTART_CACHE, INTENT_TIMEOUT_S, success=202, group=group)

    @app.get(Endpoint.EVENTS)
    async def get_events(
        limit: int = Query(default=100, ge=1, le=1000), kind: str | None = Query(default=None)
    ) -> JSONResponse:
        """200: the most recent events (oldest first), optionally only one ``kind`` (detect, fence,
        promote, failover, switchover, rollout, exit, respawn, ...), each with its durations in ``*_ms``."""
        return JSONResponse({"events": events.recent(limit, kind)})

    @app.get(Endpoint.METRICS, response_class=PlainTextResponse)
    async def prometheus() -> Response:
        """200: the controller's metrics in the Prometheus text format."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        """422 naming each bad field (cut short) and what it needs, never quoting the input: it may be
        large, or a value JSON cannot encode."""
        problems = [
            {"loc": [p if isinstance(p, int) else short(p, 80) for p in e["loc"]], "msg": e["msg"], "type": e["type"]}
            for e in exc.errors()[:MAX_PROBLEMS]
        ]
        return JSONResponse({"detail": problems}, status_code=422)

    return app
