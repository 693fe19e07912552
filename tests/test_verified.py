"""An arena's content hash is verified once per serving daemon and host, then remembered (``cache.verified``).

Real daemons (a process, or a thread of this test when the test needs to see its arena) and the real engine-side
``attach``; the refusals of bytes that are not the manifest's are in tests/test_cache_trust.py.
"""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from hotweights.cache.verified import FOLDER, ServedArena, VerifiedArenas, is_stale, process_start, record_daemon
from hotweights.paths import runtime_dir
from tests.cachehelpers import ProcessDaemon, ThreadDaemon, fingerprint_of

if TYPE_CHECKING:
    from hotweights.cache.client import Attachment

ARENA = ServedArena("boot", 41, 9000, "a" * 32, '{"dev": 1, "ino": 7}', 4096)
HASH = "0123456789abcdef" * 4


@pytest.fixture
def sock() -> Path:
    return runtime_dir() / "d.sock"


def records() -> list[str]:
    return sorted(os.listdir(runtime_dir() / FOLDER))


def attached(sock: Path, model: Path) -> Attachment:
    """Attach as an engine does, and let go of the mapping at once (what matters here is how it was checked)."""
    from hotweights.cache.client import attach

    attachment = attach(sock, fingerprint_of(model), "cpu")
    attachment.close()
    return attachment


@pytest.mark.unit
@pytest.mark.parametrize(
    ("name", "start_of", "stale"),
    [
        ("41-9000-abc", {41: 9000}, False),  # its daemon runs
        ("41-9000-abc", {41: 9001}, True),  # the pid is another process now
        ("41-9000-abc", {41: None}, True),  # no such process
        (".77.41-9000-abc", {41: 9000}, False),  # being written, for a running daemon
        (".77.41-9000-abc", {41: None}, True),  # left by a writer, for a daemon that stopped
        ("notes.txt", {}, True),  # not a record
        ("41-x-abc", {41: 9000}, True),
    ],
)
def test_which_files_are_stale(name: str, start_of: dict[int, int | None], stale: bool) -> None:
    assert is_stale(name, start_of) is stale


@pytest.mark.unit
def test_a_record_is_named_by_its_daemon_and_every_field() -> None:
    assert record_daemon(ARENA.record_name()) == (41, 9000)
    changed = [dataclasses.replace(ARENA, **{f.name: "x" if f.type == "str" else 1}) for f in dataclasses.fields(ARENA)]
    assert len({a.record_name() for a in [ARENA, *changed]}) == len(changed) + 1


def test_a_record_vouches_only_for_its_hash_in_a_private_folder(tmp_path: Path) -> None:
    folder = tmp_path / "verified"
    store = VerifiedArenas(folder)
    here = dataclasses.replace(ARENA, daemon_pid=os.getpid(), daemon_start=process_start(os.getpid()))
    assert not store.vouches(here, HASH)
    store.remember(here, HASH)
    assert store.vouches(here, HASH) and not store.vouches(here, "f" * 64)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder / here.record_name()).stat().st_mode) == 0o600
    folder.chmod(0o777)  # anyone could have planted it
    assert not store.vouches(here, HASH)


def test_the_first_attach_hashes_and_later_ones_remember(tiny_model: Path, sock: Path) -> None:
    from hotweights.cache.client import ContentCheck  # the client imports torch: on first use only

    with ProcessDaemon(tiny_model, sock):
        first, second = attached(sock, tiny_model), attached(sock, tiny_model)
    assert (first.content, second.content) == (ContentCheck.HASHED, ContentCheck.REMEMBERED)
    assert len(records()) == 1


def test_a_new_daemon_is_hashed_again_and_a_stopped_ones_record_removed(tiny_model: Path, sock: Path) -> None:
    """A record names the daemon process: one started later (same model, same bytes) is checked again, and
    the record of the one that stopped goes when the new one's is written."""
    from hotweights.cache.client import ContentCheck  # the client imports torch: on first use only

    with ProcessDaemon(tiny_model, sock):
        assert attached(sock, tiny_model).content is ContentCheck.HASHED
        before = records()
    with ProcessDaemon(tiny_model, sock):
        assert attached(sock, tiny_model).content is ContentCheck.HASHED
        after = records()
    assert len(before) == len(after) == 1 and before != after


def test_a_record_does_not_vouch_for_other_bytes_of_the_same_daemon(tiny_model: Path, sock: Path) -> None:
    """A daemon that serves a second arena (another fill in the same process, here a second daemon thread)
    gets it hashed: the record names the memory and the arena, not only the process."""
    from hotweights.cache.client import ContentCheck  # the client imports torch: on first use only

    with ThreadDaemon(tiny_model, sock):
        assert attached(sock, tiny_model).content is ContentCheck.HASHED
    with ThreadDaemon(tiny_model, sock):
        assert attached(sock, tiny_model).content is ContentCheck.HASHED
        assert attached(sock, tiny_model).content is ContentCheck.REMEMBERED
    assert len(records()) == 2
