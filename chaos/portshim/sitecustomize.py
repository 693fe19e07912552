"""Port shim: lets the drill put a fault proxy between an engine and everyone who talks to it.

The controller starts each engine on its slot's port and every client (health checks, gateway,
HAProxy) connects to that same port, so a proxy cannot sit in between. When the drill starts a stack
with slow-primary among its scenarios it puts this directory on ``PYTHONPATH`` and sets
``HOTWEIGHTS_CHAOS_BIND_MAP`` ("8200=41200,8201=41201"): Python imports this module at start-up in
every process of the stack, and a listening socket bound to a mapped port binds the private port
instead. The drill's proxy listens on the public port and forwards to the private one.
"""

import os
import socket

_PAIRS = [pair.split("=") for pair in os.environ.get("HOTWEIGHTS_CHAOS_BIND_MAP", "").split(",") if pair]
_MAP = {int(public): int(private) for public, private in _PAIRS}

if _MAP:
    _bind = socket.socket.bind

    def _mapped_bind(self: socket.socket, address: object) -> None:
        if isinstance(address, tuple) and len(address) >= 2 and address[1] in _MAP:
            address = (address[0], _MAP[address[1]], *address[2:])
        _bind(self, address)

    socket.socket.bind = _mapped_bind
