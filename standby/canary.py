"""The canary: a short greedy completion of a fixed prompt whose answer every engine of the same weights must give.

An engine whose memory went bad, or whose kernels compute garbage, goes on answering its health checks and serving
wrong text. The controller finds it by asking every engine, primary and standbys alike, for the canary
(``POST /canary``, behind the bearer token, every ``health.canary_interval_ms``) and comparing the answers of the
engines that serve the same weights (``controller.graywatch``). Here the engine computes it: CANARY_PROMPT's ids,
then CANARY_TOKENS greedy tokens, prefilled and decoded by a ``Decoder`` of its own (one slot of CANARY_KV_TOKENS
positions, eager), off the inference thread, so that a standby (no KV cache) answers too and a primary's queue
never delays it. Its decode steps are timed into a ``StepTimes`` of the canary's own (``CANARY_WATCH``): the reply
says how slow they were against the canary's best (``standby.steptimes``), and ``/health/ready`` says it of an
engine that has not served lately (a standby's only measure of its device's speed). The drill
faults (``standby.drillfaults``) apply to it as to serving.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse
from tokenizers import Tokenizer

from hotweights.bearer import bearer_check
from hotweights.contract import Endpoint
from hotweights.standby.contract_routes import declare, error
from hotweights.standby.decoder import Decoder
from hotweights.standby.model import KVCache, Transformer
from hotweights.standby.steptimes import WATCH, StepTimes, StepWatch

CANARY_PROMPT = "The canary sings of"  # the prompt every engine completes
CANARY_TOKENS = 4  # greedy tokens after it
CANARY_KV_TOKENS = 32  # the canary decoder's one slot
CANARY_WATCH = StepWatch(StepTimes(), WATCH.faults)  # the canary's steps: timed apart from serving's, same faults


class Canary:
    """One engine's canary: its own one-slot decoder, made on first use, one run at a time."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer) -> None:
        self.model = model
        self.prompt_ids = tokenizer.encode(CANARY_PROMPT).ids
        self.watch = CANARY_WATCH
        self._decoder: Decoder | None = None
        self._lock = asyncio.Lock()

    async def answer(self) -> dict[str, object]:
        """The canary's tokens, how long its decode steps took against their best, and its duration."""
        async with self._lock:
            start = time.monotonic()
            tokens = await asyncio.to_thread(self.run)
            slowness = self.watch.times.since(start)
            return {"tokens": tokens, "slowness": slowness.to_json(), "duration_ms": (time.monotonic() - start) * 1e3}

    def run(self) -> list[int]:
        """CANARY_TOKENS greedy tokens after CANARY_PROMPT (on a thread of its own)."""
        if self._decoder is None:
            model = self.model
            kv = KVCache.allocate(model.config, model.tp, 1, CANARY_KV_TOKENS, model.device, model.dtype)
            self._decoder = Decoder(model, kv, watch=self.watch)
        token = int(self._decoder.prefill(0, [self.prompt_ids])[0].argmax())
        tokens, position = [token], len(self.prompt_ids)
        while len(tokens) < CANARY_TOKENS:
            _, greedy = self._decoder.decode([token], [position])
            token, position = greedy[0], position + 1
            tokens.append(token)
        return tokens


def add_canary_route(app: FastAPI, canary: Canary, token: str | None, body: dict[str, object], ranks: int) -> None:
    """``POST /canary`` on ``app``: the canary's answer with ``body`` (the engine's id and fingerprint); 409 for an
    engine of several ranks (its model runs on all of them at once)."""

    @app.post(Endpoint.CANARY, dependencies=[Depends(bearer_check(token))], responses=declare(401, 409))
    async def run_canary() -> JSONResponse:
        """The canary (module docstring): 200 with ``tokens`` and ``slowness``; 401 bad or missing token; 409 with
        tensor parallelism."""
        if ranks > 1:
            return error(409, "the canary runs on engines of one rank only", "unavailable")
        return JSONResponse(body | await canary.answer())
