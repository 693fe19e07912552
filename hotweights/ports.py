"""Free TCP ports on loopback, for tests, drills, benchmarks and the tensor-parallel rendezvous."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A port nothing listens on now (the kernel's pick; another process may take it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(count: int, consecutive: bool = False) -> list[int]:
    """``count`` ports that are free now (consecutive ones if asked: engine i gets base_port + i)."""
    if not consecutive:
        return [free_port() for _ in range(count)]
    for _ in range(100):
        base = free_port()
        if base + count < 65536 and all(is_free(base + i) for i in range(count)):
            return list(range(base, base + count))
    raise RuntimeError(f"no {count} consecutive free ports found")
