"""``python -m hotweights.standby.sglang_server ARGS``: SGLang's server (``python -m sglang.launch_server ARGS``), whose
scheduler and detokenizer processes are forked from the server's process, not spawned, when it runs on the CPU.

SGLang starts those two processes with multiprocessing's ``spawn`` start method, so that each imports torch,
transformers and SGLang again before it does any work. Forked, they inherit the server process's imports: on 2 CPU
cores a spare's server started beside a serving group was ready in 16.1 s, against 42.0 s spawned
(``docs/benchmarks.md``, SGLang). On any other device SGLang's ``spawn`` stays: a forked child cannot use a CUDA
context its parent made.

This runs in SGLang's Python (a group's ``engine_python``, where hotweights is installed for the loader,
``standby.sglang_loader``) and imports nothing else of hotweights.
"""

from __future__ import annotations

import multiprocessing
import runpy
import sys

SERVER_MODULE = "sglang.launch_server"


def device(argv: list[str]) -> str | None:
    """The ``--device`` that SGLang's arguments ``argv`` name (the last one, as argparse takes it); None: none."""
    named = None
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            named = argv[i + 1]
        elif arg.startswith("--device="):
            named = arg.partition("=")[2]
    return named


def fork_children() -> None:
    """Make multiprocessing's start method ``fork`` whatever SGLang sets (it sets ``spawn``, forced, at its start)."""
    set_start_method = multiprocessing.set_start_method

    def forking(method: str | None = None, force: bool = False) -> None:
        set_start_method("fork", force=True)

    multiprocessing.set_start_method = forking


def main(argv: list[str]) -> None:
    """Run SGLang's server with ``argv``, as ``python -m sglang.launch_server`` would."""
    if device(argv) == "cpu":
        fork_children()
    sys.argv = [SERVER_MODULE, *argv]
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
