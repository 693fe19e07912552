"""A state dir that fails (a full disk) never stops a failover nor loses an event; ``down`` stops every process of a
stack whatever its state.json says; the sockets of dead engines are removed.

The full disk is a small tmpfs mounted on the stack's state dir (root only, as CI runs; the test is skipped, naming
why, where the kernel refuses the mount).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hotweights.cache.paths import OFFER_SUFFIX, offer_pid
from hotweights.controller.events import MAX_BYTES, EventLog, append_lines
from hotweights.controller.metrics import ControllerMetrics
from hotweights.controller.statedir import RETRY_S, StateDirHealth, StateWriter
from hotweights.controller.supervisor import (
    STACK_ENV,
    controller_holding,
    read_identity,
    stack_marker,
    stack_orphans,
    stop_leftovers,
)
from hotweights.eventkinds import EventKind
from hotweights.state import ClusterState, read_state, write_state
from tests.cachehelpers import ENV, wait_until
from tests.controllerhelpers import ControllerStack

FAILOVERS = 5


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` on ``path`` (owner-only) for the block, unmounted after it."""
    if os.geteuid() != 0:
        pytest.skip("a full state disk is a tmpfs mounted on the state dir, which needs root")
    path.mkdir(parents=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], capture_output=True, text=True
    )
    if mount.returncode != 0:
        pytest.skip(f"the kernel refused a tmpfs for the state dir: {mount.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "--lazy", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Write a file into ``directory`` until its filesystem takes no byte more; return it."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as out:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while True:
                    out.write(b"\0" * size)
    probe = directory / "probe"
    with pytest.raises(OSError) as full:
        probe.write_bytes(b"x" * 4096)
    probe.unlink()
    assert full.value.errno == errno.ENOSPC
    return filler


def leftovers(stack: ControllerStack) -> list[tuple[str, int]]:
    """Every live process of the stack, found as ``down`` finds them (environment or command line)."""
    found = stack_orphans(stack_marker(stack.config.state_dir), [str(stack.config.state_dir)])
    return [(name, identity.pid) for name, identity in found]


# --- the writers, against a path that takes no writes ----------------------------------------------------


def failing_state_dir(tmp_path: Path) -> tuple[StateDirHealth, ControllerMetrics]:
    metrics = ControllerMetrics()
    return StateDirHealth(tmp_path, metrics), metrics


def sample(metrics: ControllerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "pid"),
    [
        ("8ee524e85cdebfb3.7477-0.handover", 7477),
        ("8ee524e85cdebfb3.12-3.handover", 12),
        ("g0.sock", None),
        ("8ee524e85cdebfb3.x-0.handover", None),
        ("8ee524e85cdebfb3.7477-0.handover.tmp", None),
    ],
)
def test_an_offers_name_gives_its_engines_pid(name: str, pid: int | None) -> None:
    assert offer_pid(Path("/run") / name) == pid


@pytest.mark.unit
def test_events_wait_in_memory_in_order_until_the_file_takes_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """events.jsonl cannot be opened (a directory is in the way): every event waits, one warning says so, the
    gauge and counters tell; once it can, the next record appends them all, in order, with their own times."""
    caplog.set_level(logging.INFO, "hotweights.controller.statedir")
    health, metrics = failing_state_dir(tmp_path)
    path = tmp_path / "events.jsonl"
    path.mkdir()
    events = EventLog(path, health=health)
    for n in range(5):
        events.record("detect", f"event {n}")
    assert health.is_failing and len(events.held) == 5
    assert sample(metrics, "hotweights_controller_state_dir_failing") == 1
    assert sample(metrics, "hotweights_controller_events_held") == 5
    assert sample(metrics, "hotweights_controller_state_dir_write_failures_total", file="events.jsonl") == 5
    path.rmdir()
    events.record("fence", "event 5")
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["seq"] for e in written] == [1, 2, 3, 4, 5, 6] and written[0]["message"] == "event 0"
    assert not health.is_failing and sample(metrics, "hotweights_controller_state_dir_failing") == 0
    assert sample(metrics, "hotweights_controller_events_held") == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "hotweights.controller.statedir"]
    assert len(lines) == 2 and lines[0].startswith(f"cannot write {path}") and "takes writes again" in lines[1]


