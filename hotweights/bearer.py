"""The bearer-token check of the servers built on FastAPI (the engine's and agent's routes, the controller's API).

Apart from ``hotweights.contract`` so that what needs only the contract's words (the gateway, the command-line
clients, the daemon) starts without FastAPI's imports.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import HTTPException, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from hotweights.contract import CHALLENGE, TOKEN_REQUIRED, token_matches

BEARER = HTTPBearer(
    auto_error=False,  # the check below answers 401 itself, the same way whatever the header holds
    scheme_name="bearer",
    description="`Authorization: Bearer <token>`; required by mutations only when the server has a token",
)
CREDENTIALS = Security(BEARER)
UNAUTHORIZED = {401: {"description": "a bearer token is required and was missing or wrong (WWW-Authenticate: Bearer)"}}


def bearer_check(token: str | None) -> Callable[..., Awaitable[None]]:
    """A FastAPI dependency for mutations: with ``token`` set, the request needs
    ``Authorization: Bearer <token>`` (compared in constant time), else it is refused with 401 and
    ``WWW-Authenticate: Bearer``; with ``token`` None everything passes. Depending on it declares
    the bearer security scheme in the OpenAPI document."""

    async def require_token(credentials: HTTPAuthorizationCredentials | None = CREDENTIALS) -> None:
        if not token_matches(credentials.credentials if credentials else "", token):
            raise HTTPException(401, TOKEN_REQUIRED, headers=CHALLENGE)

    return require_token
