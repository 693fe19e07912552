"""The reference engine's model: a Llama-family decoder, all of it in this one file.

RMSNorm, RoPE, grouped-query attention and a SwiGLU MLP, with q/k/v and gate/up fused into one
weight each (the layout the load pipeline produces). Built on the ``meta`` device and then bound
to processed tensors without a copy, so the same module serves weights loaded from disk or
mapped from the weight cache.

Scope: inference only (no gradients, no dropout), batch-first, plain RoPE without scaling, and
Megatron-style tensor parallelism over ``torch.distributed``: q/k/v, gate/up and the vocabulary are
split by rows, ``o_proj`` and ``down_proj`` by columns. Parameter names and per-rank shapes are the
table in ``docs/architecture.md``. The model holds parameters only, no buffers.

Two entry points. ``forward`` runs T tokens of every row from one start position (a prefill, or
any chunk): attention is ``F.scaled_dot_product_attention`` with cuDNN's backend excluded, because
on CUDA cuDNN builds a plan for every new KV length (~57 ms each on an H200, see
"Measured facts" in ``docs/architecture.md``); a chunk at position 0 is causal with no mask, so it stays
on flash attention. ``decode`` runs one token per row, each row at its own position (continuous
batching). The KV cache is paged (``KVCache``, ``standby.kvpool``): blocks of 16 positions in one pool, and a
block table, device data, naming each row's blocks. Keys and values are written into the block and offset of each
row's position (``slots``: ``index_put_`` with index tensors read from the table, which neither syncs nor depends
on the values), and attention reads each row's positions one of two ways. With a ``kv_len``, ``MaskedReads``: the
row's first ``kv_len`` positions gathered through its table, with each row's length as an additive mask (made once
per step, so no layer converts a boolean one); the q heads that share a kv head stand in for the query positions,
so grouped-query attention needs no copy of the keys (on CUDA the masked call runs on the memory-efficient kernel);
the shapes depend on the batch size and ``kv_len``, and every step pays for ``kv_len`` positions. Without one (CUDA
with Triton), ``SplitKv``: each row's length and table are device data that split-KV kernels read
(``standby.decodeattention``), so a step costs its rows' lengths and its shapes depend on the batch size alone.
Either way nothing depends on where the sequences are, nor on which blocks they hold, which is what lets a
scheduler warm every shape up front and capture the step as a CUDA graph.
"""

from __future__ import annotations

import secrets
from collections.abc import Collection, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from hotweights import quant
from hotweights.layout import ModelConfig, check_tensor_parallel
from hotweights.quant import dequantize, scale_shape
from hotweights.standby import fused
from hotweights.standby.decodeattention import SplitKv, gathered
from hotweights.standby.kvpool import BLOCK_SIZE, blocks_for
from hotweights.standby.sampling import sample_token

# Every SDPA backend but cuDNN's (module docstring): these take any length without a per-shape plan.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass(frozen=True)
class TensorParallel:
    """Which shard of the model this process holds. ``group=None`` with ``size > 1`` means the
    default (world) process group."""

    size: int = 1
    rank: int = 0
    group: object | None = None  # a torch.distributed ProcessGroup when size > 1


