"""The split-KV decode attention kernels against their torch reference and the masked SDPA they replace, reading a
paged cache through its block table.

``mismatches(device)`` runs every case and returns what differed beyond its dtype's tolerance; ``model_mismatches``
runs decode steps of a small model both ways. The CPU tests run it
as a script with a Python that has Triton, under Triton's interpreter (``python tests/attentionhelpers.py cpu``
with ``TRITON_INTERPRET=1``: one JSON list on stdout); the CUDA tests call it on the GPU.
"""

from __future__ import annotations

import json
import sys

import torch

from hotweights.layout import ModelConfig
from hotweights.standby import decodeattention
from hotweights.standby.decodeattention import CHECKED, SPLIT, SplitKv, gathered, reference
from hotweights.standby.fused import checking
from hotweights.standby.kernelcheck import TOLERANCE
from hotweights.standby.kvpool import BLOCK_SIZE, blocks_for
from hotweights.standby.model import KVCache, MaskedReads, Transformer

GROUPS = (1, 2, 4, 8)  # q heads per kv head
HEAD_DIMS = (64, 128)
KV_HEADS = 2
POSITIONS = 2 * SPLIT + 88  # three splits, the last one partly beyond the cache
LENGTHS = (1, SPLIT - 1, SPLIT, SPLIT + 1, POSITIONS)  # one row each
# dtype -> (atol, rtol) of the kernels against the reference, and against masked SDPA
TOLERANCES = {
    torch.float32: ((2e-5, 2e-5), (1e-4, 1e-4)),
    torch.float16: ((2e-3, 2e-3), (4e-3, 4e-3)),
    torch.bfloat16: ((1.6e-2, 1.6e-2), (3e-2, 3e-2)),
}


def held(kv: KVCache, row: int, length: int) -> tuple[torch.Tensor, ...]:
    """Row ``row``'s keys and values in ``kv`` at positions 0 .. ``length`` - 1, read through its block table:
    (layers, nkv, length, hd) each, copies."""
    table = kv.table[row : row + 1]
    return tuple(torch.stack([gathered(layer, table, length)[0] for layer in c]).transpose(1, 2) for c in (kv.k, kv.v))


