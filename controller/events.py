"""The controller's timeline: detections, fences, promotions and respawns, with their durations.

The last ``keep`` events stay in memory for ``GET /events``; every event is also appended to
``events.jsonl`` in the state dir, one JSON object a line, so the history survives restarts. The
file is bounded: once it holds ``max_bytes`` it becomes ``events.jsonl.1`` (replacing the previous
one) and a new file begins, so the history on disk never exceeds twice ``max_bytes``. With no path
the events are kept in memory only. The gateway keeps a log of its own (its migrations) the same way.

A failed append (a full disk, EIO, a read-only state dir) fails nothing else: the file is left as it was (a
partial line is cut off again) and the events not yet written wait in memory, in order, for the next record or
the state dir's retry (``controller.statedir``), which appends them late with their own times. At most
``max_held`` wait; beyond, the oldest are dropped and the file gets one ``events_lost`` line in their place,
naming their sequence numbers, so every event is in the file or accounted for by such a line.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hotweights.controller.statedir import StateDirHealth
from hotweights.eventkinds import EventField, EventKind, undeclared

MAX_BYTES = 8 << 20  # events.jsonl rotates to events.jsonl.1 at this size
MAX_HELD = 10_000  # events kept in memory while the file cannot be written (a few MB); beyond, the oldest are dropped


def now_iso() -> str:
    return datetime.fromtimestamp(time.time(), UTC).isoformat(timespec="milliseconds")


class EventLog:
    def __init__(
        self,
        path: Path | None,
        keep: int = 1000,
        max_bytes: int = MAX_BYTES,
        max_held: int = MAX_HELD,
        health: StateDirHealth | None = None,
    ) -> None:
        """``health``: the state dir's, shared with ``state.json``'s writer (default: one of its own)."""
        self.path = path
        self.max_bytes = max_bytes
        self.max_held = max_held
        self.events: deque[dict[str, Any]] = deque(maxlen=keep)
        self.seq = 0
        self.held: deque[tuple[int, str]] = deque()  # (seq, line) not in the file yet, oldest first
        self.lost: tuple[int, int] | None = None  # the first and last seq of the events dropped from ``held``
        self.health = health or StateDirHealth(path.parent if path else None)
        self.health.watch(self.flush)

    def record(self, kind: EventKind, message: str, **fields: Any) -> dict[str, Any]:
        """Append one event; ``fields`` carry the subject (member, group) and durations (``*_ms``), each one that
        ``kind`` declares (``EventKind.fields``): TypeError for any other, a writer drifting from the vocabulary."""
        if extra := undeclared(kind, fields):
            raise TypeError(f"event {kind} declares no field {', '.join(extra)} (hotweights.eventkinds.EventKind)")
        self.seq += 1
        event = {"seq": self.seq, "time": now_iso(), "kind": kind, "message": message} | fields
        self.events.append(event)
        if self.path is not None:
            self._hold(self.seq, json.dumps(event))
            self.flush()
        return event

    def _hold(self, seq: int, line: str) -> None:
        """Keep ``line`` until it is written; the oldest held one makes room when ``max_held`` are (the dropped
        ones are always the oldest, so their seqs are one range)."""
        full = len(self.held) >= self.max_held
        if full:
            dropped, _ = self.held.popleft()
            self.lost = (self.lost[0] if self.lost else dropped, dropped)
        self.held.append((seq, line))
        self.health.events_held(len(self.held), dropped=int(full))

    def flush(self) -> bool:
        """Append what is held (after an ``events_lost`` line for what was dropped), all or nothing; True when
        nothing is held any more."""
        if self.path is None or not (self.held or self.lost):
            return True
        lines = [self._lost_line(*self.lost)] if self.lost else []
        lines += [line for _, line in self.held]
        try:
            append_lines(self.path, lines, self.max_bytes)
        except OSError as exc:
            self.health.failed(self.path, exc)
            return False
        self.held.clear()
        self.lost = None
        self.health.events_held(0)
        self.health.written(self.path)
        return True

    def _lost_line(self, first: int, last: int) -> str:
        message = (
            f"{last - first + 1} events (seq {first} to {last}) were dropped unwritten: the state dir failed while "
            f"more than {self.max_held} waited in memory"
        )
        event = {"time": now_iso(), "kind": EventKind.EVENTS_LOST, "message": message}
        return json.dumps(event | {EventField.FIRST_SEQ: first, EventField.LAST_SEQ: last})

    def recent(self, limit: int, kind: str | None = None) -> list[dict[str, Any]]:
        chosen = [e for e in self.events if kind is None or e["kind"] == kind]
        return chosen[-limit:]


def append_lines(path: Path, lines: list[str], max_bytes: int) -> None:
    """Append ``lines`` to ``path`` whole or not at all: a failed write (a full disk writes part) is cut off
    again. Writers of one file take turns (an flock: the gateway's workers share theirs); the one whose append
    brings it to ``max_bytes`` rotates it (a failed rotation is tried again by the next append). OSError when
    the append failed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = "".join(line + "\n" for line in lines).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        start = os.fstat(fd).st_size
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        except OSError:
            with contextlib.suppress(OSError):  # the write's error is the one to report
                os.ftruncate(fd, start)
            raise
        if start + len(data) >= max_bytes:
            with contextlib.suppress(OSError):  # the lines are in: the next append rotates it
                path.replace(path.with_name(path.name + ".1"))
    finally:
        os.close(fd)
