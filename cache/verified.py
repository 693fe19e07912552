"""The arenas whose content this host's engines have checked: the content hash is verified once per served arena.

An engine recomputes the content hash of the arena it maps (``cache.client``) the first time it meets that
arena on this host and records it here; a later attach of the same arena finds the record and skips the read
of every byte. "The same arena" is named by what the kernel says, never by the daemon alone:

- the serving daemon process: its pid (SO_PEERCRED on the attach connection) and its start time
  (``/proc/<pid>/stat``), and the boot (pids and start times start over after a reboot);
- the mapped memory where the backend can name it (cpu-shm: the memfd's device and inode);
- the manifest's ``arena_id`` and ``used_bytes`` (a daemon serves one arena for its life).

A record vouches for the content hash it holds, and only for a manifest that states that hash. Records are
files of ours, one per arena, in a 0700 directory of the runtime dir, named by the daemon's pid and start time
so that the records of dead daemons are removed when a record is written. A directory another uid owns or
can write is not believed (it could hold planted records): every attach hashes then. A daemon whose pid we
cannot see (another pid namespace) is never remembered.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hotweights.cache.protocol import HEX
from hotweights.errors import ConfigError
from hotweights.paths import private_dir, runtime_dir

log = logging.getLogger(__name__)

FOLDER = "verified"  # in the runtime dir
TEMP_PREFIX = "."  # a record being written: .<writer pid>.<record name>


@dataclass(frozen=True)
class ServedArena:
    """One arena as one daemon process serves it (module docstring)."""

    boot_id: str
    daemon_pid: int
    daemon_start: int  # clock ticks after boot (/proc/<pid>/stat, field 22)
    arena_id: str
    memory: str  # the backend's identity of the mapped memory (JSON), "" where it has none
    used_bytes: int

    def record_name(self) -> str:
        """``<daemon pid>-<daemon start>-<digest of every field>``."""
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:32]
        return f"{self.daemon_pid}-{self.daemon_start}-{digest}"


def served_arena(daemon_pid: int, manifest: dict[str, Any], memory: dict[str, Any] | None) -> ServedArena | None:
    """The arena ``manifest`` describes, served by ``daemon_pid`` (SO_PEERCRED's); None when that process
    cannot be seen here (pid 0: another pid namespace; it is gone)."""
    start = process_start(daemon_pid) if daemon_pid > 0 else None
    if start is None:
        return None
    identity = json.dumps(memory, sort_keys=True) if memory is not None else ""
    arena_id = manifest.get("arena_id")
    return ServedArena(boot_id(), daemon_pid, start, str(arena_id or ""), identity, manifest["used_bytes"])


@functools.cache
def boot_id() -> str:
    """This boot's id (the kernel's)."""
    return Path("/proc/sys/kernel/random/boot_id").read_text().strip()


def process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks after boot; None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # after the command's parentheses: field 22 is the 20th


def record_daemon(name: str) -> tuple[int, int] | None:
    """The daemon pid and start time a record (or a record being written) is named by; None for another name."""
    if name.startswith(TEMP_PREFIX):
        name = name.split(".", 2)[-1]
    fields = name.split("-")
    if len(fields) != 3 or not (fields[0].isdigit() and fields[1].isdigit()):
        return None
    return int(fields[0]), int(fields[1])


def is_stale(name: str, start_of: dict[int, int | None]) -> bool:
    """Whether the file ``name`` in the records' folder can go: a record (or one being written) of a daemon
    that is no longer running (``start_of``: each pid's start time, None for no such process), or no record."""
    daemon = record_daemon(name)
    return daemon is None or start_of.get(daemon[0]) != daemon[1]


class VerifiedArenas:
    """The records in ``folder`` (default: the runtime dir's ``verified``). Nothing here raises: a folder that
    cannot be read or written costs a hash on every attach, with a warning when a record cannot be written."""

    def __init__(self, folder: Path | None = None) -> None:
        self.folder = folder if folder is not None else runtime_dir() / FOLDER

    def vouches(self, arena: ServedArena, content_hash: str) -> bool:
        """Whether an engine of ours computed ``content_hash`` over ``arena``'s bytes before."""
        try:
            private_dir(self.folder, "verified arenas directory")
            return (self.folder / arena.record_name()).read_text() == content_hash
        except FileNotFoundError:
            return False
        except (ConfigError, OSError) as exc:
            log.warning("content hashes cannot be remembered (every attach reads the whole arena): %s", exc)
            return False

    def remember(self, arena: ServedArena, content_hash: str) -> None:
        """Record that ``arena``'s bytes have ``content_hash`` (atomically: a temp file, then a rename), after
        removing the records of daemons that stopped."""
        if not HEX.fullmatch(content_hash):
            raise ValueError(f"content hash {content_hash[:80]!r} is not a 64-digit hex digest")
        name = arena.record_name()
        temp = self.folder / f"{TEMP_PREFIX}{os.getpid()}.{name}"
        try:
            private_dir(self.folder, "verified arenas directory")
            self._remove_stale()
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            with open(fd, "w") as out:
                out.write(content_hash)
            temp.replace(self.folder / name)
        except (ConfigError, OSError) as exc:
            log.warning("cannot remember the arena's content hash (the next attach reads it again): %s", exc)
            with contextlib.suppress(OSError):
                temp.unlink()

    def _remove_stale(self) -> None:
        names = os.listdir(self.folder)
        pids = {daemon[0] for daemon in map(record_daemon, names) if daemon is not None}
        start_of = {pid: process_start(pid) for pid in pids}
        for name in names:
            if is_stale(name, start_of):
                with contextlib.suppress(FileNotFoundError):
                    (self.folder / name).unlink()
