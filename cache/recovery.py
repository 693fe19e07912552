"""Recovering a dead daemon's arena without the checkpoint: the daemon's record of it, and re-adoption.

Every daemon serving an adoptable arena (cpu-shm, cuda-vmm) writes a record beside its socket, in its private
directory, 0600: the manifest (with the content hash), the handle it exports, the allocation's identity
(cpu-shm: the memfd's inode and the boot) and the arena's digest under the daemon's secret key
(``cache.digest.KeyedDigest``: a successor that re-adopts keeps it). A successor for the same fingerprint asks
the engines that offer the arena (``cache.handover``) for their fd, and serves it only if the fd is what the
record describes:

- the backend's checks: cpu-shm a memfd of the recorded size with every seal; cuda-vmm a POSIX-fd allocation
  on this device that maps at the recorded size;
- the content: the very memfd the record names (write-sealed since it was filled, so its bytes are the hashed
  ones), else its bytes' digest under the recorded secret key (computed where the bytes are: on the GPU for a
  cuda-vmm arena) equal to the recorded one. An engine cannot forge that: it does not know the key.

The engine's word is never taken: a wrong size, type, seal, fingerprint or content is refused with one line
and the next offer (then the next source) is tried. cuda-ipc cannot do this: a cudaIpcMemHandle cannot be
shared again once its exporter is gone, so a cuda-ipc daemon always loads again.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hotweights.cache import arena as arena_layout
from hotweights.cache.backends.base import ArenaBackend, BackendUnavailable, ExportedArena
from hotweights.cache.digest import KeyedDigest
from hotweights.cache.fingerprint import Fingerprint
from hotweights.cache.handover import HandoverRefused, StaleOffer, ask, offers
from hotweights.errors import HotweightsError
from hotweights.stats import ms

log = logging.getLogger(__name__)

RECORD_VERSION = 2


class SourceRefused(HotweightsError):
    """A fill source (re-adoption, a snapshot) cannot fill the arena; the message says why."""


class SourceSkipped(SourceRefused):
    """The source has nothing to offer (no record, no engine, no snapshot given): not a fault."""


@dataclass
class Filled:
    """An arena ready to serve, its manifest, its digest under the daemon's secret key, and a few words on how
    it was filled."""

    arena: ExportedArena
    manifest: dict[str, Any]
    keyed: KeyedDigest
    detail: str


def write_record(path: Path, filled: Filled) -> None:
    """Record the arena a daemon serves, atomically (temp file, then rename), 0600."""
    handle, _ = filled.arena.export()
    record = {
        "version": RECORD_VERSION,
        "manifest": filled.manifest,
        "handle": handle,
        "identity": filled.arena.identity(),
        "keyed_digest": filled.keyed.to_json(),
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with open(fd, "w") as out:
        json.dump(record, out)
    tmp.replace(path)


def read_record(path: Path, fingerprint: Fingerprint) -> dict[str, Any]:
    """The record at ``path`` if it describes an arena of ``fingerprint``; SourceSkipped if there is none,
    SourceRefused naming the fault otherwise."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise SourceSkipped(f"no record of an earlier arena at {path}") from None
    except (OSError, ValueError) as exc:
        raise SourceRefused(f"record {path} is unreadable: {exc}") from None
    try:
        _check_record(record, fingerprint)
    except ValueError as exc:
        raise SourceRefused(f"record {path}: {exc}") from None
    return record


def _check_record(record: object, fingerprint: Fingerprint) -> None:
    """ValueError unless ``record`` is a current-version record of a ``fingerprint`` arena that holds together."""
    if not isinstance(record, dict) or record.get("version") != RECORD_VERSION:
        raise ValueError(f"expected a version {RECORD_VERSION} record")
    manifest, handle = record.get("manifest"), record.get("handle")
    if not isinstance(manifest, dict) or not isinstance(handle, dict):
        raise ValueError("no manifest or handle")
    arena_layout.manifest_entries(manifest)
    KeyedDigest.from_json(record.get("keyed_digest"))
    recorded = Fingerprint.from_json(manifest.get("fingerprint"))
    if recorded != fingerprint:
        raise SourceSkipped(f"the recorded arena is of fingerprint {recorded.digest()}, not {fingerprint.digest()}")
    if handle.get("backend") != manifest.get("backend") or handle.get("nbytes") != manifest["arena_bytes"]:
        raise ValueError(f"handle {handle.get('backend')!r}/{handle.get('nbytes')!r} does not match the manifest")


