"""The engine's HTTP face: OpenAI completions, Patroni-style health checks, role changes, metrics.

Handlers never touch the model: compute runs on the scheduler's thread, a large request's validation, chat
template and tokenization in the intake's (``standby.intake``), and the health endpoints read plain attributes,
so they answer in milliseconds during long generations and whatever requests arrive. Completions pass
``admission`` once validated, counted as the prompts they generate: beyond the sequences generating and waiting
it allows, 429 at once; while it refuses even one prompt, a fresh completion's 429 is answered from its headers,
before its body is read (``early_refusal``).
Every error body is OpenAI-shaped: ``{"error": {"message", "type", "param"}}``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.types import Receive, Scope, Send
from tokenizers import Tokenizer

from hotweights.admission import Admission, Held, Refusal, retry_after
from hotweights.contract import (
    ADMITS_IN_HEADER,
    GATHER_MS_HEADER,
    MAX_GATHER_MS,
    OWED_HEADER,
    REPLAY_HEADER,
    WEIGHTS_HEADER,
    Endpoint,
)
from hotweights.httpguard import Early, parsed_json, short
from hotweights.requestschema import ChatRequest, CompletionRequest, Invalid, SamplingRequest
from hotweights.standby.canary import CANARY_WATCH, Canary, add_canary_route
from hotweights.standby.chat import ChatTemplate
from hotweights.standby.completions import Api, CompletionRun, GenerationAborted
from hotweights.standby.contract_routes import SERVING, add_contract_routes, declare, error, finish_app, unavailable
from hotweights.standby.intake import Intake, blocks_needed
from hotweights.standby.kvpool import BLOCK_SIZE
from hotweights.standby.metrics import EngineMetrics
from hotweights.standby.roles import Roles
from hotweights.standby.scheduler import Scheduler
from hotweights.standby.steptimes import WATCH, Slowness
from hotweights.standby.weights import LoadedModel

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
    kv_cache_bytes: Callable[[], int]  # KV cache bytes held now (attached, or reserved for CUDA graphs)
    cuda_graph_bytes: int  # device memory the decode and prefill CUDA graphs hold; 0 without graphs
    rank_pids: tuple[int, ...]  # every rank's pid, rank 0's (this process's) first; one without --tp-size
    group_refusal: Callable[[], str | None]  # why the other ranks of a tensor-parallel group are not ready
    admission: Admission  # completions generating and waiting at once; the rest get 429
    fingerprint: str = field(init=False)  # the weights' digest, computed once
    started: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.fingerprint = self.loaded.fingerprint.digest()

    def liveness_refusal(self) -> str | None:
        return None if self.scheduler.is_alive else "the inference thread has died"

    def readiness_refusal(self) -> str | None:
        """Weights are bound and warmed before the server listens, so readiness is the worker's health: alive, making
        progress while work is pending (``standby.progress``), going round its loop."""
        if not self.scheduler.is_alive:
            return "the inference thread has died"
        if reason := self.scheduler.stall_refusal():
            return reason
        stalled = time.monotonic() - self.scheduler.heartbeat
        if stalled > STALL_S:
            return f"the inference thread has not gone round its loop for {stalled:.0f} s"
        return self.group_refusal()

    def pool(self) -> dict[str, int]:
        """Its KV pool (``standby.kvpool``): the positions of a block, the blocks and those sequences hold now, the
        sequences running (holding blocks) and those waiting (for a slot, for their blocks, or to start)."""
        pool, admission = self.scheduler.pool(), self.admission
        waiting = admission.waiting + admission.short + pool["waiting"]
        used, running = pool["used"], pool["running"]
        return {
            "block_tokens": BLOCK_SIZE,
            "blocks": admission.blocks,
            "used": used,
            "running": running,
            "waiting": waiting,
        }

    def slowness(self) -> Slowness | None:
        """How slow its serving's recent decode steps were, else its canary's (``standby.steptimes``)."""
        return WATCH.times.recent() or CANARY_WATCH.times.recent()

    def health(self) -> dict[str, object]:
        return {
            "engine_id": self.engine_id,
            "role": self.roles.role,
            "state": self.roles.state,
            "model": self.model_name,
            "fingerprint": self.fingerprint,
            "weights": self.fingerprint,  # what its answers name (WEIGHTS_HEADER)
            "weight_cache": {"mode": self.loaded.mode, "source": self.loaded.source},
            "uptime_s": round(time.monotonic() - self.started, 3),
            "in_flight": self.roles.in_flight,
            "kv_cache_bytes": self.kv_cache_bytes(),
            "max_batch": self.admission.running,
            "kv_pool": self.pool(),
            "cuda_graph_bytes": self.cuda_graph_bytes,
            "pid": os.getpid(),
            "rank_pids": list(self.rank_pids),
            "slowness": slowness.to_json() if (slowness := self.slowness()) else None,
        }


class ClosingStream(StreamingResponse):
    """A streaming response that runs ``on_close`` however it ends: done, client gone, or cancelled.

    Its body starts in the request's own task, at once (its headers sent, its first event asked for: a completion's
    sequences reach the inference thread then), with a task beside it that ends the stream when the client goes
    away. Starlette would start the body in a task of its own instead, behind every callback the event loop holds
    by then: in a burst (a new primary sent a failover's requests at once) the first request reached the model only
    once every other had been read and checked, 50-80 ms after it arrived."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        gone, finished = False, False

        async def watch() -> None:
            nonlocal gone
            await self.listen_for_disconnect(receive)
            if not finished:
                gone = True
                streaming.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            # the client went away: the stream ends, the request does not fail; any other cancellation goes on
            if not gone or streaming.uncancel():
                raise
        finally:
            finished = True
            watcher.cancel()
            self.on_close()


def build_app(ctx: EngineContext) -> FastAPI:
    app = FastAPI(title="hotweights engine", description="The engine contract: docs/engine-contract.md.")
    roles, metrics = ctx.roles, ctx.metrics
    add_contract_routes(app, ctx)
    canary = Canary(ctx.loaded.model, ctx.tokenizer)
    add_canary_route(
        app, canary, ctx.token, {"engine_id": ctx.engine_id, "fingerprint": ctx.fingerprint}, len(ctx.rank_pids)
    )

    @app.get(Endpoint.MODELS, responses=SERVING)
    async def models() -> JSONResponse:
        """200 the served model; 503 when not serving (standby, draining, drained)."""
        if reason := roles.serving_refusal():
            return unavailable(reason)
        model = {"id": ctx.model_name, "object": "model", "created": ctx.created, "owned_by": "hotweights"}
        return JSONResponse({"object": "list", "data": [model]})

    template = ChatTemplate.load(ctx.loaded.checkpoint.path)
    vocab_size = ctx.loaded.model.config.vocab_size
    intake = Intake(
        ctx.tokenizer, template, vocab_size, ctx.context_tokens, ctx.admission.running, ctx.admission.blocks
    )
    answers = declare(400, 404, 408, 413, 429, 500, 503) | {
        200: {"content": {"application/json": {}, "text/event-stream": {}}, "description": "the completion"}
    }

    @app.post(Endpoint.COMPLETIONS, response_model=None, responses=answers, openapi_extra=body(CompletionRequest))
    async def completions(
        http: Request,
        replay: Annotated[int | None, Header(alias=REPLAY_HEADER, ge=0)] = None,
        owed: Annotated[str | None, Header(alias=OWED_HEADER)] = None,
        gather_ms: Annotated[int, Header(alias=GATHER_MS_HEADER, ge=0, le=MAX_GATHER_MS)] = 0,
    ) -> Response:
        """OpenAI completions; ``stream`` gives server-sent events ending in ``data: [DONE]``.

                200 the completion (or the stream); 400 a bad field, named in ``error.param``; 404 an unknown
                ``model``; 408/413 a body too slow or too large; 429 overloaded (with ``Retry-After``); 503 not
                serving (standby, draining, drained) or cancelled by a drain deadline or shutdown; 500 the
                generation failed. The ``x-hotweights-replay`` header (a migrated request's continuation: how many of
        its prompt's last token ids were generated before) starts it from the failed engine's KV cache where its
        daemon keeps it (``standby.kvshare``), and otherwise, with ``--batch-invariant``, feeds those tokens through
        decode steps; with ``OWED_HEADER`` the request is one a gateway owes to a failover
        (``hotweights.admission``); ``GATHER_MS_HEADER`` gathers a stream's tokens of up to that many milliseconds
        into one chunk (``standby.completions``). Every answer names the weights that computed it
        (``WEIGHTS_HEADER``: the fingerprint). A list of prompts holds at most ``--max-batch`` of them."""
        size = len(await http.body())
        request = await intake.request(CompletionRequest, parsed_json(http.scope), size)
        if isinstance(request, Invalid):
            return request.response()
        if replay is None:
            replay = 0
        elif len(request.prompts) != 1 or isinstance(request.prompts[0], str) or replay >= len(request.prompts[0]):
            message = f"{REPLAY_HEADER} {replay} needs one prompt of token ids longer than that"
            return error(400, message, "invalid_request_error", REPLAY_HEADER)
        return await admitted(request, Api.COMPLETIONS, size, replay, owed is not None, gather_ms)

    @app.post(Endpoint.CHAT_COMPLETIONS, response_model=None, responses=answers, openapi_extra=body(ChatRequest))
    async def chat_completions(
        http: Request,
        owed: Annotated[str | None, Header(alias=OWED_HEADER)] = None,
        gather_ms: Annotated[int, Header(alias=GATHER_MS_HEADER, ge=0, le=MAX_GATHER_MS)] = 0,
    ) -> Response:
        """OpenAI chat completions (one choice), the messages rendered by the checkpoint's chat template
        or the built-in one (``standby.chat``); answers as ``/v1/completions`` does."""
        size = len(await http.body())
        request = await intake.request(ChatRequest, parsed_json(http.scope), size)
        if isinstance(request, Invalid):
            return request.response()
        return await admitted(request, Api.CHAT, size, owed=owed is not None, gather_ms=gather_ms)

    async def admitted(
        request: CompletionRequest | ChatRequest,
        api: Api,
        size: int,
        replay: int = 0,
        owed: bool = False,
        gather_ms: int = 0,
    ) -> Response:
        """The request run once admission lets it in (as many sequences as it has prompts) and its prompts
        (tokenized by the intake, in its thread for a body of ``size`` beyond its inline size) fit, and once the KV
        blocks they need are free (``Admission.reserve``: it waits for them, never refused), ``replay`` of
        its last tokens fed through decode steps (``standby.scheduler``); the refusal otherwise. ``owed``: admitted
        as a request owed to a failover (``hotweights.admission``: never refused for want of queue); ``gather_ms``:
        a stream's chunks gathered (``CompletionRun.sse``)."""
        ctx.scheduler.received()
        if reason := roles.serving_refusal():
            return unavailable(reason)
        if request.model is not None and request.model != ctx.model_name:
            message = f"model {short(request.model)!r} is not served here; try {ctx.model_name!r}"
            return error(404, message, "not_found_error", "model")
        prompts = request.prompt_count
        held = await ctx.admission.enter(owed, prompts)
        if isinstance(held, Refusal):
            return overloaded(held)
        handed_over = False  # to the run, whose close gives the admission slots back
        try:
            prompt_ids = await intake.prompt_ids(request, size)
            if isinstance(prompt_ids, Invalid):
                return prompt_ids.response()
            held = await ctx.admission.reserve(held, blocks_needed(prompt_ids, request.max_tokens))
            if reason := roles.serving_refusal():  # it may have changed while the request waited
                return unavailable(reason)
            handed_over = True
            return await serve(request, prompt_ids, api, held, replay, gather_ms)
        finally:
            if not handed_over:
                ctx.admission.leave(held)

    async def serve(
        request: SamplingRequest, prompt_ids: list[list[int]], api: Api, held: Held, replay: int = 0, gather_ms: int = 0
    ) -> Response:
        roles.admit()
        run = CompletionRun.prepare(request, ctx.model_name, prompt_ids, ctx.tokenizer, ctx.stop_ids, api, replay)

        def close() -> None:
            run.cancel()
            roles.release()
            ctx.admission.leave(held)
            usage = run.usage()
            metrics.prompt_tokens.inc(usage["prompt_tokens"])
            metrics.completion_tokens.inc(usage["completion_tokens"])
            metrics.request_latency.observe(time.perf_counter() - run.started)
            if run.first_token_s is not None:
                metrics.time_to_first_token.observe(run.first_token_s)

        weights = {WEIGHTS_HEADER: ctx.fingerprint}
        if request.stream:  # its headers go out before the model sees it (CompletionRun.submitted_sse)
            return ClosingStream(run.submitted_sse(ctx.scheduler, gather_ms / 1000), close, weights)
        run.submit(ctx.scheduler)
        try:
            return JSONResponse(await run.collect(), headers=weights)
        except GenerationAborted as exc:
            if exc.finish.reason == "cancelled":
                return unavailable(f"{exc}: the engine is draining or shutting down")
            return error(500, str(exc), "internal_error")
        finally:
            close()

    return documented(finish_app(app, metrics), CompletionRequest, ChatRequest)


def body(schema: type[BaseModel]) -> dict[str, object]:
    """The OpenAPI request body of an endpoint that takes ``schema`` (its handler validates the body itself, with
    the intake, rather than through FastAPI on the event loop); ``documented`` adds the schema."""
    content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema.__name__}"}}}
    return {"requestBody": {"required": True, "content": content}}


