"""The cluster CLI (``hotweights status``, ``switchover``, ``failover``, ``drain``, ``cache restart``): its pure
parts table by table, then every command against one real controller stack, run as the console script runs them
(``hotweights.cli.main``, in this process: real HTTP to a real controller) and ``status --watch`` as a process."""

from __future__ import annotations

import functools
import io
import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hotweights.cli import main
from hotweights.controller.clusterctl import (
    Exit,
    GroupStatus,
    confirm,
    exit_for,
    reason,
    render,
    respawn_outcome,
    summarize,
)
from hotweights.ports import free_port
from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV
from tests.controllerhelpers import ControllerStack

# --- pure parts ---------------------------------------------------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    ("status", "code"),
    [(200, Exit.DONE), (202, Exit.DONE), (400, Exit.REFUSED), (401, Exit.REFUSED), (404, Exit.REFUSED),
     (409, Exit.REFUSED), (412, Exit.REFUSED), (422, Exit.REFUSED), (503, Exit.FAILED)],
)  # fmt: skip
def test_each_answer_of_the_api_has_its_exit_status(status: int, code: Exit) -> None:
    assert exit_for(status) == code


@pytest.mark.unit
@pytest.mark.parametrize(
    ("body", "line"),
    [
        ({"detail": "no engine 'g0-e9'; known: g0-e0"}, "no engine 'g0-e9'; known: g0-e0"),
        ({"detail": [{"loc": ["body", "candidate"], "msg": "Field required"}]}, "body.candidate: Field required"),
        ({"detail": {"why": 1}}, '{"why": 1}'),
        ("plain text", "plain text"),
    ],
)
def test_the_apis_reason_comes_out_as_one_line(body: Any, line: str) -> None:
    assert reason(body) == line


@pytest.mark.unit
@pytest.mark.parametrize(
    ("answer", "yes"),
    [("y\n", True), ("YES\n", True), (" yes \n", True), ("n\n", False), ("\n", False), ("", False), ("yep\n", False)],
)
def test_only_y_or_yes_confirms_and_eof_is_a_no(monkeypatch: pytest.MonkeyPatch, answer: str, yes: bool) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(answer))
    assert confirm("do it?", assume_yes=False) is yes
    assert confirm("do it?", assume_yes=True)


def member(id: str, group: int, role: str, status: str = "healthy", failures: int = 0) -> dict[str, Any]:
    pool = {"block_tokens": 16, "blocks": 1024, "used": 40 if role == "primary" else 0, "running": 3, "waiting": 1}
    body = {"weight_cache": {"source": "cache"}, "kv_pool": pool if role == "primary" else None}
    return {
        "id": id, "group": group, "role": role, "state": "ready", "status": status, "pid": 100 + int(id[-1]),
        "url": f"http://127.0.0.1:820{id[-1]}", "consecutive_failures": failures, "generation": 0,
        "health": {"body": body},
    }  # fmt: skip


SERVICES = [
    {"id": "g0-cache", "kind": "daemon", "group": 0, "pid": 90, "serving": True, "restarting": False, "restarts": 1,
     "current": True},
    {"id": "gateway", "kind": "gateway", "group": None, "pid": 91, "serving": True, "restarting": False, "restarts": 0,
     "current": True},
]  # fmt: skip
REDUNDANCY = [
    {"group": 0, "standbys_wanted": 2, "standbys_ready": 1, "spares_wanted": 1, "spares_ready": 0, "full": False,
     "degraded": True, "degraded_s": 42.5, "reason": "g0-e2 failing (2 failed checks)", "alert": True},
]  # fmt: skip
CLUSTER: dict[str, Any] = {
    "name": "demo",
    "members": [
        member("g0-e0", 0, "primary"),
        member("g0-e1", 0, "standby"),
        member("g0-e2", 0, "standby", "failing", 2),
        member("g1-e3", 1, "primary"),
    ],
    "services": SERVICES,
    "redundancy": REDUNDANCY,
    "generations": [{"group": 0, "generation": 1, "model": "/models/new", "served": True}],
    "dcs": {"mode": "single-host"},
}
EVENTS = [
    {"seq": 3, "kind": "failover", "group": 0, "mode": "automatic", "old": "g0-e1", "new": "g0-e0",
     "total_ms": 61.2, "time": "T3"},
    {"seq": 2, "kind": "switchover", "group": 0, "old": "g0-e0", "new": "g0-e1", "total_ms": 120.0, "time": "T2"},
    {"seq": 4, "kind": "switchover", "group": 1, "old": "g1-e4", "new": "g1-e3", "total_ms": 99.0, "time": "T4"},
]  # fmt: skip


