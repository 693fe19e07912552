"""The arena digest (``cache.digest``): equal to a plain integer reference, on every size and device; any
change to the bytes, or their length, changes it; keys give independent digests; the keyed record's checks."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from hotweights.cache import digest

SIZES = [1, 255, digest.ROW_BYTES - 1, digest.ROW_BYTES, digest.ROW_BYTES + 1, 17 * digest.ROW_BYTES + 3, 300_001]


def reference(data: bytes, key: str) -> str:
    """The digest by its definition, in int64 numpy: pad to whole rows, multiply, repeat while over the tail."""
    level, current = 0, np.frombuffer(data, dtype=np.uint8)
    while level == 0 or current.size > digest.TAIL_BYTES:
        rows = -(-current.size // digest.ROW_BYTES)
        padded = np.zeros(rows * digest.ROW_BYTES, dtype=np.uint8)
        padded[: current.size] = current
        matrix = digest._key_columns(key, level).astype(np.int64)
        products = padded.view(np.int8).reshape(rows, -1).astype(np.int64) @ matrix.T
        current = products.astype(np.int32).view(np.uint8).reshape(-1)
        level += 1
    return hashlib.sha256(digest.VERSION + f":{len(data)}:{level}:".encode() + current.tobytes()).hexdigest()


@pytest.fixture
def small_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tail of 4 KiB and products 32 rows at a time, so that small inputs take several levels and chunks."""
    monkeypatch.setattr(digest, "TAIL_BYTES", 4096)
    monkeypatch.setattr(digest, "CHUNK_ROWS", 32)


def random_bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("n", SIZES)
def test_the_digest_is_its_definition(n: int, small_levels: None) -> None:
    data = random_bytes(n + 100)  # bytes past nbytes are not read
    assert digest.digests(data, n, ["k1", digest.PUBLIC_KEY]) == [
        reference(data[:n].numpy().tobytes(), "k1"),
        reference(data[:n].numpy().tobytes(), digest.PUBLIC_KEY),
    ]
    assert digest.content_hash(data, n) == reference(data[:n].numpy().tobytes(), digest.PUBLIC_KEY)


def test_the_default_levels_match_the_definition_too() -> None:
    data = random_bytes(3 << 20)
    assert digest.content_hash(data, data.numel()) == reference(data.numpy().tobytes(), digest.PUBLIC_KEY)


@pytest.mark.parametrize("position", [0, 4095, 4096, 150_000, 300_000])
def test_changing_any_byte_or_the_length_changes_it(position: int, small_levels: None) -> None:
    data = random_bytes(300_001)
    before = digest.content_hash(data, data.numel())
    for delta in (1, 128, 255):
        changed = data.clone()
        changed[position] = (int(changed[position]) + delta) % 256
        assert digest.content_hash(changed, changed.numel()) != before
    padded = torch.cat([data, torch.zeros(1, dtype=torch.uint8)])
    assert digest.content_hash(padded, padded.numel()) != before  # a zero byte more is another content


def test_keys_give_independent_digests_and_the_keyed_record_checks_its_fields() -> None:
    data = random_bytes(10_000)
    public, keyed = digest.fill_digests(data, data.numel())
    assert public == digest.content_hash(data, data.numel()) and keyed.digest != public
    assert keyed.of(data, data.numel()) == keyed.digest
    assert digest.fill_digests(data, data.numel())[1].key != keyed.key  # a fresh key every fill
    assert digest.KeyedDigest.from_json(keyed.to_json()) == keyed
    with pytest.raises(ValueError, match="key of at least 32"):
        digest.KeyedDigest.from_json({"key": "short", "digest": keyed.digest})
    with pytest.raises(ValueError, match="not a 64-digit hex digest"):
        digest.KeyedDigest.from_json({"key": keyed.key, "digest": "cafe"})
    with pytest.raises(ValueError, match="cannot digest 0 bytes"):
        digest.content_hash(data, 0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("n", [*SIZES, 64 << 20])
def test_a_cuda_digest_equals_the_cpu_one(n: int) -> None:
    data = random_bytes(n)
    keys = [digest.PUBLIC_KEY, "secret-key-of-a-daemon-0123456789"]
    assert digest.digests(data.to("cuda:0"), n, keys) == digest.digests(data, n, keys)
