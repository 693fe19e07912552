"""Where an engine's start went, for its ready line: seconds from its process's start to each step (``mark``), as
``breakdown`` gives them.

The process's start is the kernel's (/proc/self/stat, in clock ticks), so the interpreter's own start and the
imports count too: ``command`` is the start to the command's entry (interpreter, imports, flags), which an engine
forked by the launcher (``standby.launcher``) has done before it starts. The resolution is one clock tick (10 ms).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

MARKS: dict[str, float] = {}  # step -> seconds from the process's start to its end, in the order marked


def process_age_s() -> float:
    """Seconds since this process started."""
    stat = Path("/proc/self/stat").read_text()
    ticks = int(stat[stat.rindex(")") + 2 :].split()[19])
    return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")


def mark(step: str) -> None:
    """``step`` ended now."""
    MARKS[step] = process_age_s()


def breakdown() -> dict[str, float]:
    """Each step's seconds (from the end of the one marked before it, the first from the process's start) and
    ``total``, the process's age now."""
    steps, previous = {}, 0.0
    for step, at in MARKS.items():
        steps[step], previous = round(max(0.0, at - previous), 3), at
    return steps | {"total": round(process_age_s(), 3)}
