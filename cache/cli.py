"""``hotweights cache serve|snapshot|status|verify``: run, snapshot and inspect weight cache daemons."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from hotweights.cache.backends import BACKENDS, default_backend_name, device_context, get_backend
from hotweights.cache.checkpoint import read_checkpoint
from hotweights.cache.client import attach
from hotweights.cache.connection import AttachRefused, DaemonUnavailable, request
from hotweights.cache.daemon import FILL_SOURCES, ArenaSource, load_arena, pipeline_source, serve
from hotweights.cache.fingerprint import Fingerprint, compute_fingerprint
from hotweights.cache.paths import paths_for, remove_if_stale
from hotweights.cache.pipeline import (
    add_load_spec_arguments,
    add_read_arguments,
    load_spec_from_args,
    model_dir_from_args,
)
from hotweights.cache.protocol import KV_RETAIN_S
from hotweights.cache.seeding import add_seed_arguments, seed_options
from hotweights.cache.sglang_format import sglang_source
from hotweights.cache.snapshot import write_snapshot
from hotweights.cache.vllm_format import vllm_source
from hotweights.engines import SGLANG_FORMAT, VLLM_FORMAT
from hotweights.errors import ConfigError
from hotweights.paths import private_dir, runtime_dir
from hotweights.spawn import add_spare_arguments, wait_for_start
from hotweights.stats import ms

log = logging.getLogger(__name__)


def _source(args: argparse.Namespace) -> ArenaSource:
    """What ``--model``, ``--format`` and the load flags describe."""
    spec = load_spec_from_args(args)
    if args.format == VLLM_FORMAT:  # vLLM's own loader reads the checkpoint; a snapshot is read through ours
        return replace(vllm_source(Path(model_dir_from_args(args)).resolve(), spec), direct_io=args.direct_io)
    if args.format == SGLANG_FORMAT:  # likewise SGLang's
        return replace(sglang_source(Path(model_dir_from_args(args)).resolve(), spec), direct_io=args.direct_io)
    return pipeline_source(Path(model_dir_from_args(args)), spec, direct_io=args.direct_io)


def cmd_serve(args: argparse.Namespace) -> int:
    context = device_context(args.device)  # made while the checkpoint's headers are read, or a spare waits
    seed = seed_options(args)  # a bad flag or token file: one line now, not after the wait
    if args.start_fd is not None and wait_for_start(args.start_fd, args.ready_fd) is None:
        return 0
    source = _source(args)
    waiting = time.perf_counter()
    context.join()
    if source.device.type == "cuda":
        log.info("waited %.1f ms for the CUDA context after reading the checkpoint", ms(time.perf_counter() - waiting))
    paths = paths_for(args.socket, source.device, source.fingerprint.digest())
    uids = frozenset([os.getuid(), *args.allow_uid])
    backend = args.backend or default_backend_name(source.device)
    snapshot = Path(args.snapshot) if args.snapshot else None
    options = {"fill_from": args.fill_from, "snapshot": snapshot, "kv_retain_s": args.kv_retain_s, "seed": seed}
    serve(source, paths, backend=backend, allowed_uids=uids, **options)
    return 0


def retain_seconds(text: str) -> float:
    """``--kv-retain-s``: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, found {text!r}")
    return value


def fill_order(text: str) -> tuple[str, ...]:
    """``--fill-from``: a comma-separated, non-empty subset of FILL_SOURCES, in the order to try them."""
    order = tuple(part.strip() for part in text.split(","))
    unknown = [part for part in order if part not in FILL_SOURCES]
    if unknown or not order or len(set(order)) != len(order):
        raise argparse.ArgumentTypeError(f"expected distinct sources out of {','.join(FILL_SOURCES)}, found {text!r}")
    return order


def cmd_snapshot(args: argparse.Namespace) -> int:
    """Run the load pipeline into an arena and write it, with its manifest, to OUT."""
    source = _source(args)
    start = time.perf_counter()
    filled = load_arena(source, get_backend(args.backend or default_backend_name(source.device)))
    try:
        size = write_snapshot(Path(args.out), filled.manifest, filled.arena.tensor)
    finally:
        filled.arena.close()
    manifest = filled.manifest
    print(
        f"wrote {args.out}: {len(manifest['tensors'])} tensors, {size / 1e9:.3f} GB in "
        f"{time.perf_counter() - start:.1f} s; fingerprint {source.fingerprint.digest()}, "
        f"content hash {manifest['content_hash']}"
    )
    return 0


