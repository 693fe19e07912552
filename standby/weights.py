"""Binds processed tensors into a model built on ``meta``, without copying a byte.

The tensors may come from the in-process load pipeline or be views of the weight cache's shared
arena; either way the model's parameters become those very tensors, so a mapped arena is used
zero-copy. Anything that does not fit fails loudly, naming the tensor.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from hotweights.cache.backends import device_context
from hotweights.cache.checkpoint import Checkpoint, read_checkpoint
from hotweights.cache.client import Attachment, attach
from hotweights.cache.connection import AttachRefused, DaemonUnavailable
from hotweights.cache.fingerprint import Fingerprint, compute_fingerprint
from hotweights.cache.launcher import ensure_daemon
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.paths import paths_for
from hotweights.cache.pipeline import check_spec, load_processed, processed_config, processed_dtype
from hotweights.errors import BindingError, ConfigError, HotweightsError
from hotweights.layout import ModelConfig
from hotweights.standby.model import TensorParallel, Transformer

log = logging.getLogger(__name__)


def build_meta_model(config: ModelConfig, dtype: torch.dtype, tp: TensorParallel) -> Transformer:
    """The model with every parameter on ``meta``: shapes and dtypes, no memory."""
    with torch.device("meta"):
        return Transformer(config, dtype, tp)


def _slots(model: nn.Module) -> dict[str, tuple[nn.Module, str, torch.Tensor]]:
    """Every parameter and buffer as name -> (owning module, attribute, current tensor), in one walk."""
    slots = {}
    for prefix, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for leaf, tensor in table.items():
                if tensor is not None:
                    slots[f"{prefix}.{leaf}" if prefix else leaf] = (module, leaf, tensor)
    return slots


def expected_tensors(model: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every parameter and buffer the model needs bound."""
    return {name: (tuple(t.shape), t.dtype) for name, (_, _, t) in _slots(model).items()}