def readopt(
    record_path: Path, fingerprint: Fingerprint, backend: ArenaBackend, device: torch.device, trusted: frozenset[int]
) -> Filled:
    """Take the recorded arena back from the first engine whose offer passes every check. Stale offers (their
    engine died) are removed. SourceSkipped when there is nothing to adopt, SourceRefused when no offer passed."""
    if not backend.adoptable:
        raise SourceSkipped(f"{backend.name} arenas cannot be re-adopted (a cudaIpcMemHandle dies with its daemon)")
    record = read_record(record_path, fingerprint)
    if record["handle"]["backend"] != backend.name:
        raise SourceSkipped(f"the recorded arena is {record['handle']['backend']}, this daemon serves {backend.name}")
    found = offers(record_path.parent, fingerprint.digest())
    refusals = []
    for path in found:
        try:
            return _adopt_from(path, record, fingerprint, backend, device, trusted)
        except StaleOffer:
            path.unlink(missing_ok=True)  # its engine is gone; we hold the daemon lock for this directory
        except HandoverRefused as exc:
            log.warning("re-adoption refused: %s", exc)
            refusals.append(str(exc))
    if not refusals:
        raise SourceSkipped(f"no live engine offers the arena in {record_path.parent}")
    raise SourceRefused(f"no engine's offer passed ({len(refusals)} refused: {'; '.join(refusals)})")


def _adopt_from(
    path: Path,
    record: dict[str, Any],
    fingerprint: Fingerprint,
    backend: ArenaBackend,
    device: torch.device,
    trusted: frozenset[int],
) -> Filled:
    """The recorded arena from the engine offering on ``path``; HandoverRefused naming what did not fit."""
    start = time.perf_counter()
    pid, handle, fd = ask(path, fingerprint, trusted)
    asked = time.perf_counter()
    expected = record["handle"]
    if handle.get("backend") != expected["backend"] or handle.get("nbytes") != expected["nbytes"]:
        os.close(fd)
        raise HandoverRefused(
            f"engine pid {pid} offers a {handle.get('backend')!r} arena of {handle.get('nbytes')!r} bytes, "
            f"the record says {expected['backend']!r} of {expected['nbytes']} bytes"
        )
    try:
        arena = backend.adopt(expected, fd, device)
    except (ValueError, OSError, BackendUnavailable) as exc:
        raise HandoverRefused(f"engine pid {pid} handed an fd that is not the recorded arena: {exc}") from None
    mapped = time.perf_counter()
    keyed = KeyedDigest.from_json(record["keyed_digest"])
    try:
        how = _verified_content(arena, record, keyed, pid)
    except BaseException:
        arena.close()
        raise
    verified = time.perf_counter()
    took = f"asked {ms(asked - start)} ms, mapped {ms(mapped - asked)}, verified {ms(verified - mapped)}"
    return Filled(arena, record["manifest"], keyed, f"from engine pid {pid}, content verified by {how} ({took})")


def _verified_content(arena: ExportedArena, record: dict[str, Any], keyed: KeyedDigest, pid: int) -> str:
    """How the arena's bytes were proven to be the recorded ones (its identity, else ``keyed``, the record's
    digest); HandoverRefused when they are not."""
    identity = arena.identity()
    if identity is not None and identity == record.get("identity"):
        return "identity (the recorded memfd, write-sealed since it was filled)"
    digest = keyed.of(arena.tensor, record["manifest"]["used_bytes"])
    if digest != keyed.digest:
        raise HandoverRefused(f"engine pid {pid} handed an arena whose keyed digest is {digest}, the record says "
                              f"{keyed.digest}")  # fmt: skip
    return "keyed digest"
