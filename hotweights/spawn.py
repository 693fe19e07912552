"""The one way a hotweights process starts another: ``[sys.executable, "-m", "hotweights", ...]``.

Children run this interpreter's installed package, never whatever ``cache/`` or ``controller/``
folder happens to lie in the current directory, and nothing sets or extends ``PYTHONPATH``.
"""

from __future__ import annotations

import sys


def hotweights_command(*args: str, python: str | None = None) -> list[str]:
    """The argv that runs ``hotweights ARGS...`` with this interpreter, or with ``python`` (another
    environment that has hotweights installed, e.g. vLLM's)."""
    return [python or sys.executable, "-m", "hotweights", *args]
