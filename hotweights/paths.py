"""Where hotweights keeps things on this host: the home directory and the runtime directory."""

from __future__ import annotations

import os
from pathlib import Path


def hotweights_home() -> Path:
    """$HOTWEIGHTS_HOME, else ~/.cache/hotweights: generated models, clusters' state directories."""
    return Path(os.environ.get("HOTWEIGHTS_HOME") or Path.home() / ".cache" / "hotweights")


def runtime_dir() -> Path:
    """$HOTWEIGHTS_RUNTIME_DIR, else $XDG_RUNTIME_DIR/hotweights, else /tmp/hotweights-<uid>: daemon sockets."""
    explicit = os.environ.get("HOTWEIGHTS_RUNTIME_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return Path(xdg) / "hotweights" if xdg else Path(f"/tmp/hotweights-{os.getuid()}")
