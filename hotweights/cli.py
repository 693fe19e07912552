"""The ``hotweights`` console script: one subcommand per job.

Each subcommand lives beside the code it drives and registers itself through an
``add_parser(subparsers)`` function that sets ``func``; this module only wires them together.

Every command ends in one of these ways, never with a traceback:

- its own exit status (0 done; what else, each command's ``--help`` says);
- 2 with one line ``hotweights COMMAND: error: ...`` on stderr: bad input (a ``HotweightsError``);
- 130 on Ctrl-C (SIGINT), quietly; ``up`` and ``controller`` act on SIGINT and SIGTERM themselves, from their
  first instant (``RECORDS_SIGNALS``);
- 141 (128 + SIGPIPE, as a shell reports a command killed by it), quietly, when the reader of its stdout went
  away (``hotweights status | head -1``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Callable
from importlib import import_module

from hotweights.errors import HotweightsError
from hotweights.limits import RepeatFilter

# Subcommand -> the module whose add_parser registers it, in the order --help lists them. Only the chosen
# subcommand's module is imported, so a light one (agent-guard, down) starts without torch.
COMMANDS: dict[str, str] = {
    "make-model": "hotweights.cache.makemodel",
    "cache": "hotweights.cache.cli",
    "generate": "hotweights.standby.generate",
    "engine": "hotweights.standby.engine",
    "agent": "hotweights.standby.agent",
    "agent-guard": "hotweights.guard",
    "gateway": "hotweights.gateway.server",
    "haproxy-config": "hotweights.controller.haproxy",
    "controller": "hotweights.controller.commands",
    "up": "hotweights.controller.commands",
    "down": "hotweights.controller.commands",
    "rollout": "hotweights.controller.commands",
    "status": "hotweights.controller.clusterctl",
    "switchover": "hotweights.controller.clusterctl",
    "failover": "hotweights.controller.clusterctl",
    "drain": "hotweights.controller.clusterctl",
    "drill": "hotweights.chaos.drill",
    "drill-proxy": "hotweights.chaos.proxy",
}

# Subcommands a higher layer adds under a lower layer's command (the cache layer cannot import the controller):
# command -> (module, the function that adds them to that command's subparsers). The module is imported only when
# the chosen subcommand is not the lower layer's own: ``cache serve`` starts without the controller's imports.
NESTED: dict[str, tuple[str, str]] = {"cache": ("hotweights.controller.clusterctl", "add_cache_parser")}

# Commands that act on SIGINT and SIGTERM themselves (they stop what they started): both are recorded from the first
# instant, before the command's module is imported (seconds, on a busy host), and the list is handed to the command
# as ``args.signals``; it takes the handlers over (``controller.commands.ShutdownFlags``).
RECORDS_SIGNALS = frozenset({"up", "controller"})
CLOSED_PIPE = 128 + signal.SIGPIPE  # the exit status when the reader of stdout went away


def nested_subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def build_parser(command: str | None = None, subcommand: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand, or only ``command``'s module's when it names one (and ``NESTED``'s unless
    ``subcommand`` is one of that command's own)."""
    parser = argparse.ArgumentParser(
        prog="hotweights",
        description="Weight cache daemon and hot-standby failover for LLM inference engines.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    modules = [COMMANDS[command]] if command in COMMANDS else COMMANDS.values()
    for module in dict.fromkeys(modules):
        add_parser: Callable[[argparse._SubParsersAction], None] = import_module(module).add_parser
        add_parser(subparsers)
    for name, (module, function) in NESTED.items():
        if name in subparsers.choices:
            nested = nested_subparsers(subparsers.choices[name])
            if command != name or subcommand not in nested.choices:
                getattr(import_module(module), function)(nested)
    return parser


def record_signals() -> list[int]:
    """SIGINT and SIGTERM appended to the returned list from now on, instead of their default actions."""
    received: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda sig, _frame: received.append(sig))
    return received


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status (the module docstring lists them)."""
    argv = sys.argv[1:] if argv is None else argv
    chosen, subcommand = [*(arg for arg in argv if not arg.startswith("-")), None, None][:2]
    received = record_signals() if chosen in RECORDS_SIGNALS else None
    try:
        args = build_parser(chosen, subcommand).parse_args(argv)
        if received is not None:
            args.signals = received
        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.INFO,
            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
            stream=sys.stderr,
        )
        for handler in logging.getLogger().handlers:  # a failure that repeats (EMFILE on accept) must not flood
            handler.addFilter(RepeatFilter())
        try:
            return int(args.func(args) or 0)
        except HotweightsError as exc:
            print(f"hotweights {args.command}: error: {exc}", file=sys.stderr)
            return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # Python flushes stdout once more at exit: into the void, or it reports the closed pipe on stderr.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return CLOSED_PIPE
