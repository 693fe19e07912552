"""The one percentile every report and benchmark uses, the one rounding of durations to milliseconds, and the one
way sizes in bytes are written for a reader."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in percent (an observed value, never an interpolation)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ms(seconds: float) -> float:
    """``seconds`` in milliseconds, to 0.1 ms: how events, reports and API answers give durations; a duration that
    rounds to zero is 0.0, never -0.0."""
    return round(seconds * 1000, 1) + 0.0


def whole_ms(milliseconds: float) -> str:
    """``milliseconds`` as a whole number, for a report's cell or a progress line: never "-0"."""
    return str(round(milliseconds))


def human_bytes(n: float) -> str:
    """``n`` bytes for a reader, in decimal units to one decimal: "3.4 MB", "4.4 TB"."""
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
