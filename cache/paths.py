"""Where a daemon's socket, ready marker, lock and log live, and how clients find it.

The default socket name is derived from the device identity (the GPU's UUID on CUDA) and the
fingerprint digest, so two models or configs on one device get two daemons and an engine that
computes its own fingerprint can never reach a daemon serving something else.

One discovery rule: every serving daemon answers under its default name in the runtime dir. A daemon
started with ``--socket`` elsewhere (a stack's ``state_dir/run/g<N>.sock``) publishes a symlink there to
its socket while it serves (``publish``), so ``hotweights cache status``/``verify`` (which list the runtime
dir) and ``--weight-cache client`` without ``--socket`` (which computes the default name) find stand-alone
daemons and the daemons of running stacks alike. A name already held by a live daemon is left alone: one
daemon per device and fingerprint is published.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hotweights.errors import ConfigError
from hotweights.paths import private_dir, runtime_dir
from hotweights.pidlock import LockHeld, PidLock

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

OFFER_SUFFIX = ".handover"  # an engine's re-adoption offer (``cache.handover``): <digest>.<pid>-<n>.handover


def ensure_private_dir(path: Path, *, shared: bool = False) -> Path:
    """Create the socket directory if missing: 0700, or 0711 when other uids may connect (``shared``:
    they can reach a socket whose name they know, not list the directory). An existing directory is
    never chmod'ed (it may be the user's own, e.g. ``--socket ~/x.sock``): it is refused if someone else
    owns it or others can write to it (they could replace the socket), or, when ``shared``, if others
    cannot traverse it."""
    path.mkdir(mode=0o711 if shared else 0o700, parents=True, exist_ok=True)
    private_dir(path, "socket directory")
    mode = stat.S_IMODE(path.stat().st_mode)
    if shared and not mode & 0o001:
        raise ConfigError(
            f"--allow-uid needs other users to reach the socket, but {path} (mode {mode:o}) is not traversable "
            "by them: chmod o+x it or choose another --socket"
        )
    return path


def device_identity(device: torch.device) -> str:
    """What a daemon's default socket name says of its device: the GPU's UUID, or the device type. Only a CUDA
    device imports torch (its caller has a torch device, so torch is loaded already)."""
    if device.type == "cuda":
        import torch

        return f"GPU-{torch.cuda.get_device_properties(device).uuid}"
    return device.type


@dataclass(frozen=True)
class DaemonPaths:
    socket: Path

    @property
    def ready(self) -> Path:
        """Written only once the daemon serves; holds its pid and fingerprint digest."""
        return self.socket.with_suffix(".ready")

    @property
    def lock(self) -> Path:
        """flock'ed by the live daemon for its whole life, so two never serve one socket."""
        return self.socket.with_suffix(".lock")

    @property
    def record(self) -> Path:
        """The serving daemon's record of its arena, kept after it dies so a successor can re-adopt it."""
        return self.socket.with_suffix(".arena.json")

    @property
    def seeding(self) -> Path:
        """While the daemon fills its arena from a peer (``cache.seeding``): the copy's progress, as JSON."""
        return self.socket.with_suffix(".seeding.json")

    @property
    def seed_sources(self) -> Path:
        """The peers a controller chose for the daemon to seed from (``--seed-from @FILE``), one per line."""
        return self.socket.with_suffix(".seed-sources")

    @property
    def log(self) -> Path:
        """Where ``--weight-cache daemon`` sends a detached daemon's output."""
        return self.socket.with_suffix(".log")


def default_paths(device: torch.device, fingerprint_digest: str) -> DaemonPaths:
    return DaemonPaths(runtime_dir() / f"{device_identity(device)}-{fingerprint_digest}.sock")


def paths_for(socket_path: str | Path | None, device: torch.device, fingerprint_digest: str) -> DaemonPaths:
    return DaemonPaths(Path(socket_path)) if socket_path else default_paths(device, fingerprint_digest)


