"""Process limits: the open-files limit a process raises at start, and the rate limit on repeated log lines.

A process that runs out of file descriptors fails every accept and every connect; each failure used to
log one line (with a traceback), so the log grew by megabytes a minute while nothing changed. Here a
command raises its soft ``RLIMIT_NOFILE`` to what it needs (children inherit it), refusing in one line
when even the hard limit is too low, and ``RepeatFilter`` lets an identical line through once per window
with the count of the ones it held back.
"""

from __future__ import annotations

import errno
import logging
import resource
import time
from collections import OrderedDict

from hotweights.errors import ConfigError

REPEAT_WINDOW_S = 10.0  # an identical log line passes once per window; the rest are counted
REPEAT_KEYS = 1024  # distinct lines remembered (the oldest are forgotten first)
OUT_OF_DESCRIPTORS = frozenset({errno.EMFILE, errno.ENFILE})
ACCEPT_BACKOFF_S = 0.1  # how long an accept loop waits after a failed accept (EMFILE...) before the next


def raise_open_files(needed: int, why: str, wanted: int = 0) -> int:
    """Raise the soft open-files limit to ``needed`` (never lower it), and on to ``wanted`` where the hard limit
    allows; return the soft limit now. ConfigError in one line, naming ``ulimit -n`` and ``needed``, when the
    hard limit is below ``needed``; ``why`` says what needs them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return soft
    if hard != resource.RLIM_INFINITY and hard < needed:  # and so is soft
        raise ConfigError(
            f"{why} needs {needed} open files, but the limit is {soft} (hard limit {hard}): "
            f"run `ulimit -n {needed}` (as root, or raise nofile in limits.conf) first"
        )
    target = max(needed, wanted if hard == resource.RLIM_INFINITY else min(wanted, hard))
    if soft >= target:
        return soft
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


def is_out_of_descriptors(exc: BaseException | None) -> bool:
    """Whether ``exc``, or an exception it was raised from, is this process running out of file
    descriptors (EMFILE, ENFILE): our own shortage, which says nothing about the peer."""
    seen = 0
    while exc is not None and seen < 16:  # wrappers (httpx, httpcore, anyio) chain the OSError
        if isinstance(exc, OSError) and exc.errno in OUT_OF_DESCRIPTORS:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class RepeatFilter(logging.Filter):
    """Passes a line (logger, level and rendered message) once per ``window_s``; the identical ones in
    between are dropped and counted, and the next one that passes says how many were."""

    def __init__(self, window_s: float = REPEAT_WINDOW_S, clock=time.monotonic) -> None:
        super().__init__()
        self.window_s = window_s
        self.clock = clock
        self.seen: OrderedDict[tuple[str, int, str], list[float | int]] = OrderedDict()  # key -> [passed_at, held]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, record.getMessage())
        now = self.clock()
        entry = self.seen.get(key)
        if entry is not None and now - entry[0] < self.window_s:
            entry[1] += 1
            return False
        if entry is not None and entry[1]:
            record.msg, record.args = f"{key[2]} ({entry[1]} identical lines held back in {self.window_s:g} s)", None
        self.seen[key] = [now, 0]
        self.seen.move_to_end(key)
        while len(self.seen) > REPEAT_KEYS:
            self.seen.popitem(last=False)
        return True
