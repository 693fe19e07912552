"""Gray faults a drill injects into the reference engine's steps: slower steps, wrong tokens. By signal only.

An engine whose device throttles to a crawl, or whose memory goes bad, still answers every health check; what
changes is how long its steps take and what they compute. These faults make that happen on demand, for the drills
(``hotweights drill degrade-primary``, ``wrong-output``) and the benchmarks that measure how the controller notices
(``controller.graywatch``):

- ``SLOW_SIGNAL`` toggles a slowdown of SLOWDOWN times: after each decode step the inference thread sleeps
  SLOWDOWN - 1 times the step's own device time, inside the step (its device time, as ``standby.steptimes``
  counts it, and its duration, as ``standby.progress`` measures it, are SLOWDOWN times the real ones);
- ``WRONG_SIGNAL`` toggles wrong outputs: every row of logits a prefill or decode step returns is rotated by one
  token, so every greedy or sampled token is another one than the weights give.

Like the stall fault (``standby.progress.FREEZE_SIGNAL``), only a process allowed to signal the engine (its user,
or root) can inject them; no HTTP request can, so no client ever changes what another client's request computes.
The handlers only flip a flag; the inference thread reads it at each step and logs each change once.
"""

from __future__ import annotations

import logging
import signal
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the drills send these signals from processes without torch (chaos.grayscenarios)
    import torch

log = logging.getLogger(__name__)

SLOW_SIGNAL = signal.SIGUSR1  # toggles the slowdown
WRONG_SIGNAL = signal.SIGRTMIN  # toggles wrong outputs (a real-time signal: nothing sends it by itself)
SLOWDOWN = 20.0  # how many times its own duration a slowed step takes


class DrillFaults:
    """The flags the signals flip (``install``) and what the steps do with them; one per engine process."""

    def __init__(self) -> None:
        self.slow = False
        self.wrong = False
        self._told = (False, False)  # the flags as last logged

    def install(self) -> None:
        """Handle SLOW_SIGNAL and WRONG_SIGNAL in this process (the main thread, at start-up)."""
        signal.signal(SLOW_SIGNAL, lambda *_: self._flip_slow())
        signal.signal(WRONG_SIGNAL, lambda *_: self._flip_wrong())

    def _flip_slow(self) -> None:
        self.slow = not self.slow

    def _flip_wrong(self) -> None:
        self.wrong = not self.wrong

    def stepped(self, seconds: float) -> float:
        """After a decode step that took ``seconds`` of the device: sleep SLOWDOWN - 1 times as long while slowed;
        the seconds slept, which the step's device time counts (``standby.steptimes``)."""
        self._tell()
        delay = (SLOWDOWN - 1) * seconds if self.slow else 0.0
        if delay:
            time.sleep(delay)
        return delay

    def logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (rows, V) as the step returns them: rotated by one token while wrong."""
        self._tell()
        return logits.roll(1, dims=-1) if self.wrong else logits

    def greedy(self, tokens: list[int], vocab: int) -> list[int]:
        """The greedy tokens of rotated logits (``logits``) while wrong: each one the next id."""
        return [(token + 1) % vocab for token in tokens] if self.wrong else tokens

    def _tell(self) -> None:
        """Log a change of the flags, once, from the thread that steps (never from a signal handler)."""
        now = (self.slow, self.wrong)
        if now != self._told:
            self._told = now
            log.warning(
                "drill faults: steps %s, outputs %s",
                f"slowed {SLOWDOWN:g}x" if self.slow else "at full speed",
                "wrong (logits rotated by one token)" if self.wrong else "right",
            )
