"""The controller's side of the engine contract (``docs/engine-contract.md``): role changes and /primary."""

from __future__ import annotations

from typing import Any

import httpx

from hotweights.contract import Endpoint

ROLE_CHANGE_TIMEOUT_S = 10.0  # promote allocates the KV cache; big ones take a while on a GPU


class EngineUnreachable(Exception):
    """The engine did not answer (refused, reset or timed out)."""


class EngineApi:
    def __init__(self, client: httpx.AsyncClient, token: str | None) -> None:
        self.client = client
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def post(
        self, url: str, path: str, body: dict[str, Any] | None = None, timeout: float | None = None
    ) -> tuple[int, dict[str, Any]]:
        """POST a role change; returns (status, JSON reply). Raises EngineUnreachable."""
        try:
            response = await self.client.post(
                url + path, json=body, headers=self.headers, timeout=timeout or ROLE_CHANGE_TIMEOUT_S
            )
        except httpx.HTTPError as exc:
            raise EngineUnreachable(f"{url}{path}: {type(exc).__name__}: {exc}") from None
        try:
            return response.status_code, response.json()
        except ValueError:
            return response.status_code, {"message": response.text[:200]}

    async def is_primary(self, url: str, timeout: float = 1.0) -> bool:
        """Whether the engine answers 200 on /primary (what load balancers route on)."""
        return await self._answers(url + Endpoint.PRIMARY, timeout)

    async def is_standby(self, url: str, timeout: float = 1.0) -> bool:
        """Whether the engine answers 200 on /standby (a ready standby: weights bound, no KV cache)."""
        return await self._answers(url + Endpoint.STANDBY, timeout)

    async def _answers(self, url: str, timeout: float) -> bool:
        try:
            return (await self.client.get(url, timeout=timeout)).status_code == 200
        except httpx.HTTPError:
            return False
