"""Where hotweights keeps things on this host: the home directory (the embedded tiny model in it) and the runtime
directory; and how a small JSON file there is replaced whole (``write_json``)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from hotweights.errors import ConfigError

DEFAULT_MODEL_NAME = "tiny-bf16-seed0"  # the embedded tiny model's directory under hotweights_home()/models
INDEX_FILE = "model.safetensors.index.json"  # a sharded Hugging Face checkpoint's index


def hotweights_home() -> Path:
    """$HOTWEIGHTS_HOME, else ~/.cache/hotweights: generated models, clusters' state directories."""
    return Path(os.environ.get("HOTWEIGHTS_HOME") or Path.home() / ".cache" / "hotweights")


def default_model_dir() -> Path:
    """Where the embedded tiny model is made on first use (``cache.makemodel.ensure_default_model``)."""
    return hotweights_home() / "models" / DEFAULT_MODEL_NAME


def made_default_model() -> Path | None:
    """The embedded tiny model's directory once made, else None. A checkpoint is renamed into place whole, its
    index with it, so the index says it is there."""
    path = default_model_dir()
    return path if (path / INDEX_FILE).exists() else None


def write_json(path: Path, value: object) -> None:
    """``value`` as JSON in ``path``, whole or not at all: written to a temp file of this process's beside it, then
    renamed over it; OSError when that fails, with no temp file left behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(value))
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def runtime_dir() -> Path:
    """$HOTWEIGHTS_RUNTIME_DIR, else $XDG_RUNTIME_DIR/hotweights, else /tmp/hotweights-<uid>: daemon sockets."""
    explicit = os.environ.get("HOTWEIGHTS_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "hotweights" if xdg else Path(f"/tmp/hotweights-{os.getuid()}")


def private_dir(path: Path, what: str) -> Path:
    """``path``, created owner-only (0700) if missing; ConfigError in one line if another user owns it or
    others can write to it (they could replace what hotweights keeps there: sockets, pid records, state).
    An existing directory is never chmod'ed; ``what`` names it in the refusal ("runtime directory")."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.getuid():
        raise ConfigError(
            f"{what} {path} is owned by uid {info.st_uid}, not by us ({os.getuid()}): use a directory of ours"
        )
    if mode & 0o022:
        raise ConfigError(
            f"{what} {path} is writable by others (mode {mode:o}): chmod go-w it or use one only we can write"
        )
    return path