def _sockets(args: argparse.Namespace) -> list[Path]:
    """--socket, else the socket --model and the spec flags derive, else every socket in the runtime dir:
    stand-alone daemons' own and the links that daemons serving elsewhere (a running stack's) publish there
    (``paths.publish``)."""
    if args.socket:
        return [Path(args.socket)]
    private_dir(runtime_dir(), "runtime directory")
    if args.model:
        checkpoint = read_checkpoint(args.model, headers=False)
        spec = load_spec_from_args(args)
        digest = compute_fingerprint(checkpoint, spec).digest()
        return [paths_for(None, torch.device(spec.device), digest).socket]
    return sorted(runtime_dir().glob("*.sock"))


def _status(socket_path: Path) -> dict[str, Any]:
    reply = request(socket_path, {"op": "status"})
    if not reply.get("ok"):
        raise DaemonUnavailable(f"{socket_path}: {reply.get('message')}")
    return reply["status"]


def cmd_status(args: argparse.Namespace) -> int:
    """Every daemon's status; exit 1 when one named or found does not answer. A leftover found in the runtime
    dir (nothing listens, no daemon holds its lock: a killed daemon's, often another cluster's) is reported
    as stale and removed, and is no failure."""
    listing = not (args.socket or args.model)
    sockets = _sockets(args)
    if not sockets:
        raise ConfigError(f"no daemon sockets in {runtime_dir()}; pass --socket or --model")
    statuses, failures = [], 0
    for path in sockets:
        try:
            statuses.append(_status(path))
        except (DaemonUnavailable, AttachRefused) as exc:
            if listing and remove_if_stale(path):
                statuses.append({"socket": str(path), "stale": "nothing listens and no daemon holds its lock"})
                continue
            failures += 1
            statuses.append({"socket": str(path), "error": str(exc)})
    if args.json:
        print(json.dumps(statuses if len(statuses) > 1 else statuses[0], indent=2))
    else:
        for status in statuses:
            print(_format_status(status))
    return 1 if failures else 0


def _format_status(status: dict[str, Any]) -> str:
    if "error" in status:
        return f"{status['socket']}: DOWN ({status['error']})"
    if "stale" in status:
        return f"{status['socket']}: STALE, removed ({status['stale']})"
    fp = status["fingerprint"]
    attached = sum(1 for c in status["clients"] if c["attached"])
    lines = [
        f"{status['socket']}",
        f"  pid {status['pid']}, up {status['uptime_s']:.0f} s, backend {status['backend']} on {status['device']}",
        f"  model {fp['model_path']} (tp {fp['tp_rank']}/{fp['tp_size']}, {fp['dtype']}, quant {fp['quantization']})",
        f"  {status['tensors']} tensors, {status['bytes'] / 1e9:.3f} GB, content hash {status['content_hash']}",
        f"  fingerprint {status['fingerprint_digest']}, arena {status['arena_id']}",
        f"  clients: {len(status['clients'])} connected (this query included), {attached} attached",
    ]
    if seeding := status.get("seeding"):
        lines.append(f"  seeding peers on {seeding['listen']}: {seeding['clients']} of {seeding['max_clients']} now, "
                     f"{seeding['sessions']} served, {seeding['bytes_sent'] / 1e9:.3f} GB sent, "
                     f"{seeding['refused']} refused")  # fmt: skip
    deposits = status.get("kv_deposits", [])
    if deposits:
        kept = sum(not d["alive"] for d in deposits)
        size = sum(d["bytes"] for d in deposits) / 1e9
        lines.append(f"  KV caches deposited: {len(deposits)} ({kept} of failed or demoted engines), {size:.3f} GB")
    return "\n".join(lines)