def _answers(path: Path) -> bool:
    """Something accepts connections on the Unix socket ``path`` (through a symlink too)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def publish(paths: DaemonPaths, device: torch.device, fingerprint_digest: str) -> Path | None:
    """Link the default name in the runtime dir to ``paths.socket`` (a serving daemon's) and return the link;
    None when the socket is in the runtime dir already (listed as it is) or another daemon's socket or live
    link holds the name. A link a killed daemon left is kept if it names our socket, else replaced. A failure
    is logged, never raised: the daemon serves on its own socket all the same."""
    link = default_paths(device, fingerprint_digest).socket
    if paths.socket.parent.resolve() == link.parent.resolve():
        return None
    target = paths.socket.resolve()
    try:
        ensure_private_dir(link.parent)
        if link.is_symlink() and Path(os.readlink(link)) == target:
            return link  # a predecessor on our socket made it
        if link.is_symlink() and not _answers(link):
            link.unlink(missing_ok=True)
        os.symlink(target, link)
    except FileExistsError:
        log.info("not published as %s: another daemon holds that name", link)
        return None
    except (ConfigError, OSError) as exc:
        log.warning("not published as %s (cache status will not list this daemon): %s", link, exc)
        return None
    log.info("published as %s", link)
    return link


def offer_pid(path: Path) -> int | None:
    """The pid of the engine whose re-adoption offer ``path`` is; None for any other name."""
    stem = path.name.removesuffix(OFFER_SUFFIX)
    pid = stem.rsplit(".", 1)[-1].split("-")[0]
    return int(pid) if stem != path.name and pid.isdigit() else None


def remove_if_stale(path: Path) -> bool:
    """Remove the socket, or published link, at ``path`` (and a socket's ready marker) and return True when
    it is a leftover of ours: nothing accepts connections on it and no daemon holds the lock beside the
    socket it names (we hold that lock while we look and remove, so no daemon starts there meanwhile). False,
    touching nothing, for a live or starting daemon's, another user's, or one we cannot tell. A link's
    target is left alone (it is in its stack's state directory, which cleans it up on its next start)."""
    try:
        info = os.lstat(path)
        target = path.parent / os.readlink(path) if stat.S_ISLNK(info.st_mode) else path
    except OSError:
        return False
    if info.st_uid != os.getuid():
        return False
    lock = PidLock(DaemonPaths(target).lock)
    try:
        if lock.path.parent.is_dir():  # else nothing can serve there: no daemon runs without its lock
            lock.acquire()
    except (LockHeld, OSError):
        return False
    try:
        if _answers(path):
            return False
        for leftover in (path, DaemonPaths(path).ready):
            with contextlib.suppress(FileNotFoundError):
                leftover.unlink()
    finally:
        lock.release()
    return True


def unpublish(link: Path | None, target: Path) -> None:
    """Remove ``link`` if it still points at ``target`` (another daemon may have taken the name since)."""
    with contextlib.suppress(OSError):
        if link is not None and Path(os.readlink(link)) == target.resolve():
            link.unlink()


def check_socket_path_free(path: Path) -> None:
    """ConfigError unless ``path`` is absent or a stale socket (one nobody listens on): a directory, a
    regular file or a symlink is never deleted, and a live listener is never replaced."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        kind = "a directory" if stat.S_ISDIR(info.st_mode) else "a symlink" if stat.S_ISLNK(info.st_mode) else "a file"
        raise ConfigError(f"{path} is {kind}, not a socket; hotweights will not remove it: move it or pass --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    with probe:
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return  # stale: its listener is gone
        except OSError as exc:
            raise ConfigError(f"cannot tell whether {path} is in use ({exc.strerror}): pass another --socket") from None
        pid, uid, _gid = struct.unpack("3i", probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    owner = f"pid {pid}, uid {uid}, {_command(pid)}"
    raise ConfigError(f"{path} is in use by another process ({owner}): stop it or pass --socket")


def _command(pid: int) -> str:
    try:
        return repr(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip())
    except OSError:
        return "command unknown"
