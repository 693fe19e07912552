"""The one vocabulary of the timelines: the kind of every event the controller and the gateway record
(``GET /events``, ``events.jsonl``, ``GET /gateway/events``), the fields each kind carries, and how a failover came
about.

An event is a JSON object: ``seq``, ``time``, ``kind`` and ``message``, then the fields of its kind. Every field is an
``EventField`` (its name on the wire and the type of its value, one meaning in every kind that carries it), and every
kind an ``EventKind`` whose ``fields`` are the ones it may carry: ``EventLog.record`` refuses any other. The
controller writes them, and the command-line clients, the drills and the benchmarks read them, all from here: a new
kind or field is a member here, and a reader names the member (``EventKind.PROMOTE``, ``EventField.PROMOTE_MS``),
never its string.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from typing import Self


class FailoverKind(StrEnum):
    """How the role moved (a ``failover`` event's ``mode``, the failover metrics' ``kind`` label)."""

    AUTOMATIC = "automatic"  # the loop's, after the primary failed
    FORCED = "forced"  # on request (``POST /failover``): the primary fenced whatever its state
    SWITCHOVER = "switchover"  # planned (``POST /switchover``): drained, promoted, demoted


class EventField(StrEnum):
    """A field an event carries besides its ``seq``, ``time``, ``kind`` and ``message``: its name, and
    ``value_type``, the type of its value. Durations (``*_ms``) are milliseconds (``hotweights.stats.ms``)."""

    value_type: object

    def __new__(cls, name: str, value_type: object) -> Self:
        field = str.__new__(cls, name)
        field._value_ = name
        field.value_type = value_type
        return field

    # Whom it is about.
    MEMBER = "member", str  # an engine slot's id
    GROUP = "group", int
    SERVICE = "service", str  # a service's id: a cache daemon, a gateway worker
    SLOT = "slot", str  # an engine slot's or a service's id
    REQUEST = "request", str  # a completion's id at the gateway
    DEVICE = "device", str  # a GPU, as cluster.toml names it (cuda:N), or several, comma-separated
    # How the role moved.
    MODE = "mode", FailoverKind
    OLD = "old", str | None  # the primary before (none when a forced failover found none)
    NEW = "new", str  # the primary after
    KEPT = "kept", str  # the primary a split brain kept
    FENCED = "fenced", list[str]  # the primaries it fenced
    PRIMARY = "primary", str  # the primary once a rollout is done
    TO = "to", str  # the URL of the engine a completion continued on
    # How long its parts took.
    DETECT_MS = "detect_ms", float  # from the failure (an exit, a first failed check) to its detection
    FENCE_MS = "fence_ms", float
    PROMOTE_MS = "promote_ms", float
    POST_MS = "post_ms", float  # a promotion's POST /promote as the controller saw it
    ENGINE_MS = "engine_ms", float | None  # the engine's own part of it (as it reported)
    DRAIN_MS = "drain_ms", float
    DEMOTE_MS = "demote_ms", float
    TOTAL_MS = "total_ms", float
    DURATION_MS = "duration_ms", float | None  # a service's start; a drain (as the engine reported)
    STOP_MS = "stop_ms", float
    READY_MS = "ready_ms", float
    FILL_MS = "fill_ms", float  # a cache daemon's filling of its arena
    YIELD_MS = "yield_ms", float
    BACK_MS = "back_ms", float | None  # from its group settling to the batch engine serving again
    DEGRADED_MS = "degraded_ms", float  # how long the group has run without full redundancy
    REOPEN_MS = "reopen_ms", float  # from the cut to the next primary's answer
    # What else it found.
    REASON = "reason", str
    OK = "ok", bool
    SPARE = "spare", bool  # the engine or daemon came from the group's spare
    ATTEMPTS = "attempts", int
    FILL_SOURCE = "fill_source", str | None  # where a cache daemon filled its arena from
    ADOPTED = "adopted", list[str]  # processes a starting controller found running
    KV_SLOTS_HANDED_OVER = "kv_slots_handed_over", int  # cut requests whose KV cache the old primary handed over
    STEP = "step", str  # a rollout's step: its plan's word, "done", "reverted" or "aborted"
    INDEX = "index", int  # the step's number, of ``of``
    OF = "of", int
    GENERATION = "generation", int  # a weight generation's number
    STANDBYS_READY = "standbys_ready", int
    STANDBYS_WANTED = "standbys_wanted", int
    TOKENS_REPLAYED = "tokens_replayed", int
    FIRST_SEQ = "first_seq", int  # the first and last seq of the events dropped unwritten
    LAST_SEQ = "last_seq", int


_F = EventField  # the short name the table below uses
_ENGINE = (_F.MEMBER, _F.GROUP)
_REDUNDANCY = (_F.GROUP, _F.DEGRADED_MS, _F.STANDBYS_READY, _F.STANDBYS_WANTED, _F.REASON)
_SERVICE_START = (_F.SERVICE, _F.GROUP, _F.DURATION_MS, _F.ATTEMPTS, _F.SPARE, _F.FILL_SOURCE, _F.FILL_MS)


class EventKind(StrEnum):
    """What an event records (its ``kind``), and ``fields``, the fields it may carry besides ``message``."""

    fields: frozenset[EventField]

    def __new__(cls, name: str, *fields: EventField) -> Self:
        kind = str.__new__(cls, name)
        kind._value_ = name
        kind.fields = frozenset(fields)
        return kind

    # An engine primary's failure and what the loop did about it (``controller.ha``).
    DETECT = "detect", *_ENGINE, _F.DETECT_MS, _F.FENCE_MS  # the primary failed
    FENCE = "fence", *_ENGINE, _F.DETECT_MS, _F.FENCE_MS  # an engine killed so that it cannot serve
    FENCE_FAILED = "fence_failed", *_ENGINE  # still alive after SIGKILL: nothing promoted beside it
    STRANGER = "stranger", *_ENGINE  # a process we do not supervise answers /primary 200 on a fenced engine's port
    NO_STANDBY = "no_standby", _F.GROUP  # no ready standby to promote
    PROMOTE = "promote", *_ENGINE, _F.PROMOTE_MS, _F.POST_MS, _F.ENGINE_MS  # a standby made primary
    # The role moved after a failure or on request.
    FAILOVER = "failover", _F.GROUP, _F.MODE, _F.OLD, _F.NEW, _F.DETECT_MS, _F.FENCE_MS, _F.PROMOTE_MS, _F.TOTAL_MS
    SPLIT_BRAIN = "split_brain", _F.GROUP, _F.KEPT, _F.FENCED  # several primaries in a group
    ELECT = "elect", _F.GROUP  # multi-host: this controller took its group's leader key
    # The REST intents (``controller.intents``) and rollouts (``controller.rollout``).
    SWITCHOVER = (  # planned: drained, promoted, demoted
        "switchover", _F.GROUP, _F.OLD, _F.NEW, _F.DRAIN_MS, _F.PROMOTE_MS, _F.DEMOTE_MS, _F.TOTAL_MS,
        _F.KV_SLOTS_HANDED_OVER,
    )  # fmt: skip
    DRAIN = "drain", *_ENGINE, _F.DURATION_MS
    ADD = "add", *_ENGINE
    DELETE = "delete", *_ENGINE
    CACHE_RESTART = "cache_restart", _F.SERVICE, _F.GROUP  # a cache daemon stopped to be respawned
    # A rolling restart's step ("aborted" when it stopped, "reverted" when a model update went back).
    ROLLOUT = (
        "rollout", *_ENGINE, _F.STEP, _F.INDEX, _F.OF, _F.PRIMARY, _F.GENERATION, _F.STOP_MS, _F.READY_MS, _F.TOTAL_MS
    )  # fmt: skip
    RETIRE = "retire", _F.SERVICE, _F.GROUP  # a model update's old weight generation released
    # Engine slots and services coming and going (``controller.ha``, ``controller.keepers``).
    ENGINE_START = "engine_start", _F.MEMBER, _F.SPARE  # an engine slot started (from a spare or cold)
    EXIT = "exit", _F.MEMBER, _F.SERVICE, _F.GROUP  # a standby (member) or a service exited
    START = "start", *_SERVICE_START  # a service's first start
    RESPAWN = "respawn", *_SERVICE_START  # a service started again after an exit
    START_FAILED = "start_failed", _F.SERVICE  # a service's start failed, retried with backoff
    HUNG = "hung", _F.SERVICE  # a service answered no probe: killed, to be respawned
    # A slot kept failing to start the same way: the stack stops (``controller.startfailures``).
    GAVE_UP = "gave_up", _F.SLOT, _F.REASON
    # A group's co-located batch engine (``controller.batch``).
    BATCH_EXIT = "batch_exit", *_ENGINE
    BATCH_RESTART = "batch_restart", *_ENGINE
    BATCH_YIELD = "batch_yield", *_ENGINE, _F.YIELD_MS  # it gave its KV cache up
    BATCH_RETURN = "batch_return", *_ENGINE, _F.BACK_MS, _F.PROMOTE_MS  # it took its KV cache back
    # Redundancy (``controller.redundancy``).
    REDUNDANCY_LOST = "redundancy_lost", *_REDUNDANCY
    REDUNDANCY_RESTORED = "redundancy_restored", *_REDUNDANCY
    REDUNDANCY_ALERT = "redundancy_alert", *_REDUNDANCY  # degraded longer than health.redundancy_alert_s
    # Gray failures (``controller.graywatch``).
    DEGRADED = "degraded", *_ENGINE, _F.REASON  # a primary far slower than its best and a standby's canary: switched
    WRONG_OUTPUT = "wrong_output", *_ENGINE, _F.REASON  # an engine's canary answer differs from the agreed one: fenced
    CANARY_AGREED = "canary_agreed"  # the canary's answer for a fingerprint set or changed
    ARENA_VERIFIED = "arena_verified", *_ENGINE, _F.OK  # a group's arena checked after a wrong answer or a GPU fault
    # NVML's word on a group's GPUs (``controller.gpuwatch``); ``member``: the group's primary.
    GPU_FAULT = "gpu_fault", *_ENGINE, _F.DEVICE, _F.REASON  # an Xid, ECC, a row remap: its primary fenced or not
    GPU_SLOWDOWN = "gpu_slowdown", *_ENGINE, _F.DEVICE, _F.REASON  # the hardware slowed it for degraded_for_s
    # The controller itself (``controller.commands``) and its timeline's file (``controller.events``).
    CONTROLLER_START = "controller_start", _F.ADOPTED
    CONTROLLER_STOP = "controller_stop"
    EVENTS_LOST = "events_lost", _F.FIRST_SEQ, _F.LAST_SEQ  # events dropped unwritten while the state dir failed
    # The gateway's own timeline (``gateway.migratingproxy``).
    MIGRATION = "migration", _F.REQUEST, _F.TO, _F.TOKENS_REPLAYED, _F.REOPEN_MS  # a cut completion continued
    MIGRATION_FAILED = "migration_failed", _F.REQUEST
    MIGRATION_RESTARTED = "migration_restarted", _F.REQUEST  # run again from its prompt


def undeclared(kind: EventKind | str, names: Iterable[str]) -> list[str]:
    """The names among ``names`` that ``kind`` does not declare as its fields, sorted (none: all are its)."""
    return sorted(set(names) - EventKind(kind).fields)