def cmd_verify(args: argparse.Namespace) -> int:
    """Map the arena as an engine would (with every attach check) and recompute its content hash there."""
    sockets = _sockets(args)
    if len(sockets) != 1:
        raise ConfigError(f"verify needs exactly one daemon, found {len(sockets)}: pass --socket or --model")
    status = _status(sockets[0])
    try:
        fingerprint = Fingerprint.from_json(status.get("fingerprint"))
    except ValueError as exc:
        raise DaemonUnavailable(f"{sockets[0]}: the daemon's status has a bad fingerprint: {exc}") from None
    start = time.perf_counter()
    attachment = attach(sockets[0], fingerprint, status["device"], check_content=False)
    try:
        actual = attachment.verify()
    finally:
        attachment.close()
    expected = attachment.manifest["content_hash"]
    ok = actual == expected
    verdict = "OK" if ok else "MISMATCH"
    print(f"{verdict}: content hash {actual} (recorded at load {expected}) in {time.perf_counter() - start:.2f} s")
    return 0 if ok else 1


def _add_format_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        choices=("reference", VLLM_FORMAT, SGLANG_FORMAT),
        default="reference",
        help="whose processed layout the arena holds: hotweights' reference engine (default), vLLM's or SGLang's "
        "(runs that engine's loader; needs it in this Python; its engines use --load-format hotweights)",
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("cache", help="run and inspect weight cache daemons")
    commands = p.add_subparsers(dest="cache_command", required=True, metavar="COMMAND")

    serve_p = commands.add_parser(
        "serve",
        help="load a model once into one arena and serve it to engines",
        description="Run the load pipeline once into one arena and serve attach requests until SIGTERM.",
    )
    add_load_spec_arguments(serve_p)
    add_read_arguments(serve_p)
    serve_p.add_argument("--socket", help="socket path (default: derived from device identity and fingerprint)")
    serve_p.add_argument("--backend", choices=sorted(BACKENDS), help="default: cuda-vmm on CUDA, cpu-shm on CPU")
    _add_format_argument(serve_p)
    serve_p.add_argument(
        "--allow-uid", type=int, action="append", default=[], help="another uid allowed to attach (repeatable)"
    )
    serve_p.add_argument("--snapshot", help="a processed snapshot (hotweights cache snapshot) to fill the arena from")
    serve_p.add_argument(
        "--fill-from",
        type=fill_order,
        default=FILL_SOURCES,
        metavar="SOURCES",
        help="where to fill the arena from, first that passes its checks: readopt (the arena a live engine "
        "kept), peer (a daemon serving the same weights, --seed-from), snapshot (--snapshot), disk (the checkpoint) "
        f"(default: {','.join(FILL_SOURCES)})",
    )
    serve_p.add_argument(
        "--kv-retain-s",
        type=retain_seconds,
        default=KV_RETAIN_S,
        metavar="SECONDS",
        help="how long a failed engine's deposited KV cache is kept, once its connection closed, for the engine "
        "that continues its requests (0: dropped at once; a hung engine's is kept while it lives) "
        f"(default {KV_RETAIN_S:g})",
    )
    add_seed_arguments(serve_p)
    add_spare_arguments(serve_p, "reading the checkpoint and filling the arena")
    serve_p.set_defaults(func=cmd_serve)

    snapshot_p = commands.add_parser(
        "snapshot",
        help="write the processed arena (after TP split, fusion, quantization) to a file",
        description="Run the load pipeline once and write the processed arena, its manifest, fingerprint and "
        "content hash to OUT (atomically), for `hotweights cache serve --snapshot OUT`.",
    )
    add_load_spec_arguments(snapshot_p)
    add_read_arguments(snapshot_p)
    _add_format_argument(snapshot_p)
    snapshot_p.add_argument("--backend", choices=sorted(BACKENDS), help="default: cuda-vmm on CUDA, cpu-shm on CPU")
    snapshot_p.add_argument("out", metavar="OUT", help="the snapshot file to write")
    snapshot_p.set_defaults(func=cmd_snapshot)

    for name, func, text in (
        ("status", cmd_status, "show fingerprint, bytes, tensors, backend, pid, uptime, clients"),
        ("verify", cmd_verify, "map the arena and re-check its content hash"),
    ):
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("--socket", help="the daemon's socket (default: --model's, or every daemon found)")
        add_load_spec_arguments(sub)
        if name == "status":
            sub.add_argument("--json", action="store_true", help="machine-readable output")
        sub.set_defaults(func=func)
