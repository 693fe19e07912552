"""The engine launcher's wire (``standby.launcher``), shared with the controller's side
(``controller.launcherclient``): what a request holds, how it is checked, what comes back. Torch-free.

One request per connection, in ``cache.protocol``'s frames (length-prefixed JSON, file descriptors by SCM_RIGHTS,
never pickle)::

    {"op": "launch", "argv": [...], "env": {...}, "fds": [N, ...]}  + fds: the log, then one per "fds" entry
    -> {"ok": true, "pid": P, "start_time": T} + the child's pidfd   the child runs; the connection stays open
    -> {"exit": CODE}                                                 once reaped (CODE as Popen's returncode:
                                                                      -N when signal N killed it), then EOF
    or {"ok": false, "error": "bad_message" | "refused", "message": "..."} and EOF.

The child gets the log as stdout and stderr, /dev/null as stdin, and each further fd under the number ``fds`` names
(a spare's ``--start-fd``/``--ready-fd``); ``argv`` must be this interpreter's ``hotweights engine`` command
(``ENGINE_COMMAND``), whose ``/proc/PID/cmdline`` the child then reads as (``TITLE_ROOM``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hotweights.spawn import hotweights_command

OP = "launch"
ENGINE_COMMAND = tuple(hotweights_command("engine"))  # what the launcher runs: this interpreter's engine command
# The bytes of a child's command line, NUL-terminated arguments: the launcher's own argument area is this large (it
# starts with a padding argument), and a child writes its argv there so that /proc shows it.
TITLE_ROOM = 8192
REPLY_TIMEOUT_S = 10.0  # a request's reply (the fork and the child's command line written): milliseconds when well


class BadRequest(ValueError):
    """A request the launcher does not run: the message names the field, what was expected and what was found."""


@dataclass(frozen=True)
class LaunchRequest:
    """What to run (``argv``, with ``env`` as its whole environment) and where the passed fds after the log land."""

    argv: tuple[str, ...]
    env: dict[str, str]
    fds: tuple[int, ...] = ()

    def message(self) -> dict[str, Any]:
        return {"op": OP, "argv": list(self.argv), "env": self.env, "fds": list(self.fds)}

    @classmethod
    def parse(cls, message: dict[str, Any], passed: int) -> LaunchRequest:
        """The request in ``message``, sent with ``passed`` fds; BadRequest naming the first field that is wrong."""
        if message.get("op") != OP:
            raise BadRequest(f"op must be {OP!r}, found {message.get('op')!r}")
        argv, env, fds = message.get("argv"), message.get("env"), message.get("fds")
        if not isinstance(argv, list) or not all(isinstance(arg, str) and "\0" not in arg for arg in argv):
            raise BadRequest(f"argv must be a list of strings without NUL, found {str(argv)[:120]}")
        if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise BadRequest(f"env must be an object of strings, found {str(env)[:120]}")
        if not isinstance(fds, list) or not all(type(fd) is int and fd > 2 for fd in fds) or len(set(fds)) < len(fds):
            raise BadRequest(f"fds must be a list of distinct fd numbers above 2, found {str(fds)[:120]}")
        if passed != 1 + len(fds):
            raise BadRequest(f"expected {1 + len(fds)} passed fds (the log, then one per fds entry), found {passed}")
        request = cls(tuple(argv), env, tuple(fds))
        request.check()
        return request

    def check(self) -> None:
        """BadRequest unless the launcher can run this: the engine command, a command line that fits ``TITLE_ROOM``."""
        if self.argv[: len(ENGINE_COMMAND)] != ENGINE_COMMAND:
            raise BadRequest(f"argv must start with {list(ENGINE_COMMAND)}, found {list(self.argv[:4])}")
        if (size := len(title_bytes(self.argv))) > TITLE_ROOM:
            raise BadRequest(f"argv must take at most {TITLE_ROOM} bytes, found {size}")


def title_bytes(argv: tuple[str, ...]) -> bytes:
    """``argv`` as ``/proc/PID/cmdline`` holds it: each argument NUL-terminated."""
    return b"".join(arg.encode(errors="surrogateescape") + b"\0" for arg in argv)
