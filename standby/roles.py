"""Who this engine is (primary or standby) and what it is doing (ready, draining, drained).

Policy lives here: when ``/primary``, ``/standby`` and ``/v1`` say yes, and which role changes
are allowed. The mechanisms it drives belong to a ``Capacity``: the reference engine's
(``KvCapacity``) allocates and releases the KV cache and cancels sequences on the scheduler; the
agent's (``hotweights.standby.agent``) cancels the requests it passes to a vLLM or SGLang engine.
Checks return None or a reason; every role change returns an ``Outcome`` whose message is one
sentence saying what happened and why. All methods run on the event loop; the role-change lock
serialises promote, drain and demote.

    standby --promote--> primary/ready --drain--> primary/draining --> primary/drained
       ^                      ^                                             |  |
       |                      +-------------------- promote (resume) -------+  |
       +------------------------ demote (drains first, releases KV) -----------+
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from hotweights.contract import Role, State

if TYPE_CHECKING:  # the agent's roles have neither: it imports this without torch
    from hotweights.standby.decoder import Decoder
    from hotweights.standby.scheduler import Scheduler

CANCEL_GRACE_S = 2.0  # after a drain deadline cancels requests, how long they get to unwind


@dataclass(frozen=True)
class Outcome:
    """The answer to a role change: refused (accepted False) or done, with or without a change."""

    accepted: bool
    changed: bool
    message: str
    details: dict[str, object] = field(default_factory=dict)


class Capacity(Protocol):
    """What a role change does beneath the roles. ``acquire`` and ``release`` block (they run in a
    thread) and return the reply's details and a phrase for its message; ``release`` raises
    RuntimeError when requests would not unwind within ``grace_s``."""

    def acquire(self) -> tuple[dict[str, object], str]: ...

    def release(self, grace_s: float) -> tuple[dict[str, object], str]: ...

    def cancel_all(self) -> object: ...

    def keep_cut(self, keep: bool) -> None:
        """While ``keep`` (the engine does not serve), what the requests cancelled meanwhile computed is kept for the
        next primary to continue them from; False: given up (it serves again)."""
        ...

    async def drained(self) -> dict[str, object]:
        """Details a finished drain adds to its reply (e.g. the engine's own count of running requests)."""
        ...


@dataclass
class KvCapacity:
    """The reference engine's: a primary holds a KV cache, a standby none, unless ``reserved``.

    ``allocate`` builds a decoder with a fresh KV cache (promote allocates it, and its time counts
    in the promote's). A ``reserved`` decoder (CUDA graphs point at its memory) is kept for the
    engine's life instead: promote attaches it and demote detaches it, allocating and freeing
    nothing.
    """

    scheduler: Scheduler
    allocate: Callable[[], Decoder]
    reserved: Decoder | None = None

    def acquire(self) -> tuple[dict[str, object], str]:
        decoder = self.reserved or self.allocate()
        self.scheduler.attach_kv(decoder)
        phrase = "reserved at start-up" if self.reserved else "allocated"
        return {"kv_cache_bytes": decoder.nbytes}, f"{decoder.nbytes} bytes of KV cache {phrase}"

    def release(self, grace_s: float) -> tuple[dict[str, object], str]:
        """Detach the KV cache (close it unless ``reserved``); the slots kept for a successor go with the deposit
        handed over to the daemon (``Scheduler.release_kv``)."""
        decoder, kept = self.scheduler.release_kv(grace_s)
        handed = {"kv_slots_handed_over": kept}
        over = f", the slots of {kept} cut request(s) handed over to the next primary" if kept else ""
        if decoder is not None and decoder is self.reserved:
            return handed | {"kv_cache_bytes_released": 0}, f"kept {decoder.nbytes} bytes of KV cache reserved{over}"
        freed = 0
        if decoder is not None:
            freed = decoder.nbytes
            decoder.close()
        return handed | {"kv_cache_bytes_released": freed}, f"released {freed} bytes of KV cache{over}"

    def held_bytes(self) -> int:
        """KV cache bytes this engine holds: the reserved cache, else the attached one."""
        return self.reserved.nbytes if self.reserved else self.scheduler.kv_cache_bytes

    def cancel_all(self) -> object:
        return self.scheduler.cancel_all()

    def keep_cut(self, keep: bool) -> None:
        self.scheduler.keep_cut(keep)

    async def drained(self) -> dict[str, object]:
        return {}


class Roles:
    def __init__(self, role: Role, capacity: Capacity, drain_timeout_s: float) -> None:
        self.role = role
        self.state = State.READY
        self.in_flight = 0  # admitted /v1 requests not yet answered
        self.capacity = capacity
        self.drain_timeout_s = drain_timeout_s
        self._idle = asyncio.Event()  # set while in_flight == 0
        self._idle.set()
        self._lock = asyncio.Lock()

    # --- checks: None when the answer is yes, else the reason ---------------------------------

    def serving_refusal(self) -> str | None:
        """Whether this engine serves: /primary answers 200 and new /v1 requests start."""
        if self.role is Role.STANDBY:
            return "this engine is a warm standby; send requests to the primary"
        if self.state is not State.READY:
            return f"this engine is a {self.state} primary and takes no new requests"
        return None

    def standby_refusal(self) -> str | None:
        if self.role is not Role.STANDBY:
            return f"this engine is a {self.state} primary"
        return None

    # --- in-flight accounting -----------------------------------------------------------------

    def admit(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    # --- role changes ---------------------------------------------------------------------------

    async def promote(self) -> Outcome:
        start = time.perf_counter()
        async with self._lock:
            if self.role is Role.PRIMARY:
                if self.state is State.DRAINING:
                    return Outcome(False, False, "a drain is in progress; promote again once it has drained")
                if self.state is State.DRAINED:
                    self.capacity.keep_cut(False)
                    self.state = State.READY
                    return Outcome(True, True, "resumed serving: this primary was drained", _ms(start))
                return Outcome(True, False, "already primary", _ms(start))
            acquired, phrase = await asyncio.to_thread(self.capacity.acquire)
            self.role, self.state = Role.PRIMARY, State.READY
            details = _ms(start) | acquired
            return Outcome(True, True, f"promoted to primary in {details['duration_ms']} ms, {phrase}", details)

    async def drain(self, timeout_s: float | None = None) -> Outcome:
        """Stop taking requests now; let in-flight ones finish until the deadline, then cancel them."""
        self._start_draining()
        async with self._lock:
            return await self._drain(timeout_s)

    async def demote(self, timeout_s: float | None = None) -> Outcome:
        """Drain (if not drained yet), release the KV cache, become a standby."""
        start = time.perf_counter()  # "already standby" is decided under the lock: a promote may be under way
        self._start_draining()
        async with self._lock:
            if self.role is Role.STANDBY:
                return Outcome(True, False, "already standby", _ms(start))
            drained = await self._drain(timeout_s)
            if not drained.accepted:
                return drained
            try:
                released, phrase = await asyncio.to_thread(self.capacity.release, CANCEL_GRACE_S)
            except RuntimeError as exc:  # sequences that would not unwind: still a drained primary
                return Outcome(False, False, f"the KV cache was not released: {exc}", drained.details | _ms(start))
            self.role, self.state = Role.STANDBY, State.READY
            details = drained.details | _ms(start) | released
            return Outcome(True, True, f"demoted to standby: {drained.message}; {phrase}", details)

    def stop_serving(self) -> None:
        """From this instant /primary and /v1 refuse; a demote or a promote follows (fencing's)."""
        self._start_draining()

    def _start_draining(self) -> None:
        """From this instant /primary and /v1 refuse (no await before it, so no request slips in)."""
        if self.role is Role.PRIMARY and self.state is State.READY:
            self.capacity.keep_cut(True)  # what the gateway cuts from now on goes on elsewhere (standby.kvshare)
            self.state = State.DRAINING

    async def _drain(self, timeout_s: float | None) -> Outcome:
        # Again under the lock: a promote queued ahead of this call may have resumed a drained primary.
        self._start_draining()
        if self.role is Role.STANDBY:
            return Outcome(False, False, "this engine is a standby: there is nothing to drain")
        if self.state is State.DRAINED:
            return Outcome(True, False, "already drained", {"drained": True, "in_flight": 0, "duration_ms": 0.0})
        start = time.perf_counter()
        timeout_s = self.drain_timeout_s if timeout_s is None else timeout_s
        waiting = self.in_flight
        cancelled = 0
        if not await _wait(self._idle, timeout_s):
            cancelled = self.in_flight
            self.capacity.cancel_all()
            await _wait(self._idle, CANCEL_GRACE_S)
        details = _ms(start) | {
            "drained": self.in_flight == 0,
            "finished": waiting - cancelled,
            "cancelled": cancelled,
            "in_flight": self.in_flight,
        }
        if self.in_flight:
            return Outcome(False, False, f"{self.in_flight} request(s) did not stop after being cancelled", details)
        self.state = State.DRAINED
        details |= await self.capacity.drained()
        message = f"drained in {details['duration_ms']} ms: {waiting - cancelled} request(s) finished"
        if cancelled:
            message += f", {cancelled} cancelled at the {timeout_s:g} s deadline"
        return Outcome(True, True, message, details)


async def _wait(event: asyncio.Event, timeout_s: float) -> bool:
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except TimeoutError:
        return False
    return True


def _ms(start: float) -> dict[str, object]:
    return {"duration_ms": round((time.perf_counter() - start) * 1000, 3)}
