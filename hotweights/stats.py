"""The one percentile every report and benchmark uses, and the one rounding of durations to milliseconds."""

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
