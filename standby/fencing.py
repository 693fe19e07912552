"""The engine's side of multi-host fencing: fencing tokens and the primary's lease (Patroni's rule, "no leader
key, no primary", enforced where it matters: in the engine that serves).

With ``[dcs]`` a controller promotes an engine only after an etcd transaction won its group's leader key, and
passes the key's revision as the fencing token with ``/promote``; every loop it renews the primary with
``/lease``, saying for how long (``lease_s``) its etcd lease is still certainly valid. Here:

- a promote or renewal carrying a token lower than the highest this engine has seen is refused (409): it
  comes from a controller that lost the key;
- once any token was seen, a standby's promote without one is refused too (a single-host controller does not
  send tokens and never meets such an engine); a primary's (a drained one resuming) keeps its lease;
- a renewal carrying a higher token than the primary's own tells it that a newer leader exists: it demotes
  itself;
- a primary whose lease runs out before the next renewal demotes itself (its ``/primary`` turns 503 at the
  deadline, in-flight requests are cancelled at once).

The deadline runs on the event loop's monotonic clock and each renewal gives a duration, not a time: a wall
clock jump on either side changes nothing. Without tokens (single host) nothing here ever acts.
"""

from __future__ import annotations

import asyncio
import logging

from hotweights.contract import Role
from hotweights.standby.roles import Outcome, Roles

log = logging.getLogger(__name__)


class Fencing:
    def __init__(self, roles: Roles) -> None:
        self.roles = roles
        self.token = 0  # the highest fencing token seen; 0: none (single-host mode)
        self.timer: asyncio.TimerHandle | None = None  # the primary's lease deadline
        self.demoting: asyncio.Task | None = None

    def promote_refusal(self, token: int | None) -> str | None:
        """None when a promote carrying ``token`` may proceed, else why not. A primary's promote without a
        token (resuming a drained primary, or "already primary") keeps the lease it has and passes."""
        if token is None and self.token and self.roles.role is not Role.PRIMARY:
            return f"this engine is fenced by tokens (highest {self.token}); a promote must carry one"
        if token is not None and token < self.token:
            return f"stale fencing token {token}: this engine has seen {self.token}, from a newer leader"
        return None

    def promoted(self, token: int | None, lease_s: float | None) -> None:
        """After a promote that passed ``promote_refusal``: remember the token, arm the lease deadline."""
        if token is not None:
            self.token = max(self.token, token)
        if lease_s is not None:
            self._arm(lease_s)

    def renew(self, token: int, lease_s: float) -> Outcome:
        """``/lease``: extend a primary's lease; refuse a stale token; demote on a newer one."""
        if token < self.token:
            return Outcome(False, False, f"stale fencing token {token}: this engine has seen {self.token}")
        if token > self.token:
            self.token = token
            if self.roles.role is Role.PRIMARY:
                self._demote(f"a newer leader holds fencing token {token}")
                return Outcome(True, True, f"demoting: a newer leader holds fencing token {token}")
            return Outcome(True, False, f"fencing token {token} recorded; this engine is a standby")
        if self.roles.role is not Role.PRIMARY:
            return Outcome(False, False, "this engine is a standby: there is no primary lease to renew")
        self._arm(lease_s)
        return Outcome(True, False, f"primary lease renewed for {lease_s:g} s (fencing token {token})")

    def _arm(self, lease_s: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(lease_s, self._expire, lease_s)

    def _expire(self, lease_s: float) -> None:
        self.timer = None
        if self.roles.role is Role.PRIMARY:
            self._demote(f"its lease ran out ({lease_s:g} s without a renewal: no leader key, no primary)")

    def _demote(self, why: str) -> None:
        """Stop serving now (``/primary`` 503 before this returns), finish the demote in the background."""
        log.warning("demoting itself: %s", why)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.roles.stop_serving()
        self.demoting = asyncio.get_running_loop().create_task(self.roles.demote(0.0), name="fenced-demote")
