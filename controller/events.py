"""The controller's timeline: detections, fences, promotions and respawns, with their durations.

The last ``keep`` events stay in memory for ``GET /events``; every event is also appended to
``events.jsonl`` in the state dir, one JSON object a line, so the history survives restarts. The
file is bounded: once it holds ``max_bytes`` it becomes ``events.jsonl.1`` (replacing the previous
one) and a new file begins, so the history on disk never exceeds twice ``max_bytes``. With no path
the events are kept in memory only. The gateway keeps a log of its own (its migrations) the same way.
"""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MAX_BYTES = 8 << 20  # events.jsonl rotates to events.jsonl.1 at this size


class EventLog:
    def __init__(self, path: Path | None, keep: int = 1000, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.events: deque[dict[str, Any]] = deque(maxlen=keep)
        self.seq = 0

    def record(self, kind: str, message: str, **fields: Any) -> dict[str, Any]:
        """Append one event; ``fields`` carry the subject (member, group) and durations (``*_ms``)."""
        self.seq += 1
        now = time.time()
        event = {"seq": self.seq, "time": datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds")}
        event |= {"kind": kind, "message": message} | fields
        self.events.append(event)
        if self.path is None:
            return event
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as out:
                out.write(json.dumps(event) + "\n")
                full = out.tell() >= self.max_bytes
            if full:
                self.path.replace(self.path.with_name(self.path.name + ".1"))
        except OSError as exc:
            log.warning("cannot append to %s: %s", self.path, exc)
        return event

    def recent(self, limit: int, kind: str | None = None) -> list[dict[str, Any]]:
        chosen = [e for e in self.events if kind is None or e["kind"] == kind]
        return chosen[-limit:]
