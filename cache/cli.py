"""``hotweights cache serve|status|verify``: run and inspect weight cache daemons."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from hotweights.cache.backends import BACKENDS, default_backend_name
from hotweights.cache.checkpoint import read_checkpoint
from hotweights.cache.client import AttachRefused, DaemonUnavailable, attach, request
from hotweights.cache.daemon import pipeline_source, serve
from hotweights.cache.fingerprint import Fingerprint, compute_fingerprint
from hotweights.cache.paths import paths_for
from hotweights.cache.pipeline import add_load_spec_arguments, load_spec_from_args, model_dir_from_args
from hotweights.cache.vllm_format import FORMATS, VLLM_FORMAT, vllm_source
from hotweights.errors import ConfigError
from hotweights.paths import runtime_dir


def cmd_serve(args: argparse.Namespace) -> int:
    spec = load_spec_from_args(args)
    if args.format == VLLM_FORMAT:
        source = vllm_source(Path(model_dir_from_args(args)).resolve(), spec)
    else:
        source = pipeline_source(read_checkpoint(model_dir_from_args(args)), spec)
    paths = paths_for(args.socket, source.device, source.fingerprint.digest())
    uids = frozenset([os.getuid(), *args.allow_uid])
    serve(source, paths, backend=args.backend or default_backend_name(source.device), allowed_uids=uids)
    return 0


def _sockets(args: argparse.Namespace) -> list[Path]:
    """--socket, else the socket --model and the spec flags derive, else every socket in the runtime dir:
    stand-alone daemons' own and the links that daemons serving elsewhere (a running stack's) publish there
    (``paths.publish``)."""
    if args.socket:
        return [Path(args.socket)]
    if args.model:
        checkpoint = read_checkpoint(args.model)
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
    sockets = _sockets(args)
    if not sockets:
        raise ConfigError(f"no daemon sockets in {runtime_dir()}; pass --socket or --model")
    statuses, failures = [], 0
    for path in sockets:
        try:
            statuses.append(_status(path))
        except (DaemonUnavailable, AttachRefused) as exc:
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
    fp = status["fingerprint"]
    attached = sum(1 for c in status["clients"] if c["attached"])
    lines = [
        f"{status['socket']}",
        f"  pid {status['pid']}, up {status['uptime_s']:.0f} s, backend {status['backend']} on {status['device']}",
        f"  model {fp['model_path']} (tp {fp['tp_rank']}/{fp['tp_size']}, {fp['dtype']}, quant {fp['quantization']})",
        f"  {status['tensors']} tensors, {status['bytes'] / 1e9:.3f} GB, content hash {status['content_hash']}",
        f"  fingerprint {status['fingerprint_digest']}",
        f"  clients: {len(status['clients'])} connected (this query included), {attached} attached",
    ]
    return "\n".join(lines)


def cmd_verify(args: argparse.Namespace) -> int:
    """Map the arena as an engine would (with every attach check) and recompute its SHA-256 there."""
    sockets = _sockets(args)
    if len(sockets) != 1:
        raise ConfigError(f"verify needs exactly one daemon, found {len(sockets)}: pass --socket or --model")
    status = _status(sockets[0])
    try:
        fingerprint = Fingerprint.from_json(status.get("fingerprint"))
    except ValueError as exc:
        raise DaemonUnavailable(f"{sockets[0]}: the daemon's status has a bad fingerprint: {exc}") from None
    start = time.perf_counter()
    attachment = attach(sockets[0], fingerprint, status["device"])
    try:
        actual = attachment.verify()
    finally:
        attachment.close()
    expected = attachment.manifest["content_hash"]
    ok = actual == expected
    verdict = "OK" if ok else "MISMATCH"
    print(f"{verdict}: content hash {actual} (recorded at load {expected}) in {time.perf_counter() - start:.2f} s")
    return 0 if ok else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("cache", help="run and inspect weight cache daemons")
    commands = p.add_subparsers(dest="cache_command", required=True, metavar="COMMAND")

    serve_p = commands.add_parser(
        "serve",
        help="load a model once into one arena and serve it to engines",
        description="Run the load pipeline once into one arena and serve attach requests until SIGTERM.",
    )
    add_load_spec_arguments(serve_p)
    serve_p.add_argument("--socket", help="socket path (default: derived from device identity and fingerprint)")
    serve_p.add_argument("--backend", choices=sorted(BACKENDS), help="default: cuda-vmm on CUDA, cpu-shm on CPU")
    serve_p.add_argument(
        "--format",
        choices=FORMATS,
        default="reference",
        help="whose processed layout the arena holds: hotweights' reference engine (default), or vLLM's "
        "(runs vLLM's loader; needs vLLM in this Python; engines use --load-format hotweights)",
    )
    serve_p.add_argument(
        "--allow-uid", type=int, action="append", default=[], help="another uid allowed to attach (repeatable)"
    )
    serve_p.set_defaults(func=cmd_serve)

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
