"""Free TCP ports on loopback, for tests, drills, benchmarks and the tensor-parallel rendezvous.

Ports are picked below the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), so that no
outgoing connection of any process can take one between the pick and the bind that uses it, and none is handed
out twice by one process.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000  # below this lie the ports that services are configured on
_handed_out: set[int] = set()


def _pick_range() -> range:
    """Ports outside the ephemeral range: below its start, or above its end when that leaves more."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    below, above = range(LOWEST, max(LOWEST, low)), range(high + 1, 65536)
    return below if len(below) >= len(above) else above


def is_free(port: int) -> bool:
    """Whether nothing is bound to ``port`` on loopback now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, consecutive: bool = False) -> list[int]:
    """``count`` ports that are free now, never handed out before by this process (consecutive ones if asked:
    engine i gets base_port + i)."""
    ports = _pick_range()
    for _ in range(1000):
        if consecutive:
            base = random.choice(ports[: len(ports) - count + 1])
            picked = list(range(base, base + count))
        else:
            picked = random.sample(ports, count)
        if not _handed_out.intersection(picked) and all(is_free(port) for port in picked):
            _handed_out.update(picked)
            return picked
    raise RuntimeError(f"no {count} free ports found in {ports.start}-{ports.stop - 1}")


def free_port() -> int:
    """A port nothing listens on now (another process may still take it later)."""
    return free_ports(1)[0]