def case(group: int, head_dim: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    """q (B, nh, hd) as a view of a (B, nh + nkv, hd) tensor; layer 1's keys and values of a paged cache (blocks,
    BLOCK_SIZE, nkv, hd), its rows' blocks shuffled across the pool; the rows' block table (B, W) and lengths: the
    strides and the layout the model passes. Seeded per case."""
    g = torch.Generator().manual_seed(group * 1000 + head_dim)
    B, nh, width = len(LENGTHS), group * KV_HEADS, blocks_for(POSITIONS)
    qk = torch.randn((B, nh + KV_HEADS, head_dim), generator=g).to(device, dtype)
    blocks = 1 + B * width + 3  # the null block, and a few no row holds
    cache = torch.randn((2, 2, blocks, BLOCK_SIZE, KV_HEADS, head_dim), generator=g).to(device, dtype)
    table = (1 + torch.randperm(blocks - 1, generator=g)[: B * width]).view(B, width).to(device, torch.int32)
    lengths = torch.tensor(LENGTHS, device=device)
    return qk[:, :nh], cache[0, 1], cache[1, 1], table, lengths


def in_order(blocks: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Each row's positions of a layer's ``blocks`` in order: (B, nkv, POSITIONS, hd), what ``reference`` takes."""
    return gathered(blocks, table, POSITIONS).transpose(1, 2)


def kernels(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, lengths: torch.Tensor
) -> torch.Tensor:
    """The kernels' output, their scratch filled with NaN first: a split they read but did not write shows."""
    reads = SplitKv.for_step(lengths, table, q.shape[1], POSITIONS, q.shape[2])
    reads.partial.fill_(float("nan"))
    reads.lse.fill_(float("nan"))
    return reads.attend(q, k, v)


def cases() -> list[tuple[int, int, torch.dtype]]:
    """(group, head dim, dtype): every group in every dtype, the head dims taking turns, so that each group meets
    both head dims (the interpreter takes ~1 s a case on a loaded CPU)."""
    return [
        (group, HEAD_DIMS[(i + j) % len(HEAD_DIMS)], dtype)
        for j, dtype in enumerate(TOLERANCES)
        for i, group in enumerate(GROUPS)
    ]


def mismatches(device: str) -> list[str]:
    """Every case's differences beyond tolerance, and (in bfloat16) any row whose bits change when it is computed
    alone."""
    found = []
    for group, head_dim, dtype in cases():
        q, k, v, table, lengths = case(group, head_dim, dtype, device)
        got = kernels(q, k, v, table, lengths)
        name = f"group {group}, head_dim {head_dim}, {dtype}"
        masked = MaskedReads.for_step(lengths - 1, POSITIONS, dtype, table).attend(q, k, v)
        want = reference(q, in_order(k, table), in_order(v, table), lengths, head_dim**-0.5)
        plain = SplitKv.for_step(lengths, table, q.shape[1], POSITIONS, head_dim).plain(q, k, v)  # in PLAIN_ROWS chunks
        if not torch.allclose(plain.float(), want.float(), atol=1e-6, rtol=1e-6):
            found.append(f"{name}: SplitKv.plain, {decodeattention.PLAIN_ROWS} rows at a time, is not the reference")
        expected = {"reference": want, "masked SDPA": masked}
        for (what, want), (atol, rtol) in zip(expected.items(), TOLERANCES[dtype], strict=True):
            for row, length in enumerate(LENGTHS):
                if not torch.allclose(got[row].float(), want[row].float(), atol=atol, rtol=rtol):
                    worst = (got[row].float() - want[row].float()).abs().max().item()
                    found.append(f"{name}: length {length} differs from {what} by up to {worst:.3g}")
        for row in (0, len(LENGTHS) - 1) if dtype == torch.bfloat16 else ():
            alone = kernels(q[row : row + 1], k, v, table[row : row + 1], lengths[row : row + 1])
            if not torch.equal(alone[0], got[row]):
                found.append(f"{name}: length {LENGTHS[row]} computed alone differs from its row in the batch")
    return found


def small_model(device: str) -> Transformer:
    """Two layers, 8 q heads over 2 kv heads of 64 dims, float32, seeded weights (norms near one)."""
    config = ModelConfig(vocab_size=128, hidden_size=128, intermediate_size=96, num_attention_heads=8, head_dim=64)
    with torch.device("meta"):
        model = Transformer(config, torch.float32)
    g = torch.Generator().manual_seed(0)
    state = {
        name: (1.0 if "norm" in name else 0.0) + 0.15 * torch.randn(p.shape, generator=g)
        for name, p in model.named_parameters()
    }
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device)


def model_mismatches(device: str) -> list[str]:
    """Decode steps of three rows prefilled to different lengths, their blocks scattered over one pool, at positions on
    both sides of the splits' bounds: each row's logits with split-KV attention (``kv_len`` None) against masked SDPA
    over the whole cache, and every split-KV call within the tolerance of its plain torch (``SplitKv.plain``)."""
    model = small_model(device)
    width = blocks_for(POSITIONS)
    cache = KVCache.pool(model.config, model.tp, 3, POSITIONS, 2 + 3 * width, device, torch.float32)
    order = 1 + torch.randperm(1 + 3 * width, generator=torch.Generator().manual_seed(2))
    for row in range(3):  # each row's blocks scattered over the pool
        cache.assign(row, order[row * width : (row + 1) * width].tolist())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (3, POSITIONS - 8), generator=g).to(device)
    model.hidden(ids, 0, cache)
    found = []
    for positions in ([0, SPLIT - 1, SPLIT], [SPLIT + 1, 2 * SPLIT, POSITIONS - 1]):
        tokens = torch.tensor([5, 6, 7], device=device)
        at = torch.tensor(positions, device=device)
        with checking() as worst:  # each attention call also against plain torch (the engine's kernel check)
            split_kv = model.decode(tokens, at, cache, None)
        if not worst.get(CHECKED, float("inf")) <= TOLERANCE:
            found.append(f"the model's decode at positions {positions}: split-KV calls depart {worst.get(CHECKED)}")
        masked = model.decode(tokens, at, cache, POSITIONS)
        if not torch.allclose(split_kv, masked, atol=1e-4, rtol=1e-4):
            worst = (split_kv - masked).abs().max().item()
            found.append(f"the model's decode at positions {positions}: split-KV differs from masked by {worst:.3g}")
    return found


if __name__ == "__main__":
    decodeattention.PLAIN_ROWS = 2  # so that SplitKv.plain takes the LENGTHS rows in chunks, the last one short
    print(json.dumps(mismatches(sys.argv[1]) + model_mismatches(sys.argv[1])))
