"""Processed snapshots: the arena's bytes after the whole pipeline (TP split, fusion, quantization) in one file.

Layout: MAGIC (8 bytes) | header length (8 bytes, big-endian) | header (JSON) | zeros up to DATA_ALIGNMENT |
the arena's ``used_bytes``. The header holds the format version, the torch version, the fingerprint (and its
digest) and the manifest, whose ``content_hash`` is the data's public digest (``cache.digest``).

Writing goes to a temporary file beside the target, fsync'ed, then renamed over it: a reader finds a whole
snapshot or none, and a failure (a full disk) removes the temporary file and says so in one line.
Reading checks everything that needs no data first (magic, header, format, the fingerprint field by field,
the manifest's rows, the file's size), then reads the data straight into the arena and checks its digest
(on the arena's device, after the read): a stale, truncated or corrupt snapshot is refused with the reason and
nothing of it is served.
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any

import torch

from hotweights.cache import arena as arena_layout
from hotweights.cache import loader
from hotweights.cache.backends.base import ArenaBackend
from hotweights.cache.digest import fill_digests
from hotweights.cache.fingerprint import Fingerprint
from hotweights.cache.recovery import Filled, SourceRefused
from hotweights.errors import HotweightsError

MAGIC = b"HWSNAP\r\n"
FORMAT_VERSION = 2  # 2: the data's digest is cache.digest's (1 had a SHA-256)
LENGTH = struct.Struct(">Q")
DATA_ALIGNMENT = 4096
MAX_HEADER_BYTES = 64 << 20
CHUNK_BYTES = 64 << 20  # one write while a snapshot is written


class SnapshotError(HotweightsError):
    """A snapshot could not be written; the message names the file and the reason."""


def write_snapshot(out: Path, manifest: dict[str, Any], arena: torch.Tensor) -> int:
    """Write ``arena``'s used bytes and ``manifest`` to ``out`` atomically; returns the file's size.
    SnapshotError (the temporary file removed, ``out`` untouched) when the file system refuses."""
    used = manifest["used_bytes"]
    prefix = _prefix(_header(manifest))
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    written = 0
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as sink:
            sink.write(prefix)
            for start in range(0, used, CHUNK_BYTES):
                written += sink.write(arena[start : min(start + CHUNK_BYTES, used)].cpu().numpy())
            sink.flush()
            os.fsync(sink.fileno())
        tmp.replace(out)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise SnapshotError(
            f"cannot write snapshot {out}: {exc.strerror or exc} after {written} of {used} data bytes; "
            "nothing was left behind"
        ) from None
    return len(prefix) + used


def _header(manifest: dict[str, Any]) -> dict[str, Any]:
    fingerprint = Fingerprint(**manifest["fingerprint"])
    return {
        "format": FORMAT_VERSION,
        "torch_version": str(torch.__version__),
        "fingerprint": manifest["fingerprint"],
        "fingerprint_digest": fingerprint.digest(),
        "manifest": manifest,
        "data_bytes": manifest["used_bytes"],
    }


def _prefix(header: dict[str, Any]) -> bytes:
    """MAGIC, the header's length, the header and the zeros that align the data (its offset is in the header)."""
    body = b""
    offset = 0
    while True:  # the offset is part of the header, so its own digits can move the data: settle it
        body = json.dumps(header | {"data_offset": offset}, separators=(",", ":")).encode()
        aligned = -(-(len(MAGIC) + LENGTH.size + len(body)) // DATA_ALIGNMENT) * DATA_ALIGNMENT
        if aligned == offset:
            break
        offset = aligned
    head = MAGIC + LENGTH.pack(len(body)) + body
    return head + bytes(offset - len(head))


def read_header(path: Path) -> dict[str, Any]:
    """The header of the snapshot at ``path``; SourceRefused naming the fault (not a snapshot, truncated, bad JSON)."""
    try:
        with open(path, "rb") as source:
            magic = source.read(len(MAGIC))
            if magic != MAGIC:
                raise SourceRefused(f"snapshot {path} is not a hotweights snapshot (starts {magic!r})")
            (length,) = LENGTH.unpack(source.read(LENGTH.size).rjust(LENGTH.size, b"\0"))
            if length > MAX_HEADER_BYTES:
                raise SourceRefused(f"snapshot {path}: header of {length} bytes is over {MAX_HEADER_BYTES}")
            body = source.read(length)
    except FileNotFoundError:
        raise SourceRefused(f"snapshot {path} does not exist") from None
    except OSError as exc:
        raise SourceRefused(f"snapshot {path} cannot be read: {exc.strerror or exc}") from None
    if len(body) != length:
        raise SourceRefused(f"snapshot {path} is truncated: header of {length} bytes, {len(body)} present")
    try:
        header = json.loads(body)
    except ValueError as exc:
        raise SourceRefused(f"snapshot {path}: header is not JSON: {str(exc)[:200]}") from None
    return header


def check_snapshot(path: Path, fingerprint: Fingerprint) -> dict[str, Any]:
    """The header of a snapshot that can fill an arena of ``fingerprint`` as far as can be told without
    reading the data; SourceRefused naming the field, what was expected and what was found."""
    header = read_header(path)
    if not isinstance(header, dict) or header.get("format") != FORMAT_VERSION:
        found = header.get("format") if isinstance(header, dict) else header
        raise SourceRefused(f"snapshot {path}: format {found!r}, expected {FORMAT_VERSION}")
    try:
        made_for = Fingerprint.from_json(header.get("fingerprint"))
        manifest = header.get("manifest")
        if not isinstance(manifest, dict):
            raise ValueError("no manifest")
        arena_layout.manifest_entries(manifest)
    except ValueError as exc:
        raise SourceRefused(f"snapshot {path}: corrupt header: {exc}") from None
    differences = fingerprint.differences(made_for)
    if differences:
        listed = "; ".join(f"{name}: snapshot has {theirs!r}, expected {ours!r}" for name, ours, theirs in differences)
        raise SourceRefused(f"snapshot {path} is stale (made for another model, config or build): {listed}")
    if manifest.get("fingerprint") != header["fingerprint"] or header.get("data_bytes") != manifest["used_bytes"]:
        raise SourceRefused(f"snapshot {path}: corrupt header: fingerprint or data size disagree with the manifest")
    _check_size(path, header)
    return header


def _check_size(path: Path, header: dict[str, Any]) -> None:
    offset, data = header.get("data_offset"), header["data_bytes"]
    if type(offset) is not int or offset % DATA_ALIGNMENT or offset <= 0:
        raise SourceRefused(f"snapshot {path}: corrupt header: data_offset {offset!r}")
    size = path.stat().st_size
    if size != offset + data:
        what = "truncated" if size < offset + data else "longer than its header says"
        raise SourceRefused(f"snapshot {path} is {what}: {size} bytes, expected {offset + data}")


def load_snapshot(
    path: Path, fingerprint: Fingerprint, backend: ArenaBackend, device: torch.device, *, direct_io: bool = False
) -> Filled:
    """A new arena filled from the snapshot at ``path`` (every check of ``check_snapshot``, then the data's
    digest against the header's); SourceRefused naming the fault. ``direct_io``: read it with O_DIRECT."""
    header = check_snapshot(path, fingerprint)
    manifest, used = header["manifest"], header["data_bytes"]
    start = time.perf_counter()
    arena = backend.allocate(used, device)
    try:
        _read_into(path, header["data_offset"], used, arena.tensor, direct_io)
        digest, keyed = fill_digests(arena.tensor, used)
        read_s = time.perf_counter() - start
        if digest != manifest["content_hash"]:
            raise SourceRefused(f"snapshot {path} is corrupt: its data hashes to {digest}, the header says "
                                f"{manifest['content_hash']}")  # fmt: skip
    except BaseException:
        arena.close()
        raise
    served = manifest | {"arena_bytes": arena.nbytes, "backend": backend.name, "device": str(device)}
    how = "O_DIRECT" if direct_io else "buffered"
    detail = f"from {path}: {used / 1e9:.3f} GB read ({how}) and checked at {used / 1e9 / read_s:.2f} GB/s"
    return Filled(arena, served, keyed, detail)


def _read_into(path: Path, offset: int, nbytes: int, arena: torch.Tensor, direct: bool) -> None:
    """Read ``nbytes`` at ``offset`` into ``arena`` through the loader (straight into host memory, or through
    the pinned ring onto a device) in one call, so the ring's reads and copies overlap all the way."""
    with loader.Loader(arena.device, direct=direct) as reads, loader.progress_bar(nbytes, "snapshot") as bar:
        try:
            reads.read_into(path, offset, arena[:nbytes], progress=bar.update)
        except loader.ReadError as exc:
            raise SourceRefused(f"snapshot {path}: {exc}") from None