@pytest.mark.unit
def test_beyond_the_bound_the_oldest_events_are_dropped_and_named_in_one_line(tmp_path: Path) -> None:
    health, metrics = failing_state_dir(tmp_path)
    path = tmp_path / "events.jsonl"
    path.mkdir()
    events = EventLog(path, max_held=3, health=health)
    for n in range(6):
        events.record("detect", f"event {n}")
    assert [seq for seq, _ in events.held] == [4, 5, 6] and events.lost == (1, 3)
    assert sample(metrics, "hotweights_controller_events_dropped_total") == 3
    path.rmdir()
    assert events.flush()
    lost, *kept = [json.loads(line) for line in path.read_text().splitlines()]
    assert (
        lost["kind"] == EventKind.EVENTS_LOST
        and (lost["first_seq"], lost["last_seq"]) == (1, 3)
        and "3 events" in lost["message"]
    )
    assert [e["seq"] for e in kept] == [4, 5, 6]
    assert [e["seq"] for e in events.recent(10)] == [1, 2, 3, 4, 5, 6]  # GET /events still has them all


@pytest.mark.unit
def test_the_state_is_kept_and_the_latest_written_by_the_retry(tmp_path: Path) -> None:
    """write_state fails (its temp file's name is a directory): state.json keeps the old state, the writer
    keeps the newest one, and the retry (no further save) writes it once the way is clear."""
    health, metrics = failing_state_dir(tmp_path)
    path = tmp_path / "state.json"
    writer = StateWriter(path, health)
    writer.save(ClusterState(cluster="old"))
    path.with_suffix(".json.tmp").mkdir()

    async def run() -> None:
        writer.save(ClusterState(cluster="newer"))
        writer.save(ClusterState(cluster="newest"))
        assert health.retry is not None and read_state(path).cluster == "old"
        path.with_suffix(".json.tmp").rmdir()
        while health.is_failing:
            await asyncio.sleep(0.05)

    asyncio.run(asyncio.wait_for(run(), 10 * RETRY_S))
    assert read_state(path).cluster == "newest" and writer.pending is None
    assert sample(metrics, "hotweights_controller_state_dir_write_failures_total", file="state.json") == 2


def test_writes_to_a_full_or_read_only_filesystem_fail_whole(tmp_path: Path) -> None:
    """On a full disk a write_state fails leaving the old file and no temp file; an append that wrote part of
    its lines (the last page had room) is cut back; the same on a read-only remount; both work again after."""
    with small_filesystem(tmp_path / "state", "1m") as state_dir:
        path, events = state_dir / "state.json", state_dir / "events.jsonl"
        write_state(path, ClusterState(cluster="old"))
        append_lines(events, ['{"seq": 1}'], MAX_BYTES)
        before = events.read_bytes()
        filler = fill(state_dir)
        with pytest.raises(OSError) as full:
            write_state(path, ClusterState(cluster="new"))
        assert full.value.errno == errno.ENOSPC and read_state(path).cluster == "old"
        assert sorted(p.name for p in state_dir.iterdir()) == ["events.jsonl", "filler", "state.json"]
        with pytest.raises(OSError):
            append_lines(events, ['{"pad": "' + "x" * 10_000 + '"}'], MAX_BYTES)
        assert events.read_bytes() == before
        filler.unlink()
        subprocess.run(["mount", "-o", "remount,ro", str(state_dir)], check=True)
        for write in (lambda: write_state(path, ClusterState(cluster="new")), lambda: append_lines(events, ["{}"], 99)):
            with pytest.raises(OSError) as refused:
                write()
            assert refused.value.errno == errno.EROFS
        subprocess.run(["mount", "-o", "remount,rw", str(state_dir)], check=True)
        write_state(path, ClusterState(cluster="new"))
        append_lines(events, ['{"seq": 2}'], MAX_BYTES)
        assert read_state(path).cluster == "new" and events.read_text().splitlines() == ['{"seq": 1}', '{"seq": 2}']


# --- finding a stack's processes --------------------------------------------------------------------------


SLEEP = """
import subprocess, sys, time
if "child" in sys.argv:  # one that inherits our environment
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
time.sleep(600)
"""