def bind(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Make ``tensors`` the model's parameters and buffers (assignment, not copy)."""
    slots = _slots(model)
    missing = sorted(slots.keys() - tensors.keys())
    if missing:
        raise BindingError(f"{len(missing)} tensor(s) missing for the model, first: {missing[0]!r}")
    unexpected = sorted(tensors.keys() - slots.keys())
    if unexpected:
        raise BindingError(f"{len(unexpected)} tensor(s) the model has no place for, first: {unexpected[0]!r}")
    for name, (module, leaf, placeholder) in slots.items():
        tensor = tensors[name]
        if tensor.shape != placeholder.shape or tensor.dtype != placeholder.dtype:
            raise BindingError(
                f"tensor {name!r}: model expects {list(placeholder.shape)} {placeholder.dtype}, "
                f"got {list(tensor.shape)} {tensor.dtype}"
            )
        if tensor.is_meta:
            raise BindingError(f"tensor {name!r} is on the meta device: it holds no data")
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        else:
            module._buffers[leaf] = tensor


def build_model(
    config: ModelConfig, dtype: torch.dtype, tp: TensorParallel, tensors: Mapping[str, torch.Tensor]
) -> Transformer:
    model = build_meta_model(config, dtype, tp)
    bind(model, tensors)
    return model


def load_from_disk(checkpoint: Checkpoint, spec: LoadSpec, group: object | None = None) -> Transformer:
    """The ``off`` weight-cache mode: run the load pipeline in this process and bind its output."""
    tensors = load_processed(checkpoint, spec)
    tp = TensorParallel(size=spec.tp_size, rank=spec.tp_rank, group=group)
    return build_model(processed_config(checkpoint, spec), processed_dtype(checkpoint, spec), tp, tensors)


WEIGHT_CACHE_MODES = ("off", "client", "daemon")
DAEMON_START_TIMEOUT_S = 600.0


@dataclass
class LoadedModel:
    """A bound model and where its weights came from; keeps a cache attachment alive."""

    model: Transformer
    checkpoint: Checkpoint
    fingerprint: Fingerprint
    mode: str  # the requested --weight-cache mode
    source: str  # "disk" or "cache"
    seconds: float  # wall time to load or attach and bind
    attachment: Attachment | None = None  # keeps the arena mapped while the model uses it


def add_weight_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine-side weight-cache flags, shared by every command that loads a model."""
    parser.add_argument(
        "--weight-cache",
        choices=WEIGHT_CACHE_MODES,
        default="off",
        help="off: load from disk in process; client: attach to a running cache daemon; "
        "daemon: start a detached daemon if none answers, then attach (default off)",
    )
    parser.add_argument("--socket", help="cache daemon socket (default: derived from device and fingerprint)")
    parser.add_argument(
        "--weight-cache-fallback",
        choices=("disk",),
        help="if the cache cannot be used, load from disk with a loud warning instead of failing",
    )
    parser.add_argument(
        "--weight-cache-timeout",
        type=float,
        default=DAEMON_START_TIMEOUT_S,
        help="seconds to wait for a daemon started by --weight-cache daemon to serve (default %(default).0f)",
    )


@dataclass
class Prepared:
    """The start of a load that needs no daemon and no weights: the CUDA context (being made on a thread), the
    checkpoint's headers, the fingerprint and, for one rank, the model's meta skeleton. A spare engine prepares
    before it is started; ``load_model`` then uses it only while no file of the checkpoint directory changed
    (path, inode, size, mtime and ctime of each), else reads the checkpoint again."""

    model_dir: Path
    spec: LoadSpec
    context: threading.Thread
    checkpoint: Checkpoint
    fingerprint: Fingerprint
    files: tuple[tuple[str, int, int, int, int], ...]
    meta: Transformer | None = None

    def still_valid(self, model_dir: str | Path, spec: LoadSpec) -> bool:
        return (
            Path(model_dir).resolve() == self.model_dir and spec == self.spec and _files(self.model_dir) == self.files
        )

    def build(self, tp: TensorParallel, tensors: Mapping[str, torch.Tensor]) -> Transformer:
        """The model bound to ``tensors``: on the prepared skeleton once, else built now."""
        model, self.meta = self.meta, None
        if model is None or tp.size != 1:
            config, dtype = processed_config(self.checkpoint, self.spec), processed_dtype(self.checkpoint, self.spec)
            return build_model(config, dtype, tp, tensors)
        bind(model, tensors)
        return model


def prepare(model_dir: str | Path, spec: LoadSpec, *, skeleton: bool = False) -> Prepared:
    """Start the CUDA context, read the checkpoint's headers and compute the fingerprint (ConfigError for a bad
    spec, as a load would); with ``skeleton`` (one rank), also build the model on ``meta``.

    Then every object made so far (the imports, the headers, the skeleton: ~200k of them) is frozen out of
    the cyclic garbage collector's sight (``gc.freeze``), so that no full collection over them (~0.1 s) falls
    inside the attach or the bind that follow; later collections look only at what is made after."""
    context = device_context(spec.device)  # made while the checkpoint's headers are read
    model_dir = Path(model_dir).resolve()
    files = _files(model_dir)
    checkpoint = read_checkpoint(model_dir)
    check_spec(checkpoint, spec)  # a bad --tp-size/--tp-rank is a ConfigError in every mode, not "no daemon"
    fingerprint = compute_fingerprint(checkpoint, spec)
    meta = None
    if skeleton and spec.tp_size == 1:
        config, dtype = processed_config(checkpoint, spec), processed_dtype(checkpoint, spec)
        meta = build_meta_model(config, dtype, TensorParallel(size=1, rank=0, group=None))
    gc.freeze()
    return Prepared(model_dir, spec, context, checkpoint, fingerprint, files, meta)


def _files(model_dir: Path) -> tuple[tuple[str, int, int, int, int], ...]:
    """Each regular file of ``model_dir``: its name, inode, size, mtime and ctime (ns)."""
    try:
        entries = sorted(os.scandir(model_dir), key=lambda e: e.name)
    except OSError:
        return ()
    stats = [(e.name, e.stat()) for e in entries if e.is_file()]
    return tuple((name, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns) for name, st in stats)


def load_model(
    model_dir: str | Path,
    spec: LoadSpec,
    *,
    weight_cache: str = "off",
    socket_path: str | None = None,
    fallback: str | None = None,
    group: object | None = None,
    daemon_timeout: float = DAEMON_START_TIMEOUT_S,
    prepared: Prepared | None = None,
) -> LoadedModel:
    """Load (``off``) or attach (``client``, ``daemon``) the weights for ``spec`` and bind them.

    ``client`` without a daemon, or with a daemon serving another fingerprint, raises
    DaemonUnavailable or AttachRefused (naming the differing fields), unless ``fallback="disk"``:
    then it loads from disk and logs a loud warning. ``prepared``: what a spare prepared (``Prepared``).
    """
    if weight_cache not in WEIGHT_CACHE_MODES:
        raise ConfigError(f"--weight-cache must be one of {list(WEIGHT_CACHE_MODES)}, found {weight_cache!r}")
    start = time.perf_counter()
    if prepared is not None and not prepared.still_valid(model_dir, spec):
        log.info("the checkpoint in %s changed since this spare read it: reading it again", model_dir)
        prepared = None
    ready = prepared or prepare(model_dir, spec, skeleton=weight_cache != "off")  # built while the context is made
    checkpoint, fingerprint = ready.checkpoint, ready.fingerprint
    if weight_cache != "off":
        paths = paths_for(socket_path, torch.device(spec.device), fingerprint.digest())
        try:
            if weight_cache == "daemon":
                ensure_daemon(checkpoint.path, spec, paths, timeout=daemon_timeout)
            headers = time.perf_counter()
            ready.context.join()
            waited = time.perf_counter() - headers
            attachment = attach(paths.socket, fingerprint, spec.device, offer_handover=True)
        except (DaemonUnavailable, AttachRefused) as exc:
            if fallback != "disk":
                raise _with_hint(exc, checkpoint, spec) from None
            log.warning("WEIGHT CACHE NOT USED, loading from disk (--weight-cache-fallback disk): %s", exc)
        else:
            model = ready.build(TensorParallel(size=spec.tp_size, rank=spec.tp_rank, group=group), attachment.tensors)
            seconds = time.perf_counter() - start
            log.info(
                "attached %d tensors from %s in %.1f ms (checkpoint headers %.1f, waiting for the CUDA context "
                "%.1f, attach %.1f, bind %.1f; attach: daemon's reply %.1f, map %.1f, content hash %.1f, offer %.1f)%s"
                "; content %s",
                len(attachment.tensors), paths.socket, seconds * 1e3, (headers - start) * 1e3, waited * 1e3,
                attachment.seconds * 1e3, (time.perf_counter() - headers - waited - attachment.seconds) * 1e3,
                attachment.parts["reply"], attachment.parts["map"], attachment.parts["digest"],
                attachment.parts["offer"],
                "; prepared before this spare was started" if prepared else "", attachment.content.value,
            )  # fmt: skip
            return LoadedModel(model, checkpoint, fingerprint, weight_cache, "cache", seconds, attachment)
    model = load_from_disk(checkpoint, spec, group)
    return LoadedModel(model, checkpoint, fingerprint, weight_cache, "disk", time.perf_counter() - start)


def _with_hint(exc: DaemonUnavailable | AttachRefused, checkpoint: Checkpoint, spec: LoadSpec) -> HotweightsError:
    if isinstance(exc, AttachRefused):
        return exc
    return DaemonUnavailable(
        f"{exc}. Start one with `hotweights cache serve --model {checkpoint.path} --device {spec.device}`, "
        "use --weight-cache daemon to start one automatically, or --weight-cache-fallback disk"
    )
