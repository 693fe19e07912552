"""What a gateway's workers learn about suspect requests, shared: ``gateway-suspects.jsonl`` in the state dir.

Each worker appends its ``controller.suspects.Record``s, one JSON line each written with one ``write`` on an
``O_APPEND`` descriptor (so lines of several workers never interleave), and reads the lines the others appended
before each decision (a ``stat`` when nothing changed). Records hold digests, client keys (a bearer token only as
its digest) and engine ids, never a request's content. At ``MAX_BYTES`` the file becomes ``.1`` (replacing the
previous one) and a new one begins; a worker reads the rest of the file it had open before the new one, and a
worker that starts reads both. With no path (a gateway given its engines with ``--upstream``) records stay in the
worker. A write that fails (a full disk, a read-only state dir) is logged once; the records wait in memory (at
most ``MAX_PENDING``) for the next append, and the worker keeps applying them itself meanwhile.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import BinaryIO

from hotweights.controller.suspects import Kind, Record

log = logging.getLogger(__name__)

JOURNAL_FILE = "gateway-suspects.jsonl"  # in the state dir
MAX_BYTES = 1 << 20  # the file rotates to .1 at this size (a line is ~200 bytes)
MAX_PENDING = 1024  # records kept while the file cannot be written; beyond, the oldest are dropped


def encode(record: Record) -> bytes:
    return (json.dumps(asdict(record), separators=(",", ":")) + "\n").encode()


def decode(line: bytes) -> Record | None:
    """The record on ``line``; None for a line that is not one (cut short by a full disk, another version's)."""
    try:
        fields = json.loads(line)
        failures = tuple(str(failure) for failure in fields["failures"])
        return Record(Kind(fields["kind"]), float(fields["at"]), str(fields["digest"]), str(fields["client"]), failures)
    except (ValueError, KeyError, TypeError):
        return None


class SuspectJournal:
    """Records shared through one file (module docstring); ``path`` None: none shared."""

    def __init__(self, path: Path | None, max_bytes: int = MAX_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.started = False  # the predecessor .1 was read
        self.reading: BinaryIO | None = None  # the file as it was when opened, read up to where the last read ended
        self.partial = b""  # the start of a line whose end was not written yet
        self.pending: deque[bytes] = deque(maxlen=MAX_PENDING)
        self.failing = ""  # the error the last write met ("" while writes succeed)
        self.unreadable = ""  # the error the last failed read met (logged once)

    def append(self, record: Record) -> None:
        """Share ``record`` (with any that wait from failed writes)."""
        if self.path is None:
            return
        self.pending.append(encode(record))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                while self.pending:
                    os.write(fd, self.pending[0])
                    self.pending.popleft()
                full = os.fstat(fd).st_size >= self.max_bytes
            finally:
                os.close(fd)
            if full:  # another worker may have rotated it already
                with contextlib.suppress(FileNotFoundError):
                    self.path.replace(self.path.with_name(self.path.name + ".1"))
        except OSError as exc:
            self.write_failed(exc)
            return
        if self.failing:
            log.info("suspect records are shared through %s again", self.path)
            self.failing = ""

    def write_failed(self, exc: OSError) -> None:
        error = exc.strerror or str(exc)
        if error != self.failing:
            log.warning(
                "cannot share suspect records through %s (%s): this worker keeps applying them, and writes them with "
                "its next record",
                self.path,
                error,
            )
        self.failing = error

    def read_new(self) -> list[Record]:
        """The records appended since the last call (by any worker, this one too); at the first call, every
        record of the file and of its predecessor ``.1``."""
        if self.path is None:
            return []
        records = []
        try:
            if not self.started:
                self.started = True
                with contextlib.suppress(FileNotFoundError):
                    records = self.records(self.path.with_name(self.path.name + ".1").read_bytes())
                self.partial = b""  # a line cut short there ends with that file
            if self.reading is not None:
                successor = self.successor()
                records += self.records(self.reading.read(), self.partial)
                if successor:
                    self.close()
            if self.reading is None:
                self.reading = open(self.path, "rb")  # noqa: SIM115 (kept open: each read goes on where the last ended)
                records += self.records(self.reading.read(), self.partial)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self.read_failed(exc)
        return records

    def read_failed(self, exc: OSError) -> None:
        error = exc.strerror or str(exc)
        if error != self.unreadable:
            log.warning("cannot read %s (%s): this worker goes on with what it knows", self.path, error)
        self.unreadable = error

    def successor(self) -> bool:
        """Whether the file open for reading was rotated and another one begun since."""
        assert self.path is not None and self.reading is not None
        try:
            return os.stat(self.path).st_ino != os.fstat(self.reading.fileno()).st_ino
        except FileNotFoundError:  # rotated, and nothing appended since
            return False

    def records(self, data: bytes, partial: bytes = b"") -> list[Record]:
        """The records of ``data`` (after ``partial``, the start of a line read earlier); the start of a line whose
        end is not there yet is kept for the next read."""
        lines = (partial + data).split(b"\n")
        self.partial = lines.pop()
        return [record for line in lines if line and (record := decode(line)) is not None]

    def close(self) -> None:
        if self.reading is not None:
            self.reading.close()
            self.reading, self.partial = None, b""