def documented(app: FastAPI, *schemas: type[BaseModel]) -> FastAPI:
    """``app`` whose OpenAPI document holds ``schemas`` (and what they refer to) among its components."""
    build = app.openapi

    def openapi() -> dict[str, object]:
        document = build()
        components = document.setdefault("components", {}).setdefault("schemas", {})
        if not all(schema.__name__ in components for schema in schemas):
            ref = "#/components/schemas/{model}"
            _, defs = models_json_schema([(schema, "validation") for schema in schemas], ref_template=ref)
            components.update(defs["$defs"])
        return document

    app.openapi = openapi  # type: ignore[method-assign]
    return app


COMPLETION_PATHS = frozenset({Endpoint.COMPLETIONS.value, Endpoint.CHAT_COMPLETIONS.value})
OWED = OWED_HEADER.encode()


def early_refusal(ctx: EngineContext) -> Early:
    """A fresh completion's 429 from its headers alone while the serving engine is full (``Admission.refusal``), so
    that a refusal costs the event loop that feeds the inference thread no body, parse or validation; anything else
    (an owed request, one to an engine that does not serve, any other path) goes on to its handler."""

    def early(scope: Scope) -> JSONResponse | None:
        if scope["path"] not in COMPLETION_PATHS or any(name == OWED for name, _ in scope["headers"]):
            return None
        if ctx.roles.serving_refusal() is not None or (refused := ctx.admission.refusal()) is None:
            return None
        return overloaded(refused)

    return early


def overloaded(refused: Refusal) -> JSONResponse:
    """429 for a completion beyond what admission allows, with ``Retry-After`` (``retry_after``) and, when the engine
    expects to queue a fresh request again in ``refused.admits_in_s``, ``ADMITS_IN_HEADER`` for the gateway."""
    response = error(429, refused.reason, "overloaded")
    response.headers["Retry-After"] = str(retry_after(refused.admits_in_s))
    if refused.admits_in_s is not None:
        response.headers[ADMITS_IN_HEADER] = str(round(refused.admits_in_s * 1000))
    return response
