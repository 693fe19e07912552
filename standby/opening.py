"""What an engine's first seconds of serving cost, told in one log line: after a promotion the new primary is sent
every request the failed one held at once (the gateway's re-sends and continuations, ``gateway.migration``) on a
device that other engines may be warming up on, and that burst is what a failover costs its clients beyond
detection. ``Opening`` counts, over the OPENING_S after the KV cache is attached, what the inference thread did: its
prefills (rows, time), the continuations it adopted from a deposited KV cache (``standby.kvshare``: time, the
mapping of a deposit included) and those it could not (why: they are computed again), its decode steps (rows, time),
when the first request reached the server's handler (``received``, once parsed and validated) and when the inference
thread was handed it (``arrived``), and the first token. Its decode steps and prefills come from the times
``standby.progress.ProgressClock`` takes of them anyway, the rest from the scheduler, all on the inference thread
(``arrived`` from any thread: one float)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

OPENING_S = 2.0  # the first seconds of serving that the line sums up


@dataclass
class Opening:
    """The first OPENING_S of serving, from ``began`` (monotonic seconds); None: not counting (every record is
    dropped), as before the first promotion and once the line is out."""

    began: float | None = None
    first_received: float | None = None
    first_arrival: float | None = None
    first_token: float | None = None
    prefills: list[tuple[int, float]] = field(default_factory=list)  # (rows, seconds)
    adoptions: list[float] = field(default_factory=list)  # seconds each
    unadopted: Counter[str] = field(default_factory=Counter)  # continuations computed again, by why
    steps: list[tuple[int, float]] = field(default_factory=list)  # (rows, seconds)

    def received(self, now: float) -> None:
        if self.began is not None and self.first_received is None:
            self.first_received = now

    def arrived(self, now: float) -> None:
        if self.began is not None and self.first_arrival is None:
            self.first_arrival = now

    def emitted(self, now: float) -> None:
        if self.began is not None and self.first_token is None:
            self.first_token = now

    def prefilled(self, rows: int, seconds: float) -> None:
        if self.began is not None:
            self.prefills.append((rows, seconds))

    def adopted(self, seconds: float) -> None:
        if self.began is not None:
            self.adoptions.append(seconds)

    def not_adopted(self, why: str) -> None:
        if self.began is not None:
            self.unadopted[why] += 1

    def stepped(self, rows: int, seconds: float) -> None:
        if self.began is not None:
            self.steps.append((rows, seconds))

    def ended(self, now: float) -> str | None:
        """The line (``line``) once OPENING_S has passed, and from then on nothing is counted; else None."""
        if self.began is None or now - self.began < OPENING_S:
            return None
        line = self.line()
        self.began = None
        return line

    def line(self) -> str:
        """The summary: idle when nothing arrived, else every count and time (ms) named."""
        if self.first_arrival is None or self.began is None:
            return f"first {OPENING_S:g} s of serving: no request"
        parts = [f"first request {self._after(self.first_arrival)} ms after the start"]
        if self.first_received is not None:
            parts[0] += f" (at the server {self._after(self.first_received)} ms)"
        if self.first_token is not None:
            parts.append(f"first token {self._after(self.first_token)} ms")
        if self.prefills:
            parts.append(
                f"{len(self.prefills)} prefill(s) of {sum(r for r, _ in self.prefills)} prompt(s) in "
                f"{_ms(sum(s for _, s in self.prefills))} ms (longest {_ms(max(s for _, s in self.prefills))})"
            )
        if self.adoptions:
            parts.append(
                f"{len(self.adoptions)} continuation(s) adopted in {_ms(sum(self.adoptions))} ms "
                f"(longest {_ms(max(self.adoptions))})"
            )
        if self.unadopted:
            whys = ", ".join(f"{why}: {n}" for why, n in self.unadopted.items())
            parts.append(f"{self.unadopted.total()} continuation(s) not adopted ({whys})")
        if self.steps:
            seconds = sorted(s for _, s in self.steps)
            rows = [r for r, _ in self.steps]
            parts.append(
                f"{len(self.steps)} decode step(s) of {min(rows)}-{max(rows)} rows: median "
                f"{_ms(seconds[len(seconds) // 2])} ms, longest {_ms(seconds[-1])}, {_ms(sum(seconds))} ms in all"
            )
        return f"first {OPENING_S:g} s of serving: " + "; ".join(parts)

    def _after(self, at: float) -> int:
        assert self.began is not None
        return round((at - self.began) * 1000)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"
