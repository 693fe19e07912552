"""The ``hotweights`` console script: one subcommand per job.

Each subcommand lives beside the code it drives and registers itself through an
``add_parser(subparsers)`` function that sets ``func``; this module only wires them together.
"""

from __future__ import annotations

import argparse
import logging
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
    "gateway": "hotweights.controller.gatewayserver",
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen, subcommand = [*(arg for arg in argv if not arg.startswith("-")), None, None][:2]
    args = build_parser(chosen, subcommand).parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for handler in logging.getLogger().handlers:  # a failure that repeats (EMFILE on accept) must not flood the log
        handler.addFilter(RepeatFilter())
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except HotweightsError as exc:
        print(f"hotweights {args.command}: error: {exc}", file=sys.stderr)
        return 2
