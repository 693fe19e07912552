"""``hotweights agent-guard``: run an engine so that it cannot outlive the agent that started it.

The agent starts its engine through this small process (it imports nothing heavy, so it starts in
milliseconds). The engine runs in a process group of its own; the guard asks the kernel to signal it
when the agent dies (``PR_SET_PDEATHSIG``) and then kills that whole group at once, so no engine, and
none of the worker processes it forked, is left holding the port or the accelerator's memory.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess

PR_SET_PDEATHSIG = 1


def cmd_guard(args: argparse.Namespace) -> int:
    """Run the engine in a process group of its own; kill that group when the agent dies (SIGKILL at
    once: the agent's death is a fence) or asks us to stop (SIGTERM, then SIGKILL after the grace)."""
    command = args.engine_command[1:] if args.engine_command[:1] == ["--"] else args.engine_command
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGUSR1)
    if os.getppid() != args.parent:  # the agent died before the line above
        return 1
    os.nice(args.nice)  # the engine inherits it
    engine = subprocess.Popen(command, process_group=0)

    def kill_group(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(engine.pid, sig)

    signal.signal(signal.SIGUSR1, lambda *_: kill_group(signal.SIGKILL))
    signal.signal(signal.SIGALRM, lambda *_: kill_group(signal.SIGKILL))

    def terminate(*_: object) -> None:
        kill_group(signal.SIGTERM)
        signal.alarm(args.grace)

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    code = engine.wait()
    kill_group(signal.SIGKILL)  # whatever the engine left behind in its group
    return code if code >= 0 else 128 - code


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    g = subparsers.add_parser(
        "agent-guard",
        help="(started by the agent) run an engine and kill its process group when the agent dies",
        description="Run the command in its own process group; SIGTERM stops the group (SIGKILL after "
        "--grace s); the death of the parent (--parent) kills it at once.",
    )
    g.add_argument("--parent", type=int, required=True, help="the agent's pid")
    g.add_argument("--grace", type=int, default=10, help="seconds between SIGTERM and SIGKILL (default 10)")
    g.add_argument("--nice", type=int, default=0, help="run the command this much nicer (lower priority; default 0)")
    g.add_argument("engine_command", nargs=argparse.REMAINDER, help="-- the engine command")
    g.set_defaults(func=cmd_guard)
