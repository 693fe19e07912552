"""``hotweights generate``: complete one prompt from the command line.

The completion goes to stdout as it is produced; logs and progress go to stderr. With no
``--model`` it uses the embedded tiny default, generated on first use. It is the quickest check
that a checkpoint loads and computes, and with ``--tp-size N`` it runs N ranks over gloo (CPU) or
NCCL (CUDA), rank 0 printing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from dataclasses import replace

import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from hotweights.cache.checkpoint import read_checkpoint
from hotweights.cache.pipeline import add_load_spec_arguments, load_spec_from_args, model_dir_from_args
from hotweights.errors import ConfigError
from hotweights.ports import free_port
from hotweights.standby.model import Transformer, generate
from hotweights.standby.weights import add_weight_cache_arguments, load_model
from hotweights.tokenizer import load_tokenizer, stop_token_ids


class TextStream:
    """Token ids in, text pieces out. Holds back an incomplete UTF-8 sequence and any tail that may
    be the start of a stop string; at a stop string, ends the text just before it.

    A token is *released* once all of its text has been handed out and nothing after it has: the
    text handed out is then exactly the decoding of the released tokens (``take_released``). Text
    held back never belongs to a released token, so a generation resumed from the prompt plus the
    released tokens hands out what this one would have, stop strings that span the cut included.

    Decoding is incremental: each token decodes only the ids since the last complete character (plus
    the token before them, for context), so a long completion costs linear time, not quadratic."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # the decoded text of ids[:read], whole characters only
        self.prefix = 0  # ids[prefix:read] decode to the tail of ``text`` the next decode starts from
        self.read = 0
        self.sent = 0  # characters handed out so far
        self.stopped = False
        self.released = 0  # tokens of ``ids`` whose text is wholly handed out (and no more than that)
        self.taken = 0  # released tokens already returned by ``take_released``

    def take_released(self) -> list[int]:
        """The tokens released since the last call."""
        ids, self.taken = self.ids[self.taken : self.released], self.released
        return ids

    def _pending(self) -> str:
        """The text of ids[read:], decoded in the context of ids[prefix:read]."""
        settled = self.tokenizer.decode(self.ids[self.prefix : self.read])
        return self.tokenizer.decode(self.ids[self.prefix :])[len(settled) :]

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.text + self._pending()
        if self.stop:
            longest = max(map(len, self.stop))
            hits = [i for s in self.stop if (i := text.find(s, max(0, self.sent - longest + 1))) >= 0]
            if hits:
                self.stopped = True
                return self._advance(text, min(hits))
        if text.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the rest of its bytes
        self.text, self.prefix, self.read = text, max(self.read - 1, 0), len(self.ids)
        return self._advance(text, len(text) - self._stop_prefix_len(text))

    def flush(self) -> str:
        """The rest of the text, once generation has ended without a stop string."""
        text = self.text + self._pending()
        return "" if self.stopped else self._advance(text, len(text))

    def _advance(self, text: str, end: int) -> str:
        piece = text[self.sent : end]
        self.sent = max(self.sent, end)
        if self.sent == len(text) and not self.stopped:
            self.released = len(self.ids)
        return piece

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that a stop string starts with."""
        return max((n for s in self.stop for n in range(len(s) - 1, 0, -1) if text.endswith(s[:n])), default=0)


def stream_text(
    model: Transformer,
    tokenizer: Tokenizer,
    prompt: str,
    max_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_ids: tuple[int, ...] = (),
) -> Iterator[str]:
    """Yield text pieces as tokens are generated, holding back incomplete UTF-8 sequences."""
    prompt_ids = tokenizer.encode(prompt).ids
    if not prompt_ids:
        raise ConfigError("--prompt is empty after tokenization")
    text = TextStream(tokenizer, stop=())
    for token in generate(
        model, prompt_ids, max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop_ids=stop_ids
    ):
        if piece := text.push(token):
            yield piece
    if rest := text.flush():
        yield rest


def run_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    """One tensor-parallel rank (the only one when --tp-size is 1)."""
    spec = load_spec_from_args(args, tp_rank=rank)
    group = None
    if args.tp_size > 1:
        if spec.device.startswith("cuda"):
            spec = replace(spec, device=f"cuda:{rank}")
            torch.cuda.set_device(spec.device)
        backend = "nccl" if spec.device.startswith("cuda") else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.tp_size)
        group = dist.group.WORLD
    try:
        loaded = load_model(
            model_dir_from_args(args),
            spec,
            weight_cache=args.weight_cache,
            socket_path=args.socket,
            fallback=args.weight_cache_fallback,
            group=group,
            daemon_timeout=args.weight_cache_timeout,
        )
        model_dir = loaded.checkpoint.path
        pieces = stream_text(
            loaded.model,
            load_tokenizer(model_dir),
            args.prompt,
            args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop_ids=stop_token_ids(model_dir),
        )
        for piece in pieces:
            if rank == 0:
                sys.stdout.write(piece)
                sys.stdout.flush()
        if rank == 0:
            sys.stdout.write("\n")
    finally:
        if group is not None:
            dist.destroy_process_group()


def _spawned_rank(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    run_rank(rank, args, port)


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be >= 1, found {args.max_tokens}")
    if args.temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, found {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise ConfigError(f"--top-p must be in (0, 1], found {args.top_p}")
    if args.tp_size < 1:
        raise ConfigError(f"--tp-size must be >= 1, found {args.tp_size}")
    if args.tp_size == 1:
        run_rank(0, args, 0)
        return 0
    if args.socket:
        raise ConfigError("--socket names one daemon, but --tp-size > 1 needs one per rank: leave it unset")
    args.model = str(model_dir_from_args(args))
    read_checkpoint(args.model)  # fail here, once, rather than in every rank
    torch.multiprocessing.spawn(_spawned_rank, args=(args, free_port()), nprocs=args.tp_size, join=True)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate",
        help="complete a prompt (prints the completion to stdout)",
        description="Load a checkpoint through the load pipeline and complete one prompt.",
    )
    add_load_spec_arguments(p, with_rank=False)
    add_weight_cache_arguments(p)
    p.add_argument("--prompt", required=True, help="text to complete")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (deterministic output per seed)")
    p.set_defaults(func=cmd_generate)
