"""The gateway's own answers (its refusals, OpenAI-shaped) and the upstream failures that lead to them."""

from __future__ import annotations

import json

from starlette.responses import JSONResponse

from hotweights.admission import RETRY_AFTER_S
from hotweights.contract import SUSPECT_REQUEST

SUSPECT_CLIENT = "suspect_client"  # the error type of a request refused because its client is at its bound


class SegmentFailed(Exception):
    """A migratable completion's upstream failed after its response began: the request continues elsewhere."""

    def __init__(self, message: str, *, failure: str = "", stalled: bool = False, suspect: bool = False) -> None:
        super().__init__(message)
        self.failure = failure  # the id of the engine's failure, when it failed with the request in flight
        self.stalled = stalled  # ... by no longer answering its probes (a stall, controller.suspects)
        self.suspect = suspect  # the request is not migrated because it is suspect (controller.suspects)

    def answer(self) -> JSONResponse:
        """The error a non-streamed client gets: 422 when the request is suspect, else 503."""
        return suspect_answer(str(self)) if self.suspect else unavailable(str(self))

    def event(self) -> bytes:
        """The error event that ends a streamed client's response."""
        kind = SUSPECT_REQUEST if self.suspect else "unavailable"
        return sse_event(error_body(str(self), kind))


class UpstreamFailed(Exception):
    """The upstream failed before any byte reached the client: the request may go elsewhere (or, of kind
    ``busy``, to the same engine once it has a slot)."""

    def __init__(self, kind: str, message: str, started: bool = True, timed_out: bool = False) -> None:
        """``started``: the engine had started the request (``controller.suspects.is_started``), so that its failure
        counts against it; ``timed_out``: a connection that was not accepted in time (kind ``connect``)."""
        super().__init__(message)
        self.kind = kind
        self.started = started
        self.timed_out = timed_out


def sse_event(payload: dict) -> bytes:
    """One server-sent event holding ``payload`` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def not_found(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, "not_found_error"), status_code=404)


def error_body(message: str, kind: str) -> dict:
    """An OpenAI-shaped error body."""
    return {"error": {"message": message, "type": kind, "param": None}}


def retry_after(seconds: int) -> dict[str, str]:
    return {"Retry-After": str(seconds)}


def refusal(status: int, message: str, kind: str, retry_after_s: int = RETRY_AFTER_S) -> JSONResponse:
    """An OpenAI-shaped error that tells the client to come back (``Retry-After``)."""
    return JSONResponse(error_body(message, kind), status_code=status, headers=retry_after(retry_after_s))


class Unaccepted(JSONResponse):
    """The 429 of a fresh request whose primary did not accept its connection in time while it serves
    (``Discovery.saturated``): the gateway's own refusal, after that wait (``hotweights_gateway_refusal_seconds``
    counts it apart)."""

    def __init__(self, url: str) -> None:
        message = f"overloaded: {url} did not accept a connection in time while it serves"
        super().__init__(error_body(message, "overloaded"), status_code=429, headers=retry_after(RETRY_AFTER_S))


def unavailable(message: str) -> JSONResponse:
    return refusal(503, message, "unavailable")


def suspect_answer(message: str) -> JSONResponse:
    return JSONResponse(error_body(message, SUSPECT_REQUEST), status_code=422)