@pytest.mark.unit
def test_status_summarizes_each_group_from_the_cluster_and_its_events() -> None:
    zero, one = summarize(CLUSTER, EVENTS)
    assert isinstance(zero, GroupStatus) and (zero.group, one.group) == (0, 1)
    assert (zero.standbys_ready, zero.standbys_wanted, zero.spares_ready, zero.spares_wanted) == (1, 2, 0, 1)
    assert (zero.degraded_s, zero.alert, zero.generation, zero.model) == (42.5, True, 1, "new")
    assert zero.daemon == "g0-cache pid 90 serving, 1 restart"
    assert zero.last_failover is not None and (zero.last_failover.kind, zero.last_failover.total_ms) == (
        "automatic",
        61.2,
    )
    assert [e.health for e in zero.engines] == ["healthy", "healthy", "failing (2 failed)"]
    # no redundancy row yet (the controller's first cycle): shown, and said so
    assert (one.reason, one.standbys_wanted, one.daemon) == ("not assessed yet", 0, "none")
    assert one.last_failover is not None and one.last_failover.kind == "switchover"


@pytest.mark.unit
def test_status_renders_a_table_per_group() -> None:
    text = render(CLUSTER, summarize(CLUSTER, EVENTS), "http://127.0.0.1:8100")
    lines = text.splitlines()
    assert lines[0] == "cluster 'demo' (single-host), controller http://127.0.0.1:8100"
    assert "group 0  generation 1 (new)  standbys 1/2 ready  spares 0/1 ready  daemon g0-cache" in text
    assert "  ALERT: degraded for 42.5 s: g0-e2 failing (2 failed checks)" in lines
    assert "  last failover: automatic g0-e1 -> g0-e0 in 61.2 ms at T3" in lines
    header = next(line for line in lines if line.lstrip().startswith("ENGINE"))
    assert header.split() == ["ENGINE", "ROLE", "STATE", "HEALTH", "PID", "GEN", "WEIGHTS", "KV", "RUN", "WAIT", "URL"]
    row = next(line for line in lines if line.lstrip().startswith("g0-e2"))
    assert row.index("failing") == header.index("HEALTH")  # columns line up
    primary = next(line for line in lines if line.lstrip().startswith("g0-e0"))
    assert primary.split()[7:10] == ["40/1024", "3", "1"]  # its KV pool's blocks in use, sequences running, waiting
    assert row.split()[-4:-1] == ["-", "-", "-"]  # no pool reported
    assert "  not full yet: not assessed yet" in lines  # group 1


@pytest.mark.unit
@pytest.mark.parametrize(
    ("kinds", "done", "failure"),
    [
        ([], [], None),
        ([("respawn", "g0-cache")], ["g0-cache up"], None),
        ([("respawn", "g0-cache-r1")], [], None),  # a tensor-parallel group: every rank's daemon
        ([("respawn", "g0-cache-r1"), ("respawn", "g0-cache")], ["g0-cache up", "g0-cache-r1 up"], None),
        ([("start_failed", "g0-cache")], [], "g0-cache failed"),
        ([("respawn", "g1-cache")], [], None),
    ],
)
def test_a_cache_restart_is_done_once_every_restarted_daemon_respawned(
    kinds: list[tuple[str, str]], done: list[str], failure: str | None
) -> None:
    events = [{"kind": kind, "service": service, "message": f"{service} {'up' if kind == 'respawn' else 'failed'}"}
              for kind, service in kinds]  # fmt: skip
    services = ["g0-cache", "g0-cache-r1"] if any(s.endswith("-r1") for _, s in kinds) else ["g0-cache"]
    assert respawn_outcome(events, services) == (done, failure)


# --- bad input, and a controller that does not answer: one line, no traceback ---------------------------------------


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://256.1.1.1:8100", "Invalid IPv4 address: '256.1.1.1'"),
        ("http://127.0.0.1:99999", "Port out of range 0-65535"),
        ("localhost:8100", "not an http(s)://HOST:PORT URL"),
        ("ftp://127.0.0.1:8100", "not an http(s)://HOST:PORT URL"),
        ("http://127.0.0.1:8100/?group=0", "not an http(s)://HOST:PORT URL"),
    ],
)
@pytest.mark.parametrize("command", [["status"], ["switchover", "-y"], ["drain", "g0-e0", "-y"]])
def test_a_url_that_is_no_controllers_address_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: list[str], url: str, problem: str
) -> None:
    code, out, err = hotweights(capsys, monkeypatch, *command, "--url", url)
    expected = f"hotweights {command[0]}: error: --url {url!r}: {problem}; expected http(s)://HOST:PORT"
    assert (code, out) == (2, "") and len(err.splitlines()) == 1 and err.startswith(expected), err


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"", " is empty; put the bearer token in it, on one line"),
        (b" \n\n", " is empty; put the bearer token in it, on one line"),
        (b"first\nsecond\n", " holds 2 lines; a token file holds the token on one line"),
        (b"with space\n", ": the token holds byte 0x20 at offset 4; a bearer token is visible ASCII characters only"),
        ("t\u00f6ken".encode(), ": the token holds byte 0xc3 at offset 1; a bearer token is visible ASCII characters"),
        (None, ": cannot read it: Is a directory"),
    ],
)
def test_a_token_file_is_read_strictly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, content: bytes, problem: str
) -> None:
    """A token file is one line of visible ASCII (its final newline aside); anything else is named, never sent."""
    path = tmp_path / "token"
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    url = f"http://127.0.0.1:{free_port()}"
    code, out, err = hotweights(capsys, monkeypatch, "status", "--url", url, "--token-file", str(path))
    assert (code, out) == (2, "") and len(err.splitlines()) == 1, err
    assert err.startswith(f"hotweights status: error: --token-file {path}{problem}"), err


