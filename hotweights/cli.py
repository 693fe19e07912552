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

# Modules whose add_parser registers a subcommand, in the order --help lists them.
COMMANDS: tuple[str, ...] = (
    "hotweights.cache.makemodel",
    "hotweights.cache.cli",
    "hotweights.standby.generate",
    "hotweights.standby.engine",
    "hotweights.standby.agent",
    "hotweights.controller.gateway",
    "hotweights.controller.haproxy",
    "hotweights.controller.commands",
    "hotweights.chaos.drill",
    "hotweights.chaos.proxy",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hotweights",
        description="Weight cache daemon and hot-standby failover for LLM inference engines.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging on stderr")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        add_parser: Callable[[argparse._SubParsersAction], None] = import_module(module).add_parser
        add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except HotweightsError as exc:
        print(f"hotweights {args.command}: error: {exc}", file=sys.stderr)
        return 2

