"""The paged KV cache's bookkeeping: fixed-size blocks of one pool per engine, handed to sequences whole.

An engine's keys and values live in one pool of ``blocks`` blocks of BLOCK_SIZE positions (``standby.model.KVCache``:
per layer (blocks, BLOCK_SIZE, kv heads, head dim)); each sequence's row of the block table names the blocks its
positions lie in, position p in block ``table[row, p // BLOCK_SIZE]`` at offset ``p % BLOCK_SIZE``. Block NULL_BLOCK
belongs to no sequence: a free row's table, and a row's entries past its sequence's blocks, name it, so that what
a dummy row or a prefill's padding writes lands there, and is never read as a sequence's.

A sequence takes every block it can need when it is admitted (``sequence_blocks``: its prompt and every generated
token but the last, which is never fed back) and gives them back when it ends: a sequence that started always
finishes, nothing is ever preempted. So the pool bounds how many sequences run at once by what they hold, not by the
longest a sequence may be (``--kv-cache-tokens``, the most a sequence may hold).

Sizes (``auto_pool_tokens``, ``auto_max_batch``): on CPU the pool holds CPU_POOL_TOKENS positions, as much memory
as the slots of four sequences of 4096 tokens took before the pool; on CUDA the engine's share of the device memory
left after its weights (``--kv-pool-share``: the controller gives each engine of a device its part of
``engine.kv_memory_share``). Either way no more than every row at its longest could use. ``max_batch`` then defaults
to the sequences of SEQUENCE_TOKENS positions the pool holds at once, at most MAX_AUTO_BATCH.

How ``hotweights status`` shows an engine's pool (``cells``) is here too. Pure: nothing here imports torch (the fast
test tier runs it without, and the controller imports it).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

BLOCK_SIZE = 16  # KV positions per block
NULL_BLOCK = 0  # the block no sequence owns (module docstring)
AUTO = 0  # --kv-pool-tokens and --max-batch: sized automatically
CPU_POOL_TOKENS = 16384  # the automatic pool on CPU: 4 x 4096 positions (module docstring)
SEQUENCE_TOKENS = 512  # the positions a typical sequence holds (prompt and generated), for the automatic max_batch
# The automatic max_batch's ceiling: an xl decode step at 64 rows still within a few of its batch-1 time (the split-KV
# kernels read each row's own length), and a step of fewer rows replays the next power of two's CUDA graph
# (``standby.decoder.batch_buckets``), whose padding rows cost little while the weights' reads bound the step.
MAX_AUTO_BATCH = 64
KV_MEMORY_SHARE = 0.6  # on CUDA, the share of a device's memory after the weights that its engines' pools take
# --kv-pool-share's default: an engine's part of KV_MEMORY_SHARE as one of the four ``up`` keeps on a device by default
# (three and a spare), so that engines started by hand share a device as a stack's do (the controller passes its own).
ENGINE_KV_SHARE = KV_MEMORY_SHARE / 4


def blocks_for(tokens: int) -> int:
    """The blocks that hold ``tokens`` positions."""
    return -(-tokens // BLOCK_SIZE)


def sequence_blocks(prompt: int, max_tokens: int) -> int:
    """The blocks a sequence of a ``prompt``-token prompt and ``max_tokens`` new tokens writes: its prompt's positions
    and those of every generated token fed back (all but the last)."""
    return blocks_for(prompt + max(max_tokens, 1) - 1)


def pool_blocks(tokens: int) -> int:
    """The blocks of a pool that holds ``tokens`` positions for sequences: theirs and NULL_BLOCK."""
    return blocks_for(tokens) + 1


def auto_pool_tokens(memory_bytes: int | None, token_bytes: int, rows: int, kv_tokens: int) -> int:
    """The automatic pool's positions (module docstring): those ``memory_bytes`` hold at ``token_bytes`` a position
    (None: CPU_POOL_TOKENS), at most ``rows`` sequences of ``kv_tokens``, in whole blocks."""
    tokens = CPU_POOL_TOKENS if memory_bytes is None else memory_bytes // token_bytes
    tokens = min(tokens, rows * kv_tokens)
    return max(tokens // BLOCK_SIZE * BLOCK_SIZE, 0)


def auto_max_batch(pool_tokens: int) -> int:
    """The automatic max_batch: the sequences of SEQUENCE_TOKENS the pool holds at once, 1 .. MAX_AUTO_BATCH."""
    return max(1, min(MAX_AUTO_BATCH, pool_tokens // SEQUENCE_TOKENS))


def pool_refusal(pool_tokens: int, kv_tokens: int) -> str | None:
    """Why a pool of ``pool_tokens`` positions cannot serve sequences of up to ``kv_tokens``: it must hold one at
    its longest (a request that can never fit is refused, one that fits always finishes); None when it can. The
    caller names its settings and their fix."""
    if blocks_for(pool_tokens) >= blocks_for(kv_tokens):
        return None
    return f"a KV pool of {pool_tokens} positions cannot hold one sequence of {kv_tokens} positions"


def shortfall(needed: int, pool: int) -> str | None:
    """Why a request whose sequences need ``needed`` blocks can never run on a pool of ``pool`` blocks; None when it
    can (it may have to wait for them)."""
    if needed <= pool:
        return None
    return (
        f"the request's sequences need {needed} KV blocks of {BLOCK_SIZE} positions ({needed * BLOCK_SIZE} positions), "
        f"more than this engine's whole KV pool of {pool} blocks"
    )


@dataclass
class BlockPool:
    """The free blocks of a pool of ``blocks`` (NULL_BLOCK never among them), handed out lowest first."""

    blocks: int
    _free: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self._free = list(range(NULL_BLOCK + 1, self.blocks))  # a heap: the lowest first

    @property
    def total(self) -> int:
        """The blocks sequences may hold."""
        return self.blocks - 1

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.total - self.free

    def take(self, n: int) -> list[int] | None:
        """``n`` free blocks, now the caller's; None (nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        return [heapq.heappop(self._free) for _ in range(n)]

    def give(self, blocks: list[int]) -> None:
        """Blocks ``take`` handed out, free again."""
        for block in blocks:
            heapq.heappush(self._free, block)


def cells(report: object) -> tuple[str, str, str]:
    """A pool an engine's health reply reports (``kv_pool``) as ``hotweights status``'s KV (blocks in use of all), RUN
    and WAIT (sequences) cells; ``-`` each for an engine that reports none (vLLM, SGLang, not answered yet)."""
    if not isinstance(report, dict):
        return "-", "-", "-"
    return f"{report.get('used')}/{report.get('blocks')}", str(report.get("running")), str(report.get("waiting"))