def _empty(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    """An uninitialised frozen parameter: the weights are bound later, so never spend time on init."""
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


def _all_reduce(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Sum the partial results of a row-parallel layer across ranks (in place)."""
    if tp.size > 1:
        dist.all_reduce(x, group=tp.group)
    return x


def _all_gather_last(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Concatenate each rank's slice of the last dim, in rank order."""
    if tp.size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x, group=tp.group)
    return torch.cat(parts, dim=-1)


class Linear(nn.Linear):
    """nn.Linear without bias and without its random init, which is wasted work: weights are bound later."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias=False, dtype=dtype)  # weight (N, K)
        self.weight.requires_grad_(False)

    def reset_parameters(self) -> None:
        pass


class Fp8BlockLinear(nn.Module):
    """y = x W^T with W stored as block FP8 (``hotweights.quant``); W is dequantized on every call.

    That is slow and uses a full-size temporary, but it is exact to the stored format, which is
    what a reference model is for; fast engines use fused FP8 GEMMs instead.
    """

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features, dtype=quant.FP8_DTYPE)  # (N, K)
        self.weight_scale_inv = _empty(*scale_shape(out_features, in_features), dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.weight, self.weight_scale_inv, dtype=x.dtype))


def _projection(in_features: int, out_features: int, config: ModelConfig, dtype: torch.dtype) -> nn.Module:
    if config.quant == quant.FP8_BLOCK:
        return Fp8BlockLinear(in_features, out_features)
    return Linear(in_features, out_features, dtype)


class RMSNorm(nn.Module):
    """x / rms(x) * w, computed in float32 so low-precision inputs do not lose the small terms."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty(dim, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add before this norm, in the same kernel: (x + delta, self(x + delta))."""
        return fused.add_rms_norm(x, delta, self.weight, self.eps)


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (*positions.shape, hd), for the given positions. Computed per call (no
    buffers to bind), in float32 so large positions keep their precision, then cast like Hugging
    Face Llama does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # (..., hd/2)
    angles = torch.cat((freqs, freqs), dim=-1)  # (..., hd)
    return angles.cos().to(dtype), angles.sin().to(dtype)


# One layer's cache as a forward pass sees it: the layer's key and value blocks, the rows' block table, and the
# (block, offset) of each of the pass's positions (``slots``: the same for every layer, so made once per pass).
LayerKv = tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class Attention(nn.Module):
    """Causal grouped-query attention over this rank's heads; ``o_proj`` partial sums are reduced."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.head_dim = config.head_dim
        self.n_head = config.num_attention_heads // tp.size  # this rank's q heads
        self.n_kv_head = config.num_key_value_heads // tp.size  # this rank's k and v heads
        q_out, kv_out = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.qkv_proj = _projection(config.hidden_size, q_out + 2 * kv_out, config, dtype)
        self.o_proj = _projection(q_out, config.hidden_size, config, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        start_pos: int,
        kv_cache: LayerKv | None,
    ) -> torch.Tensor:
        """x (B, T, H) at positions start_pos ..; ``kv_cache``: this layer's blocks, the rows' block table and where
        the positions lie (``LayerKv``), or None. Returns (B, T, H)."""
        B, T, _ = x.shape
        hd, nh = self.head_dim, self.n_head
        qk, v = self.qkv_proj(x).split([(nh + self.n_kv_head) * hd, self.n_kv_head * hd], -1)
        qk = fused.rope(qk.view(B, T, -1, hd), cos[:, None], sin[:, None])  # q and k heads: (B, T, nh + nkv, hd)
        v = v.view(B, T, self.n_kv_head, hd)
        q, k = qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:]  # (B, nh, T, hd), (B, T, nkv, hd)

        mask = None  # from position 0 the chunk attends causally to itself only
        if kv_cache is not None:
            end = start_pos + T
            cache_k, cache_v, table, at = kv_cache
            cache_k.index_put_(at, k)
            cache_v.index_put_(at, v)
            if start_pos > 0:  # attend over everything so far: (B, start_pos + T, nkv, hd)
                k, v = gathered(cache_k, table, end), gathered(cache_v, table, end)
                query_pos = torch.arange(start_pos, end, device=x.device)[:, None]
                mask = query_pos >= torch.arange(end, device=x.device)[None, :]  # (T, end), True = attend
        k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, nkv, T or end, hd)

        with sdpa_kernel(SDPA_BACKENDS):  # q head i reads kv head i // (nh / nkv)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * hd)  # from (B, nh, T, hd)
        return _all_reduce(self.o_proj(y), self.tp)

    def decode(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        at: tuple[torch.Tensor, torch.Tensor],
        reads: MaskedReads | SplitKv,
        cache_k: torch.Tensor,
        cache_v: torch.Tensor,
    ) -> torch.Tensor:
        """One token per row: x (B, H); cos/sin (B, 1, hd); ``at`` each row's (block, offset) of its position, (B, 1)
        each (``slots``); ``reads`` how attention reads each row's positions (``Transformer.decode``); cache_k/v this
        layer's blocks (blocks, BLOCK_SIZE, nkv, hd). Writes each row's k and v at its position, attends over the row's
        positions up to it, returns (B, H)."""
        B = x.shape[0]
        q = fused.rope_store(self.qkv_proj(x), self.n_head, cos, sin, cache_k, cache_v, at)  # (B, nh, hd)
        y = reads.attend(q, cache_k, cache_v)  # (B, nh, hd)
        return _all_reduce(self.o_proj(y.reshape(B, self.n_head * self.head_dim)), self.tp)


def slots(table: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ``positions`` (B, T) of the rows of ``table`` (B, W) lie in a layer's blocks: (block, offset) index
    tensors, (B, T) each, that index (blocks, BLOCK_SIZE, ...) tensors. Device work only: nothing syncs."""
    return table.gather(1, positions // BLOCK_SIZE).long(), positions % BLOCK_SIZE


@dataclass(frozen=True)
class MaskedReads:
    """Decode attention over the first L positions of every row, gathered through its block table's first blocks
    (B, ceil(L / BLOCK_SIZE)), each row's length an additive mask (B, 1, 1, L): 0 where the row may attend, -inf
    elsewhere. Both made once per step (the table's entries as the int64 indices ``gathered`` takes), so no layer
    converts them again."""

    mask: torch.Tensor
    table: torch.Tensor

    @classmethod
    def for_step(cls, positions: torch.Tensor, kv_len: int, dtype: torch.dtype, table: torch.Tensor) -> MaskedReads:
        """Rows at ``positions`` (B,), each attending to 0 .. its position, over ``kv_len`` positions of its blocks."""
        beyond = torch.arange(kv_len, device=positions.device) > positions[:, None]  # (B, L)
        mask = torch.zeros(beyond.shape, dtype=dtype, device=positions.device).masked_fill_(beyond, float("-inf"))
        return cls(mask[:, None, None], table[:, : blocks_for(kv_len)].long())

    def attend(self, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        """q (B, nh, hd); cache_k/v a layer's blocks (blocks, BLOCK_SIZE, nkv, hd): (B, nh, hd). The group of q heads
        that share a kv head stand in for the query positions, (B, nkv, g, hd), so grouped-query attention needs no
        copy of the keys beyond the gather."""
        B, nh, hd = q.shape
        nkv, L = cache_k.shape[2], self.mask.shape[-1]
        k, v = (gathered(cache, self.table, L).transpose(1, 2) for cache in (cache_k, cache_v))  # (B, nkv, L, hd)
        with sdpa_kernel(SDPA_BACKENDS):
            y = F.scaled_dot_product_attention(q.view(B, nkv, nh // nkv, hd), k, v, attn_mask=self.mask)
        return y.reshape(B, nh, hd)


class MLP(nn.Module):
    """SwiGLU over this rank's slice of the intermediate dim; ``down_proj`` partial sums are reduced."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        inter = config.intermediate_size // tp.size
        self.gate_up_proj = _projection(config.hidden_size, 2 * inter, config, dtype)
        self.down_proj = _projection(inter, config.hidden_size, config, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(self.down_proj(fused.silu_mul(self.gate_up_proj(x))), self.tp)  # gate, up: (..., I/tp) each


class Block(nn.Module):
    """Pre-norm residual block. It takes and returns the residual stream ``x`` with the output ``delta``
    of the block before it not yet added (zeros for the first block), so that every residual add
    runs in the same kernel as the norm after it; the caller adds the last block's ``delta``."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype, tp)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        start_pos: int,
        kv_cache: LayerKv | None,
        delta: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, h = self.input_layernorm.add(x, delta)
        x, h = self.post_attention_layernorm.add(x, self.self_attn(h, cos, sin, start_pos, kv_cache))
        return x, self.mlp(h)

    def decode(
        self, x: torch.Tensor, delta: torch.Tensor, *attention: torch.Tensor | tuple[torch.Tensor, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token per row, x and delta (B, H); ``attention`` as for ``Attention.decode``."""
        x, h = self.input_layernorm.add(x, delta)
        x, h = self.post_attention_layernorm.add(x, self.self_attn.decode(h, *attention))
        return x, self.mlp(h)


class VocabParallelEmbedding(nn.Module):
    """Rows [rank*V/tp, (rank+1)*V/tp) of the table; ids owned by other ranks look up zeros, and the
    all-reduce fills them in."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _empty(vocab_size // tp.size, dim, dtype=dtype)  # (V/tp, H)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.tp.rank * self.weight.shape[0]
        foreign = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(foreign, 0), self.weight)
        return _all_reduce(x.masked_fill(foreign[..., None], 0), self.tp)


@dataclass
class KVCache:
    """Keys and values for every layer in blocks of BLOCK_SIZE positions, and the block table that says where each
    row's positions lie (``standby.kvpool``), written in place by ``Transformer.forward`` and ``decode``."""

    k: torch.Tensor  # (layers, blocks, BLOCK_SIZE, nkv/tp, hd)
    v: torch.Tensor  # (layers, blocks, BLOCK_SIZE, nkv/tp, hd)
    table: torch.Tensor  # (rows, ceil(max_tokens / BLOCK_SIZE)) int32: row r's position p is in block table[r, p // 16]
    max_tokens: int  # positions a row may hold

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        tp: TensorParallel,
        batch: int,
        max_tokens: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> KVCache:
        """``batch`` rows, each with blocks of its own for all ``max_tokens`` positions (``generate``'s)."""
        width = blocks_for(max_tokens)
        cache = cls.pool(config, tp, batch, max_tokens, 1 + batch * width, device, dtype)
        cache.table.copy_(torch.arange(1, 1 + batch * width, dtype=torch.int32).view(batch, width))
        return cache

    @classmethod
    def pool(
        cls,
        config: ModelConfig,
        tp: TensorParallel,
        rows: int,
        max_tokens: int,
        blocks: int,
        device: torch.device | str,
        dtype: torch.dtype,
    ) -> KVCache:
        """A pool of ``blocks`` blocks for ``rows`` rows of up to ``max_tokens`` positions, every row's table on the
        null block (``standby.kvpool``: ``assign`` gives a row its blocks)."""
        shape = cls.shape(config, tp, blocks)
        # Zeros, not empty: reads are masked, but a NaN from stale memory would survive 0 * NaN.
        k, v = (torch.zeros(shape, device=device, dtype=dtype) for _ in range(2))
        return cls.over(k, v, rows, max_tokens)

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor, rows: int, max_tokens: int) -> KVCache:
        """A cache on the blocks ``k`` and ``v`` (allocated elsewhere: ``standby.kvshare``), every table entry null."""
        table = torch.zeros((rows, blocks_for(max_tokens)), dtype=torch.int32, device=k.device)
        return cls(k, v, table, max_tokens)

    @staticmethod
    def shape(config: ModelConfig, tp: TensorParallel, blocks: int) -> tuple[int, int, int, int, int]:
        """Keys' (and values') shape: (layers, blocks, BLOCK_SIZE, nkv/tp, hd)."""
        check_tensor_parallel(config, tp.size, tp.rank)
        return config.num_hidden_layers, blocks, BLOCK_SIZE, config.num_key_value_heads // tp.size, config.head_dim

    @classmethod
    def position_bytes(cls, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype) -> int:
        """The bytes of one KV position on rank ``tp.rank``: keys and values of every layer."""
        layers, _, _, heads, head_dim = cls.shape(config, tp, 1)
        return 2 * layers * heads * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    @property
    def batch(self) -> int:
        return self.table.shape[0]

    @property
    def blocks(self) -> int:
        return self.k.shape[1]

    def rows(self, first: int, count: int) -> KVCache:
        """Rows ``first`` .. ``first + count - 1``: their table, the same blocks."""
        return KVCache(self.k, self.v, self.table[first : first + count], self.max_tokens)

    def assign(self, row: int, blocks: list[int]) -> None:
        """Row ``row``'s positions lie in ``blocks`` from now on, those past them in the null block."""
        entries = torch.zeros(self.table.shape[1], dtype=torch.int32)
        entries[: len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        self.table[row].copy_(entries)


class Transformer(nn.Module):
    """The decoder. Parameters are uninitialised; build under ``torch.device("meta")`` and bind."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, tp: TensorParallel = TensorParallel()) -> None:
        super().__init__()
        check_tensor_parallel(config, tp.size, tp.rank)
        self.config = config
        self.tp = tp
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(Block(config, dtype, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # Tied models have no lm_head parameter at all: logits reuse embed_tokens.weight.
        self.lm_head = (
            None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size // tp.size, dtype)
        )

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None) -> torch.Tensor:
        """Float32 logits (B, T, V) over the full vocabulary for tokens at start_pos .. start_pos+T-1.

        Without a cache the T tokens attend only to each other (causally). With one, their k/v are
        written at [start_pos, start_pos+T) and they attend to every cached position before them.
        """
        return self.logits(self.hidden(input_ids, start_pos, cache))

    @torch.inference_mode()
    def hidden(self, input_ids: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None) -> torch.Tensor:
        """``forward`` up to the final norm: (B, T, H); ``logits`` of the rows wanted finishes it."""
        B, T = input_ids.shape
        if cache is not None:
            if start_pos + T > cache.max_tokens:
                raise ValueError(f"start_pos {start_pos} + {T} tokens exceeds the KV cache's {cache.max_tokens} tokens")
            if cache.batch != B:
                raise ValueError(f"batch {B} does not match the KV cache's batch {cache.batch}")
        positions = torch.arange(start_pos, start_pos + T, device=input_ids.device)
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta, self.dtype)

        at = None if cache is None else slots(cache.table, positions.expand(B, T))  # (B, T) each, for every layer

        x = self.embed_tokens(input_ids)  # (B, T, H)
        delta = torch.zeros_like(x)
        for i, layer in enumerate(self.layers):
            kv = None if at is None else (cache.k[i], cache.v[i], cache.table, at)
            x, delta = layer(x, cos, sin, start_pos, kv, delta)
        return self.norm.add(x, delta)[1]

    @torch.inference_mode()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits (..., V) over the full vocabulary from final hidden states (..., H)."""
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight  # (V/tp, H)
        return _all_gather_last(F.linear(x, head).float(), self.tp)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int | None) -> torch.Tensor:
        """Float32 logits (B, V): row b feeds ``tokens[b]`` at ``positions[b]`` into row b of the cache.

        Rows are the cache's first B (B <= cache.batch); each attends to its positions 0 .. positions[b]
        (< cache.max_tokens; not checked: that would sync the device). With ``kv_len`` None each row's length is
        device data, read by the split-KV kernels (``standby.decodeattention``; only where ``supported``), so
        the shapes depend on B alone; with a ``kv_len`` (every positions[b] < ``kv_len``) attention reads that
        many positions with a mask (``MaskedReads``), the shapes depend on B and ``kv_len``. Nothing here syncs,
        so the call can be captured in a CUDA graph.
        """
        B = tokens.shape[0]
        cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta, self.dtype)
        table = cache.table[:B]
        at = slots(table, positions[:, None])  # (B, 1) each
        if kv_len is None:
            q_heads = self.config.num_attention_heads // self.tp.size
            reads = SplitKv.for_step(positions + 1, table, q_heads, cache.max_tokens, self.config.head_dim)
        else:
            reads = MaskedReads.for_step(positions, kv_len, self.dtype, table)
        attention = (cos[:, None], sin[:, None], at, reads)
        x = self.embed_tokens(tokens)  # (B, H)
        delta = torch.zeros_like(x)
        for i, layer in enumerate(self.layers):
            x, delta = layer.decode(x, delta, *attention, cache.k[i], cache.v[i])
        return self.logits(self.norm.add(x, delta)[1])


def _shared_seed(model: Transformer) -> int:
    """A fresh random seed, the same on every tensor-parallel rank (rank 0's) so they sample alike."""
    seed = torch.tensor([secrets.randbits(62)], device=model.device)
    if model.tp.size > 1:
        src = 0 if model.tp.group is None else dist.get_global_rank(model.tp.group, 0)
        dist.broadcast(seed, src=src, group=model.tp.group)
    return int(seed)


def generate(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_ids: Collection[int] = (),
    cache: KVCache | None = None,
) -> Iterator[int]:
    """Yield up to ``max_new_tokens`` new token ids, one per decode step.

    The prompt is prefilled in one forward; each later token is one ``decode`` step (batch 1, the KV
    positions so far) over the KV cache. The
    stop token, if one is sampled, ends the stream and is not yielded. Generation also ends, early,
    when the next position would not fit in the cache or ``max_position_embeddings``. Arguments are
    checked here, before the first ``next()``. With tensor parallelism every rank must call this with
    the same arguments; all ranks then yield the same ids (``seed=None`` is agreed via a broadcast).
    """
    config = model.config
    if not prompt_ids:
        raise ValueError("prompt_ids is empty; generation needs at least one prompt token")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
    if temperature < 0.0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature} and {top_p}")
    if bad := [t for t in prompt_ids if not 0 <= t < config.vocab_size]:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {config.vocab_size})")
    if cache is None:
        max_tokens = min(len(prompt_ids) + max_new_tokens, config.max_position_embeddings)
        cache = KVCache.allocate(config, model.tp, 1, max_tokens, model.device, model.dtype)
    limit = min(cache.max_tokens, config.max_position_embeddings)
    if len(prompt_ids) > limit:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens exceeds the limit of {limit} tokens (KV cache "
            f"{cache.max_tokens}, max_position_embeddings {config.max_position_embeddings})"
        )
    if seed is None:
        seed = _shared_seed(model) if temperature > 0 else 0  # greedy never draws from it
    sampling = (temperature, top_p, seed)
    return _decode(model, prompt_ids, max_new_tokens, sampling, set(stop_ids), cache, limit)


def _decode(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: tuple[float, float, int],  # temperature, top_p, seed
    stop_ids: set[int],
    cache: KVCache,
    limit: int,
) -> Iterator[int]:
    if max_new_tokens == 0:
        return
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)  # (1, T)
    logits = model.logits(model.hidden(ids, 0, cache)[0, -1])
    pos = len(prompt_ids)  # where the next fed token goes
    for step in range(max_new_tokens):
        token = sample_token(logits, *sampling, pos)
        if token in stop_ids:
            return
        yield token
        if step + 1 == max_new_tokens or pos >= limit:
            return
        fed = torch.tensor([[token], [pos]], dtype=torch.long, device=model.device)  # token, position
        logits = model.decode(fed[0], fed[1], cache, pos + 1)[0]
        pos += 1