@pytest.mark.timeout(90)
def test_a_controller_that_never_answers_did_not_answer(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A listener whose queue is full (connections wait in SYN retries: an address that routes nowhere looks the
    same) or that never answers: exit 1 after the client's timeout, in one line."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        queued = [socket.socket() for _ in range(2)]
        for client in queued:
            client.setblocking(False)
            client.connect_ex(server.getsockname())
        url = f"http://127.0.0.1:{server.getsockname()[1]}"
        try:
            code, out, err = hotweights(capsys, monkeypatch, "status", "--url", url)
        finally:
            for client in queued:
                client.close()
    assert (code, out) == (1, "") and len(err.splitlines()) == 1, err
    assert "did not answer" in err and "Traceback" not in err


# --- against a real controller ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tiny_model: Path) -> Iterator[ControllerStack]:
    """One group of three engines under ``hotweights controller``, shared by the tests below (each leaves it steady)."""
    stack = ControllerStack(tiny_model, engines=3)
    try:
        stack.start_controller()
        stack.wait_steady()
        yield stack
    finally:
        stack.close()


def hotweights(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str, stdin: str = ""
) -> tuple[int, str, str]:
    """``hotweights ARGV`` as the console script runs it, with ``stdin``: (exit status, stdout, stderr)."""
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def standbys(stack: ControllerStack) -> list[str]:
    return sorted(m["id"] for m in stack.members().values() if m["role"] == "standby")


@pytest.mark.timeout(120)
def test_status_prints_each_engine_and_the_groups_redundancy(stack: ControllerStack, capsys, monkeypatch) -> None:
    config = str(stack.config_path)
    code, out, _ = hotweights(capsys, monkeypatch, "status", "--config", config)
    assert code == 0
    assert "standbys 2/2 ready" in out and "daemon g0-cache pid" in out
    assert {line.split()[0] for line in out.splitlines() if line.startswith("  g0-e")} == {"g0-e0", "g0-e1", "g0-e2"}
    code, out, _ = hotweights(capsys, monkeypatch, "status", "--config", config, "--json")
    (group,) = json.loads(out)["groups"]
    assert code == 0 and group["standbys_wanted"] == 2 and len(group["engines"]) == 3
    assert {e["weights"] for e in group["engines"]} == {"cache"}
    code, _, err = hotweights(capsys, monkeypatch, "status", "--config", config, "--group", "4")
    assert (code, err.strip()) == (2, "hotweights status: no group 4 in cluster 'test'")
    code, _, err = hotweights(capsys, monkeypatch, "status", "--url", f"http://127.0.0.1:{free_port()}")
    assert code == 1 and len(err.splitlines()) == 1 and "did not answer" in err and "is it running?" in err


@pytest.mark.timeout(120)
def test_a_switchover_asks_waits_and_says_what_it_did(stack: ControllerStack, capsys, monkeypatch) -> None:
    config = str(stack.config_path)
    old = stack.primary()["id"]
    code, out, err = hotweights(capsys, monkeypatch, "switchover", "--config", config)  # EOF: no
    assert (code, out) == (2, "") and "not confirmed; nothing done" in err and stack.primary()["id"] == old
    code, out, err = hotweights(capsys, monkeypatch, "switchover", "--config", config, stdin="y\n")
    assert f"switch over group 0 from {old} to the best ready standby? [y/N]" in err
    new = stack.primary()["id"]
    assert code == 0 and new != old and out.count("\n") == 1
    assert out.startswith(f"switched over group 0 from {old} to {new} in ")
    stack.wait_steady()
    code, out, _ = hotweights(capsys, monkeypatch, "status", "--config", config)
    assert f"last failover: switchover {old} -> {new} in " in out
    # the API's refusal, as its one line
    code, out, err = hotweights(capsys, monkeypatch, "switchover", "--config", config, "--candidate", "g0-e9", "-y")
    assert (code, out) == (2, "") and err.startswith("hotweights switchover: no engine 'g0-e9'; known: g0-e0")
    assert len(err.splitlines()) == 1


@pytest.mark.timeout(120)
def test_a_failover_needs_a_candidate_and_fences_the_primary(stack: ControllerStack, capsys, monkeypatch) -> None:
    config = str(stack.config_path)
    stack.wait_steady()
    old, ready = stack.primary(), standbys(stack)
    code, _, err = hotweights(capsys, monkeypatch, "failover", "--config", config, "--yes")
    assert code == 2 and f"ready standbys: {', '.join(ready)}" in err
    code, out, _ = hotweights(capsys, monkeypatch, "failover", "--config", config, "--candidate", ready[0], "--yes")
    assert code == 0 and f"promoted {ready[0]} in " in out and out.count("\n") == 1
    assert stack.primary()["id"] == ready[0]
    stack.wait_steady()  # the fenced slot is back as a standby
    assert stack.members()[old["id"]]["pid"] != old["pid"]


@pytest.mark.timeout(120)
def test_drain_and_a_wrong_token_answer_with_the_apis_reason(stack: ControllerStack, capsys, monkeypatch) -> None:
    config = str(stack.config_path)
    stack.wait_steady()
    primary, standby = stack.primary()["id"], standbys(stack)[0]
    code, _, err = hotweights(capsys, monkeypatch, "drain", standby, "--config", config, "--yes")
    assert code == 2 and err.startswith(f"hotweights drain: {standby} refused to drain")
    wrong = stack.root / "wrong-token"
    wrong.write_text("not-the-token\n")
    code, _, err = hotweights(
        capsys, monkeypatch, "drain", primary, "--url", stack.url, "--token-file", str(wrong), "--yes"
    )
    assert code == 2 and len(err.splitlines()) == 1 and "token" in err
    code, out, err = hotweights(capsys, monkeypatch, "drain", primary, "--config", config, "--timeout", "5", stdin="y")
    assert f"drain {primary} (primary of group 0)" in err
    assert code == 0 and out.startswith(f"drained {primary}")
    assert stack.client.post(f"/engines/{primary}/promote").status_code == 200  # resume it
    stack.wait_steady()


@pytest.mark.timeout(120)
def test_cache_restart_waits_until_the_new_daemon_serves(stack: ControllerStack, capsys, monkeypatch) -> None:
    config = str(stack.config_path)
    stack.wait_steady()
    old = stack.daemon()["pid"]
    code, out, _ = hotweights(capsys, monkeypatch, "cache", "restart", "0", "--config", config, "--yes")
    new = stack.daemon()
    assert code == 0 and new["serving"] and new["pid"] != old
    assert out.startswith(f"g0-cache (pid {new['pid']})") and "serving after" in out and out.count("\n") == 1
    code, out, err = hotweights(capsys, monkeypatch, "cache", "restart", "7", "--config", config, "--yes")
    assert (code, out) == (2, "") and err.startswith("hotweights cache restart: no group 7")


@pytest.mark.timeout(60)
def test_status_into_a_closed_pipe_ends_quietly(stack: ControllerStack) -> None:
    """``hotweights status | head -1``, its reader gone before the table is written: exit 141, nothing on stderr."""
    read, write = os.pipe()
    os.close(read)
    try:
        status = subprocess.run(
            hotweights_command("status", "--config", str(stack.config_path)), env=ENV, stdout=write,
            stderr=subprocess.PIPE, text=True, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write)
    assert (status.returncode, status.stderr) == (128 + signal.SIGPIPE, "")


@pytest.mark.timeout(60)
def test_status_watch_refreshes_until_ctrl_c(stack: ControllerStack) -> None:
    command = hotweights_command("status", "--config", str(stack.config_path), "--watch", "0.2")
    # SIGINT's default action in the child, as in a terminal, even when this runs in a shell's background (which
    # starts it with SIGINT ignored: Python then installs no KeyboardInterrupt for it).
    default_sigint = functools.partial(signal.signal, signal.SIGINT, signal.SIG_DFL)
    with subprocess.Popen(
        command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint
    ) as watch:
        try:
            assert watch.stdout is not None
            headings = 0
            while headings < 2:  # two refreshes
                line = watch.stdout.readline()
                assert line, watch.stderr.read() if watch.stderr else ""
                headings += line.startswith("cluster 'test'")
            watch.send_signal(signal.SIGINT)
            assert watch.wait(timeout=10) == 0
        finally:
            watch.kill()
