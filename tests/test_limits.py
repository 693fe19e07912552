"""Process limits: the open-files limit `up` needs, descriptor shortage told apart, repeated log lines held back."""

from __future__ import annotations

import errno
import logging
import resource
import subprocess
import sys

import httpx
import pytest

from hotweights.limits import RepeatFilter, is_out_of_descriptors
from hotweights.spawn import hotweights_command
from tests.controllerhelpers import ControllerStack


def _chained(outer: BaseException, inner: BaseException) -> BaseException:
    try:
        try:
            raise inner
        except BaseException as exc:
            raise outer from exc
    except BaseException as raised:
        return raised


@pytest.mark.unit
@pytest.mark.parametrize(
    ("exc", "ours"),
    [
        (OSError(errno.EMFILE, "Too many open files"), True),
        (OSError(errno.ENFILE, "Too many open files in system"), True),
        (_chained(httpx.ConnectError("connect failed"), OSError(errno.EMFILE, "Too many open files")), True),
        (_chained(httpx.ConnectError("connect failed"), ConnectionRefusedError(errno.ECONNREFUSED, "refused")), False),
        (httpx.ReadTimeout("timed out"), False),
        (OSError(errno.ECONNRESET, "reset"), False),
        (None, False),
    ],
)
def test_out_of_descriptors_is_ours_not_the_peers(exc: BaseException | None, ours: bool) -> None:
    assert is_out_of_descriptors(exc) is ours


def _record(message: str, *args: object, name: str = "x") -> logging.LogRecord:
    return logging.LogRecord(name, logging.ERROR, __file__, 1, message, args, None)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("lines", "passed"),
    [
        # (time, logger, message) -> the messages that pass, as they are written
        ([(0, "x", "accept failed"), (1, "x", "accept failed"), (2, "x", "accept failed")], ["accept failed"]),
        (
            [(0, "x", "accept failed"), (1, "x", "accept failed"), (11, "x", "accept failed")],
            ["accept failed", "accept failed (1 identical lines held back in 10 s)"],
        ),
        ([(0, "x", "a"), (1, "x", "b"), (2, "y", "a")], ["a", "b", "a"]),
        ([(0, "x", "a"), (10, "x", "a")], ["a", "a"]),
    ],
)
def test_identical_log_lines_pass_once_per_window(lines: list[tuple[float, str, str]], passed: list[str]) -> None:
    now = [0.0]
    repeat = RepeatFilter(window_s=10.0, clock=lambda: now[0])
    out = []
    for at, name, message in lines:
        now[0] = at
        record = _record(message, name=name)
        if repeat.filter(record):
            out.append(record.getMessage())
    assert out == passed


def test_up_refuses_an_open_files_limit_below_its_needs_in_one_line(tiny_model) -> None:
    """Under `ulimit -n 64`, `up` used to start and then fail accepts and fail over: now it refuses at once."""
    stack = ControllerStack(tiny_model, engines=2)
    try:
        needed = stack.config.open_files_needed()
        result = subprocess.run(
            hotweights_command("up", "--config", str(stack.config_path)),
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64)),
        )
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
        assert f"needs {needed} open files, but the limit is 64" in result.stderr
        assert f"`ulimit -n {needed}`" in result.stderr
        assert not stack.config.state_file.exists(), "nothing may start"
    finally:
        stack.close()


def test_the_soft_limit_is_raised_to_what_is_needed_within_the_hard_limit() -> None:
    """In a child (the limit is per process): soft 64, hard 4096, 1000 needed -> soft 1000; never lowered."""
    script = (
        "import resource; from hotweights.limits import raise_open_files; "
        "print(raise_open_files(1000, 'x'), raise_open_files(100, 'x'), *resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (64, 4096)),
    )
    assert result.stdout.split() == ["1000", "1000", "1000", "4096"], result.stderr