def sleeper(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A process that sleeps until killed; with the argument ``child``, a child of it too."""
    return subprocess.Popen([sys.executable, "-c", SLEEP, *args], env=ENV | (env or {}), start_new_session=True)


def test_a_stacks_processes_are_found_by_their_environment_and_no_other(tmp_path: Path) -> None:
    """``stack_orphans`` finds a process started with the stack's marker and its child (which inherited it), not
    one of another stack nor one that merely names the state dir; ``stop_leftovers`` stops the parent first and
    then the child, and leaves the others running."""
    state_dir = tmp_path / "state"
    marker = stack_marker(state_dir)
    ours = sleeper("child", env={STACK_ENV: marker})
    theirs = sleeper(env={STACK_ENV: stack_marker(tmp_path / "other")})
    naming = sleeper(str(state_dir / "run" / "g0.sock"))
    try:
        found = wait_until(lambda: len(f := stack_orphans(marker, [str(state_dir)])) == 2 and f, 30, "ours and child")
        assert ours.pid in {identity.pid for _, identity in found}
        lines = stop_leftovers(marker, [str(state_dir)], timeout=5)
        assert len(lines) == 2 and f"(pid {ours.pid}) stopped" in lines[0], lines  # the parent first
        assert stack_orphans(marker, [str(state_dir)]) == []
        assert ours.wait(timeout=10) is not None and theirs.poll() is None and naming.poll() is None
    finally:
        for process in (ours, theirs, naming):
            process.kill()
            process.wait()


HOLD_LOCK = """
import sys, time
from pathlib import Path
from hotweights.pidlock import PidLock
PidLock(Path(sys.argv[1])).acquire()
print("held", flush=True)
time.sleep(600)
"""


def test_the_controller_is_found_by_the_lock_it_holds(tmp_path: Path) -> None:
    """``down`` finds a live controller that state.json does not name by its lock: the pid in the lock file,
    while a live process holds the lock; not once it died (the file remains), nor a live pid that holds none."""
    lock = tmp_path / "controller.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(lock)], env=ENV, stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert holder.stdout.readline() == b"held\n"
        assert controller_holding(lock) == read_identity(holder.pid)
        holder.kill()
        holder.wait()
        assert controller_holding(lock) is None  # the file still names it; nobody holds the lock
        lock.write_text(f"{os.getpid()}\n")
        assert controller_holding(lock) is None  # a live pid in the file, but the lock is not held
    finally:
        holder.kill()
        holder.wait()


# --- whole stacks ------------------------------------------------------------------------------------------


def kill_primary(stack: ControllerStack) -> dict:
    """SIGKILL the primary and wait for the failover that replaces it; the failover event."""
    old = stack.primary()
    failovers = len(stack.events("failover"))
    os.kill(old["pid"], signal.SIGKILL)
    wait_until(lambda: len(stack.events("failover")) > failovers, 60, "the failover", interval=0.05)
    new = stack.primary()
    assert new["id"] != old["id"]
    stack.wait_steady()
    return stack.events("failover")[-1]


def file_events(state_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (state_dir / "events.jsonl").read_text().splitlines()]


@pytest.mark.timeout(600)
def test_a_full_state_disk_during_failovers_loses_nothing_and_down_stops_everything(tiny_model: Path) -> None:
    """The state dir's disk fills up under a serving stack, then its primary is SIGKILLed five times: every
    failover succeeds (with a replacement standby each time), one warning says the state dir fails, the gauge is
    1. Once the disk frees, every event is in events.jsonl (in order, none dropped), state.json names the live
    engines and their roles, no temp file is left, one line says so and the gauge is 0. With the disk full again,
    ``down`` stops every process and removes every socket."""
    with contextlib.ExitStack() as cleanup:  # stop the stack, then unmount, then remove its directory
        stack = ControllerStack(tiny_model)
        cleanup.callback(shutil.rmtree, stack.root, ignore_errors=True)
        state_dir = cleanup.enter_context(small_filesystem(stack.config.state_dir, "64m"))
        cleanup.callback(stack.close)
        stack.start_controller("up")
        stack.wait_up(120)
        stack.wait_steady()
        filler = fill(state_dir)
        for _ in range(FAILOVERS):
            kill_primary(stack)
        metrics = httpx.get(f"{stack.url}/metrics").text
        assert re.search(r"^hotweights_controller_state_dir_failing 1\.0", metrics, re.MULTILINE), metrics
        in_memory = stack.client.get("/events", params={"limit": 1000}).json()["events"]
        filler.unlink()
        wait_until(
            lambda: {e["seq"] for e in file_events(state_dir) if "seq" in e} >= {e["seq"] for e in in_memory},
            30,
            "every event in events.jsonl",
        )
        written = file_events(state_dir)
        assert [e["seq"] for e in written] == list(
            range(1, len(written) + 1)
        )  # in order, none lost (no events_lost line)
        assert len([e for e in written if e["kind"] == "failover"]) == FAILOVERS
        members = stack.members()
        wait_until(
            lambda: (
                {n: (r.process.pid, r.role) for n, r in read_state(stack.config.state_file).members.items()}
                == {n: (m["pid"], m["role"]) for n, m in members.items()}
            ),
            30,
            "state.json naming the live engines and roles",
        )
        assert not (state_dir / "state.json.tmp").exists()
        log = stack.logs(10**8)
        assert "report it as a BUG" not in log and "Traceback" not in log, log
        assert log.count("cannot write") == 1, log
        assert "takes writes again" in log
        metrics = httpx.get(f"{stack.url}/metrics").text
        assert re.search(r"^hotweights_controller_state_dir_failing 0\.0", metrics, re.MULTILINE), metrics
        fill(state_dir)  # and full again for the stop
        stopped = stack.down()
        assert stopped.returncode == 0 and "Traceback" not in stopped.stderr, stopped.stderr
        assert stack.controller.wait(timeout=60) == 0
        assert leftovers(stack) == []
        assert list((state_dir / "run").glob("*.sock")) + list((state_dir / "run").glob("*.handover")) == []


def handover_offers(stack: ControllerStack) -> dict[int, Path]:
    """The re-adoption offers in the stack's socket directory, by the pid of the engine that made each."""
    return {offer_pid(path): path for path in (stack.config.state_dir / "run").glob(f"*{OFFER_SUFFIX}")}


def kill_one(stack: ControllerStack, role: str) -> int:
    """SIGKILL an engine of ``role`` (which has an offer) and wait for its slot's replacement; its pid."""
    victim = next(m for m in stack.wait_steady().values() if m["role"] == role)
    assert victim["pid"] in handover_offers(stack)
    os.kill(victim["pid"], signal.SIGKILL)
    wait_until(lambda: stack.members()[victim["id"]]["pid"] not in (None, victim["pid"]), 60, "a replacement")
    return victim["pid"]


@pytest.mark.timeout(300)
def test_dead_engines_sockets_are_removed_and_a_clean_stop_removes_all(tiny_model: Path, own_world: Path) -> None:
    """Each killed engine's re-adoption offer is removed once the controller has seen it exit (the primary's, a
    standby's); Ctrl-C of ``up`` leaves no socket in the state dir nor a link to one in the runtime dir."""
    stack = ControllerStack(tiny_model)
    try:
        stack.start_controller("up")
        stack.wait_up(120)
        for role in ("primary", "standby", "primary", "standby"):
            pid = kill_one(stack, role)
            wait_until(lambda pid=pid: pid not in handover_offers(stack), 30, f"pid {pid}'s offer removed")
        stack.wait_steady()
        live = {m["pid"] for m in stack.members().values()} | {s["pid"] for s in stack.cluster()["spares"]}
        assert set(handover_offers(stack)) <= live
        assert list((own_world / "run").glob("*.sock")), "the daemon published no link: a weaker test"
        stack.controller.send_signal(signal.SIGINT)
        assert stack.controller.wait(timeout=90) == 0, stack.logs()
        assert [p.name for p in (stack.config.state_dir / "run").iterdir() if p.is_socket()] == []
        assert list((own_world / "run").glob("*.sock")) == []
    finally:
        stack.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("records", ["stale", "missing"])
def test_down_after_up_was_killed_stops_every_process_whatever_state_json_says(tiny_model: Path, records: str) -> None:
    """SIGKILL of the ``up`` process alone (its children live on) right after a failover, while a new spare warms
    up; state.json is then stale (from before the failover: it names the dead primary, not the replacement) or
    missing. ``down`` stops every process of the stack all the same, spare included, and leaves alone a process of
    another stack and one that merely names the state dir."""
    stack = ControllerStack(tiny_model)
    other = stack.root / "other"
    strangers = [
        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(600)", *args],
            env=ENV | extra,
            start_new_session=True,
        )
        for args, extra in (((), {STACK_ENV: str(other)}), ((str(stack.config.state_dir / "run" / "g0.sock"),), {}))
    ]
    try:
        stack.start_controller("up")
        stack.wait_up(120)
        stack.wait_steady()
        wait_until(lambda: [s for s in stack.cluster()["spares"] if s["ready"]], 60, "a ready spare")
        before = stack.config.state_file.read_bytes()
        old = stack.primary()
        os.kill(old["pid"], signal.SIGKILL)
        warming = wait_until(
            lambda: [s["pid"] for s in stack.cluster()["spares"] if s["pid"] and not s["ready"]], 60, "a new spare"
        )
        replacement = stack.members()[old["id"]]["pid"]
        stack.kill_controller()
        if records == "stale":
            stack.config.state_file.write_bytes(before)
        else:
            stack.config.state_file.unlink()
        running = [pid for _, pid in leftovers(stack)]
        assert replacement in running
        # The warming spare is found, or already gone by itself: its start pipe closed with the controller, which
        # ends a spare once its warm-up is done (``controller.spares``), a race with this scan.
        assert [pid for pid in warming if pid not in running and read_identity(pid)] == []
        stopped = stack.down()
        assert stopped.returncode == 0, stopped.stderr
        assert leftovers(stack) == [], stopped.stderr
        assert [pid for pid in {*running, *warming} if read_identity(pid)] == []
        assert all(stranger.poll() is None for stranger in strangers)
        assert [p.name for p in (stack.config.state_dir / "run").iterdir() if p.is_socket()] == []
    finally:
        for stranger in strangers:
            stranger.kill()
            stranger.wait()
        stack.close()
