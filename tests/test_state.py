"""``state.json``'s schema (hotweights/state.py), the event log's bound, and adoption's identity check."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from hotweights.controller.events import EventLog
from hotweights.controller.supervisor import open_pidfd, read_identity
from hotweights.state import (
    STATE_VERSION,
    ClusterState,
    GroupRecord,
    MemberRecord,
    ProcessRecord,
    ServiceRecord,
    StateCorrupt,
    StateVersionUnknown,
    read_state,
    write_state,
)
from tests.cachehelpers import wait_until

MEMBER = {"group": 0, "device": "cpu", "port": 8200, "role": "primary", "added": False, "process": None}


def test_round_trip_and_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    assert read_state(path) == ClusterState()
    state = ClusterState(
        cluster="c",
        controller=ProcessRecord(1, 2, ("python", "-m", "hotweights", "up")),
        members={"g0-e0": MemberRecord(0, "cpu", 8200, "primary", False, ProcessRecord(3, 4, ("x",)))},
        services={"g0-cache": ServiceRecord("daemon")},
        removed=("g0-e2",),
        groups={"0": GroupRecord(2, "/models/new", served=False)},
    )
    write_state(path, state)
    assert read_state(path) == state
    assert json.loads(path.read_text())["version"] == STATE_VERSION


def test_a_file_without_a_version_is_read_as_version_1(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text(json.dumps({"cluster": "c", "members": {"g0-e0": MEMBER}, "services": {}, "removed": []}))
    assert read_state(path).members["g0-e0"].role == "primary"


@pytest.mark.parametrize(
    ("document", "expected"),
    [
        ("{", "not JSON"),
        ("[]", "the document must be a JSON object, found list"),
        ('{"members": []}', "members must be a JSON object, found list"),
        ('{"members": {"g0-e0": {"group": "0"}}}', 'members.g0-e0.group must be a JSON integer, found "0"'),
        (json.dumps({"members": {"a": MEMBER | {"role": "boss"}}}), "members.a.role must be primary or standby"),
        (json.dumps({"members": {"a": MEMBER | {"port": True}}}), "members.a.port must be a JSON integer, found true"),
        ('{"controller": {"pid": 1, "start_time": 2}}', "controller.command must be a JSON array, found null"),
        ('{"services": {"gateway": {"kind": "proxy"}}}', "services.gateway.kind must be daemon or gateway"),
        ('{"removed": [1]}', "removed[] must be a JSON string, found 1"),
        ('{"groups": {"0": {"generation": 1, "model": "new"}}}', "groups.0.model must be an absolute checkpoint path"),
        ('{"groups": {"0": {"model": "/m"}}}', "groups.0.generation must be a JSON integer, found null"),
        (json.dumps({"members": {"a": MEMBER | {"generation": "1"}}}), "members.a.generation must be a JSON integer"),
    ],
)
def test_corrupt_files_are_named_in_one_line(tmp_path: Path, document: str, expected: str) -> None:
    path = tmp_path / "state.json"
    path.write_text(document)
    with pytest.raises(StateCorrupt) as caught:
        read_state(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: unreadable controller state") and expected in message
    assert "\n" not in message


def test_an_unknown_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text('{"version": 99, "members": {"future": "format"}}')
    with pytest.raises(StateVersionUnknown, match="controller state version 99, this hotweights reads version 1"):
        read_state(path)


def test_a_reused_pid_is_not_adopted() -> None:
    """After a reboot a recorded pid may belong to another program: same pid, other start time or command."""
    other = subprocess.Popen(["sleep", "30"])
    try:
        # Popen may return before the exec shows in /proc: wait for the command line we started
        identity = wait_until(lambda: (i := read_identity(other.pid)) and i.command == ("sleep", "30") and i, 10)
        for record in (
            ProcessRecord(other.pid, identity.start_time + 1, identity.command),
            ProcessRecord(other.pid, identity.start_time, ("python", "-m", "hotweights", "engine")),
        ):
            assert open_pidfd(record) is None
        opened = open_pidfd(identity)
        assert opened is not None and opened[1] == identity
        assert other.poll() is None  # looked at, never signalled
    finally:
        other.kill()
        other.wait()


def test_the_event_log_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events = EventLog(path, max_bytes=2000)
    for i in range(200):
        events.record("detect", f"event {i}", member="g0-e0")
    rotated = path.with_name("events.jsonl.1")
    kept = rotated.read_text() + (path.read_text() if path.exists() else "")
    messages = [json.loads(line)["message"] for line in kept.splitlines()]
    assert messages[-1] == "event 199" and len(messages) < 200  # the oldest went with an earlier rotation
    assert rotated.stat().st_size < 2000 + 200 and len(kept) < 2 * (2000 + 200)
