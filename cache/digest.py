"""Content digests of an arena's bytes, computed where the bytes are (on the GPU for a CUDA arena).

A digest is a keyed linear hash, cascaded: the bytes, as rows of ROW_BYTES signed bytes, times a random int8
matrix of WIDTH columns (exact integer products: ``torch._int_mm``, tensor cores on a GPU); the products, as
bytes again, times the next level's matrix, until at most TAIL_BYTES are left; then SHA-256 of the byte count
and what is left. Every level's matrix comes from the key (a string) through SHAKE-256, so a digest is the same
on every device, torch version and machine. It reads each byte once, at the memory bus's speed on a GPU
(SHA-256 on host cores ran at 1.5-2 GB/s a core), which is what makes re-adopting a 32 GB arena a matter of
milliseconds.

What it proves: for a change to the bytes chosen without knowing the key, the chance that it keeps the digest
is at most LEVELS x 256^-WIDTH (a changed row keeps each of its WIDTH products with probability <= 1/256: its
key entries are uniform and independent, and a nonzero byte difference times them takes 256 distinct values).
It is no proof against someone who knows the key: from the matrix one can solve for changes that keep it. So:

- ``content_hash`` uses PUBLIC_KEY, known to everyone: the manifest's digest, checked against accidents (a torn
  or corrupt snapshot, an arena that is not the one loaded; ``cache verify``);
- a daemon also keeps a digest under a secret key of its own (``new_key``), in its private record and never in
  the manifest engines see: what re-adoption checks an arena handed back by an engine against.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from hotweights.cache.protocol import HEX

ROW_BYTES = 4096
WIDTH = 8  # products per row and key: each level lets a chosen change through with probability <= 2^-64
TAIL_BYTES = 1 << 20  # what is left is hashed by SHA-256 on the host
CHUNK_ROWS = 1 << 16  # rows per product (256 MiB of input, 2 MiB of products per key)
MIN_ROWS = 17  # torch._int_mm on CUDA needs more than 16 rows
PUBLIC_KEY = "hotweights-content-v1"
VERSION = b"hotweights-digest-v1"


@dataclass(frozen=True)
class KeyedDigest:
    """A digest under a secret key, with the key: what a daemon records (0600, never in the manifest) to check an
    arena an engine hands back."""

    key: str
    digest: str

    def to_json(self) -> dict[str, str]:
        return {"key": self.key, "digest": self.digest}

    @classmethod
    def from_json(cls, value: object) -> KeyedDigest:
        """Strict parse; ValueError naming the fault."""
        if not isinstance(value, dict) or not isinstance(value.get("key"), str) or len(value["key"]) < 32:
            raise ValueError("the keyed digest needs a key of at least 32 characters")
        if not isinstance(value.get("digest"), str) or not HEX.fullmatch(value["digest"]):
            raise ValueError(f"keyed digest {str(value.get('digest'))[:80]!r} is not a 64-digit hex digest")
        return cls(value["key"], value["digest"])

    def of(self, data: torch.Tensor, nbytes: int) -> str:
        """The digest of ``data``'s first ``nbytes`` under this key (compare it with ``digest``)."""
        return digests(data, nbytes, [self.key])[0]


def fill_digests(data: torch.Tensor, nbytes: int) -> tuple[str, KeyedDigest]:
    """The public content hash of a freshly filled arena and its digest under a new secret key, in one read."""
    key = secrets.token_hex(16)
    public, keyed = digests(data, nbytes, [PUBLIC_KEY, key])
    return public, KeyedDigest(key, keyed)


def content_hash(data: torch.Tensor, nbytes: int) -> str:
    """The public digest (hex) of the first ``nbytes`` of the uint8 tensor ``data``."""
    return digests(data, nbytes, [PUBLIC_KEY])[0]


def digests(data: torch.Tensor, nbytes: int, keys: Sequence[str]) -> list[str]:
    """The digest (hex) of the first ``nbytes`` of the uint8 tensor ``data`` under each key, from one read of
    the bytes (on ``data``'s device; the tensor must be contiguous)."""
    if not 0 < nbytes <= data.numel():
        raise ValueError(f"cannot digest {nbytes} bytes of a {data.numel()}-byte arena")
    first = _products(data[:nbytes], _matrix(keys, 0, data.device)).view(torch.int32).view(-1, len(keys), WIDTH)
    outputs = [first[:, i].contiguous().view(torch.uint8).view(-1) for i in range(len(keys))]
    return [_finish(out, key, nbytes) for out, key in zip(outputs, keys, strict=True)]


def _finish(products: torch.Tensor, key: str, nbytes: int) -> str:
    """Reduce one key's first-level products to at most TAIL_BYTES, then SHA-256 them with the byte count."""
    level, data = 1, products
    while data.numel() > TAIL_BYTES:
        data = _products(data, _matrix([key], level, data.device))
        level += 1
    tail = data.cpu().numpy().tobytes()
    return hashlib.sha256(VERSION + f":{nbytes}:{level}:".encode() + tail).hexdigest()


def _products(data: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """The uint8 bytes ``data`` as (rows, ROW_BYTES) int8, the last row zero-padded, times ``matrix``: int32,
    exactly, CHUNK_ROWS at a time (so temporaries stay small); returned as bytes."""
    whole = data.numel() // ROW_BYTES
    rows = data[: whole * ROW_BYTES].view(torch.int8).view(whole, ROW_BYTES)
    out = torch.empty(-(-data.numel() // ROW_BYTES), matrix.shape[1], dtype=torch.int32, device=data.device)
    for start in range(0, whole, CHUNK_ROWS):
        block = rows[start : start + CHUNK_ROWS]
        if block.shape[0] >= MIN_ROWS:
            out[start : start + block.shape[0]] = torch._int_mm(block, matrix)
        else:
            out[start : start + block.shape[0]] = _padded_products(block.reshape(-1), matrix)[: block.shape[0]]
    if whole < out.shape[0]:
        out[whole] = _padded_products(data[whole * ROW_BYTES :].view(torch.int8), matrix)[0]
    return out.view(torch.uint8).view(-1)


def _padded_products(data: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Products of fewer than MIN_ROWS rows (int8 bytes, zero-padded to MIN_ROWS whole rows: zero rows have
    zero products, which the caller drops)."""
    padded = torch.zeros(MIN_ROWS * ROW_BYTES, dtype=torch.int8, device=data.device)
    padded[: data.numel()] = data
    return torch._int_mm(padded.view(MIN_ROWS, ROW_BYTES), matrix)


def _matrix(keys: Sequence[str], level: int, device: torch.device) -> torch.Tensor:
    """The (ROW_BYTES, WIDTH x len(keys)) int8 matrix of ``level``, column-major, one WIDTH-column block per key."""
    blocks = [_key_columns(key, level) for key in keys]
    return torch.from_numpy(np.concatenate(blocks)).to(device).t()


def _key_columns(key: str, level: int) -> np.ndarray:
    """WIDTH rows of ROW_BYTES uniform int8 drawn from ``key`` and ``level`` by SHAKE-256."""
    stream = hashlib.shake_256(VERSION + f":{key}:{level}".encode()).digest(WIDTH * ROW_BYTES)
    return np.frombuffer(stream, dtype=np.int8).reshape(WIDTH, ROW_BYTES)
