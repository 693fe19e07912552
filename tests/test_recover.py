"""Recovery after a daemon's death: re-adoption from a live engine, processed snapshots, and their refusals.

Real daemons (threads of this process or ``hotweights cache serve`` processes), real engines (tests/attach_worker.py),
real memfds, real Unix sockets. A re-adopting daemon is proven not to read the checkpoint by corrupting the
checkpoint's weight bytes (size and mtime kept, so the fingerprint stays) before it starts: the text engines
generate afterwards is still the text of the original weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import mmap
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from bench.recover import evict, resident_bytes
from hotweights.cache.backends import get_backend
from hotweights.cache.backends.base import BackendUnavailable
from hotweights.cache.backends.cpu_shm import ARENA_SEALS
from hotweights.cache.checkpoint import read_checkpoint
from hotweights.cache.connection import request
from hotweights.cache.daemon import load_arena, pipeline_source
from hotweights.cache.fingerprint import compute_fingerprint
from hotweights.cache.handover import HandoverOffer, offer_path
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.paths import DaemonPaths
from hotweights.cache.recovery import SourceRefused, SourceSkipped, readopt
from hotweights.cache.snapshot import LENGTH, MAGIC, load_snapshot, write_snapshot
from hotweights.contract import Endpoint
from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV, Engine, ProcessDaemon, ThreadDaemon, fingerprint_of, wait_until
from tests.conftest import make_checkpoint
from tests.controllerhelpers import ControllerStack
from tests.enginehelpers import SpareEngine, reference_completer


@pytest.fixture
def sock(own_world: Path) -> Path:
    return own_world / "d" / "cache.sock"


@pytest.fixture
def model(own_world: Path, tiny_model: Path) -> Path:
    """A private copy of the tiny model (mtimes kept): tests corrupt its weights."""
    return Path(shutil.copytree(tiny_model, own_world / "model"))


def corrupt_weights(model: Path) -> None:
    """Overwrite the tail of every shard (tensor data, past the header) keeping size and mtime: the fingerprint
    stays the same, and any load from the checkpoint now produces other weights."""
    for shard in sorted(model.glob("*.safetensors")):
        info = shard.stat()
        with open(shard, "r+b") as out:
            out.seek(info.st_size // 2)
            out.write(bytes(info.st_size - info.st_size // 2))
        os.utime(shard, ns=(info.st_atime_ns, info.st_mtime_ns))


def status(socket_path: Path) -> dict:
    return request(socket_path, {"op": "status"})["status"]


def test_readopted_daemon_serves_the_same_arena_without_the_checkpoint(model: Path, sock: Path) -> None:
    with ProcessDaemon(model, sock) as first, Engine(model, sock) as engine:
        before = engine.ask("generate")["tokens"]
        assert status(sock)["fill"]["source"] == "disk"
        first.kill()
        corrupt_weights(model)
        shards = sorted(model.glob("*.safetensors"))
        evict(shards)
        assert resident_bytes(shards) == 0, "the shards could not be evicted from the page cache"
        with ProcessDaemon(model, sock) as second:
            # Not a byte of the checkpoint, its headers included: a read would have brought its pages back. (The
            # daemon's own read_bytes also counts its imports, which a loaded machine may have to read again.)
            assert resident_bytes(shards) == 0
            fill = status(sock)["fill"]
            assert fill["source"] == "readopt", fill
            assert "verified by identity" in fill["detail"] and f"pid {engine.process.pid}" in fill["detail"]
            assert fill["disk_read_bytes"] == 0
            with Engine(model, sock) as newcomer:
                assert newcomer.hello["source"] == "cache"
                assert newcomer.ask("generate")["tokens"] == before
            assert engine.ask("generate")["tokens"] == before
            second.kill()


def clients(socket_path: Path) -> set[int]:
    """The pids the daemon lists as attached."""
    return {c["pid"] for c in status(socket_path)["clients"] if c["attached"]}


def test_a_spare_attached_ahead_keeps_a_readopted_arena_and_attaches_to_a_new_one(model: Path, sock: Path) -> None:
    """A spare engine attaches and warms up before its start; started after its daemon was replaced, it serves the
    same allocation when the successor re-adopted it (the same ``arena_id``), the memory it maps when no daemon
    answers, and attaches again (the old allocation unmapped) when the successor filled a new one."""
    reference, _ = reference_completer(model)("The capital of", 8, temperature=0.0)
    engine_args = ("--weight-cache", "client", "--socket", str(sock), "--role", "standby")
    with contextlib.ExitStack() as stack:
        first = stack.enter_context(ProcessDaemon(model, sock))
        arena = status(sock)["arena_id"]
        spares = [stack.enter_context(contextlib.closing(SpareEngine(model, *engine_args))) for _ in range(3)]
        for spare in spares:
            spare.wait_prepared()
        assert clients(sock) == {spare.process.pid for spare in spares}  # attached before their start
        first.kill()
        second = stack.enter_context(ProcessDaemon(model, sock))
        assert status(sock)["fill"]["source"] == "readopt" and status(sock)["arena_id"] == arena
        readopted = spares[0].start()
        second.kill()
        unanswered = spares[1].start()
        stack.enter_context(ProcessDaemon(model, sock, "--fill-from", "disk"))
        assert status(sock)["arena_id"] not in (arena, None)
        refilled = spares[2].start()
        for spare in (readopted, unanswered, refilled):
            assert spare.post(Endpoint.PROMOTE).status_code == 200
            text = spare.complete(prompt="The capital of", max_tokens=8, temperature=0.0).json()["choices"][0]["text"]
            assert text == reference and "attached and warmed up" in spare.logs()
        assert "attaching again" not in readopted.logs() + unanswered.logs()
        assert "serving the arena it attached before its start" in unanswered.logs()
        assert "another allocation than the one it attached: attaching again" in refilled.logs()
        assert clients(sock) == {refilled.process.pid}


def test_a_dead_engines_offer_is_removed_and_the_daemon_loads_again(model: Path, sock: Path) -> None:
    with ProcessDaemon(model, sock) as first:
        engine = Engine(model, sock)
        offers = list(sock.parent.glob("*.handover"))
        assert len(offers) == 1
        engine.stop()  # SIGKILL: its offer stays behind, nobody listens on it
        first.kill()
    with ThreadDaemon(model, sock) as daemon:
        assert daemon.fill_report["source"] == "disk"
    assert not offers[0].exists()


# --- hostile engines -------------------------------------------------------------------------------


def memfd(data: bytes, seals: int = ARENA_SEALS) -> int:
    """A memfd holding ``data``, with ``seals``, reopened read-only (as an engine holds the arena)."""
    fd = os.memfd_create("hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    readonly = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    os.close(fd)
    return readonly


def flip_one_byte(content: bytes) -> bytes:
    """``content`` with its middle byte's bits inverted (what a tampering engine might hand back)."""
    middle = len(content) // 2
    return content[:middle] + bytes([content[middle] ^ 0xFF]) + content[middle + 1 :]


def recorded_arena(model: Path, sock: Path) -> tuple[dict, bytes]:
    """Serve once from disk (which writes the daemon's record) and stop; (the record, the arena's bytes)."""
    with ThreadDaemon(model, sock) as daemon:
        content = daemon.arena.tensor.numpy().tobytes()
    return json.loads(DaemonPaths(sock).record.read_text()), content


HOSTILE = {
    "other content": (lambda arena: memfd(bytes(len(arena))), "whose keyed digest is"),
    "one byte changed": (lambda arena: memfd(flip_one_byte(arena)), "whose keyed digest is"),
    "wrong size": (lambda arena: memfd(arena + bytes(mmap.PAGESIZE)), "memfd holds"),
    "unsealed": (lambda arena: memfd(arena, seals=0), "lacks the shrink, grow, future-write, seal seal(s)"),
    "a regular file": (lambda arena: os.open(__file__, os.O_RDONLY | os.O_CLOEXEC), "not a memfd"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_engine_is_refused_in_one_line_and_the_daemon_loads_from_disk(
    model: Path, sock: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    record, content = recorded_arena(model, sock)
    make_fd, reason = HOSTILE[case]
    fingerprint = fingerprint_of(model)
    trusted = frozenset({os.getuid()})
    offer = HandoverOffer(
        offer_path(sock, fingerprint.digest()), fingerprint, record["handle"], make_fd(content), trusted
    )
    try:
        with caplog.at_level(logging.INFO), ThreadDaemon(model, sock) as daemon:
            assert daemon.fill_report["source"] == "disk"
            assert daemon.manifest["content_hash"] == record["manifest"]["content_hash"]
    finally:
        offer.close()
    refusals = [r.getMessage() for r in caplog.records if "re-adoption refused" in r.getMessage()]
    assert len(refusals) == 1 and reason in refusals[0] and f"engine pid {os.getpid()}" in refusals[0], refusals


def test_an_engine_of_another_fingerprint_hands_nothing_over(
    model: Path, sock: Path, caplog: pytest.LogCaptureFixture
) -> None:
    record, content = recorded_arena(model, sock)
    ours = fingerprint_of(model)
    other = compute_fingerprint(read_checkpoint(model), LoadSpec(dtype="fp16"))
    # an engine of another config whose offer sits under our digest (say, a renamed socket)
    offer = HandoverOffer(
        offer_path(sock, ours.digest()), other, record["handle"], memfd(content), frozenset({os.getuid()})
    )
    try:
        with caplog.at_level(logging.INFO), ThreadDaemon(model, sock) as daemon:
            assert daemon.fill_report["source"] == "disk"
    finally:
        offer.close()
    assert "fingerprint differs in 1 field(s): dtype" in caplog.text


def test_a_copy_with_the_recorded_content_is_adopted_after_its_keyed_digest(model: Path, sock: Path) -> None:
    record, content = recorded_arena(model, sock)
    fingerprint = fingerprint_of(model)
    path = offer_path(sock, fingerprint.digest())
    offer = HandoverOffer(path, fingerprint, record["handle"], memfd(content), frozenset({os.getuid()}))
    try:
        with ThreadDaemon(model, sock) as daemon:
            assert daemon.fill_report["source"] == "readopt"
            assert "verified by keyed digest" in daemon.fill_report["detail"]
    finally:
        offer.close()


# --- snapshots -------------------------------------------------------------------------------------


def snapshot_of(model: Path, out: Path) -> Path:
    """A snapshot of ``model`` written to ``out`` by the real CLI."""
    command = hotweights_command("cache", "snapshot", "--model", str(model), str(out))
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out}: 15 tensors")
    return out


@pytest.fixture
def snapshot(model: Path, own_world: Path) -> Path:
    return snapshot_of(model, own_world / "tiny.snap")


@pytest.fixture(scope="module")
def tiny_snapshot(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A snapshot of the (unchanged) tiny model, written once: tests damage copies of it."""
    return snapshot_of(tiny_model, tmp_path_factory.mktemp("snapshot") / "tiny.snap")


def test_snapshot_round_trip_serves_the_same_arena_without_the_checkpoint(
    model: Path, sock: Path, snapshot: Path
) -> None:
    with ThreadDaemon(model, sock) as daemon, Engine(model, sock) as engine:
        expected = daemon.manifest["content_hash"]
        before = engine.ask("generate")["tokens"]
    corrupt_weights(model)
    with ThreadDaemon(model, sock, fill_from=("snapshot",), snapshot=snapshot) as daemon:
        assert daemon.fill_report["source"] == "snapshot"
        assert daemon.manifest["content_hash"] == expected
        with Engine(model, sock) as engine:
            assert engine.ask("generate")["tokens"] == before


def rewrite_header(path: Path, change) -> None:
    """Rewrite the snapshot's header with ``change(header)`` applied, keeping its data."""
    blob = path.read_bytes()
    (length,) = LENGTH.unpack(blob[len(MAGIC) : len(MAGIC) + LENGTH.size])
    header = json.loads(blob[len(MAGIC) + LENGTH.size : len(MAGIC) + LENGTH.size + length])
    data = blob[header["data_offset"] :]
    change(header)
    body = json.dumps(header).encode()
    prefix = MAGIC + LENGTH.pack(len(body)) + body
    header["data_offset"] = -(-(len(prefix) + 64) // 4096) * 4096
    body = json.dumps(header).encode()
    prefix = MAGIC + LENGTH.pack(len(body)) + body
    path.write_bytes(prefix + bytes(header["data_offset"] - len(prefix)) + data)


def other_torch(header: dict) -> None:
    header["fingerprint"]["torch_version"] = header["manifest"]["fingerprint"]["torch_version"] = "2.99.0"


def truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def flip_a_data_byte(path: Path) -> None:
    with open(path, "r+b") as out:
        out.seek(-100, os.SEEK_END)
        byte = out.read(1)
        out.seek(-100, os.SEEK_END)
        out.write(bytes([byte[0] ^ 0xFF]))


SNAPSHOT_FAULTS = {
    "another torch": (lambda path: rewrite_header(path, other_torch), "torch_version: snapshot has '2.99.0', expected"),
    "truncated": (truncate, "is truncated"),
    "corrupt data": (flip_a_data_byte, "is corrupt: its data hashes to"),
    "not a snapshot": (lambda path: path.write_bytes(b"PK\x03\x04" + bytes(64)), "is not a hotweights snapshot"),
}


@pytest.mark.parametrize("fault", sorted(SNAPSHOT_FAULTS))
def test_a_bad_snapshot_is_refused_with_the_reason(
    tiny_model: Path, tiny_snapshot: Path, own_world: Path, fault: str
) -> None:
    snapshot = Path(shutil.copy2(tiny_snapshot, own_world / "tiny.snap"))
    damage, reason = SNAPSHOT_FAULTS[fault]
    damage(snapshot)
    with pytest.raises(SourceRefused, match=reason.replace("(", r"\(").replace(")", r"\)")):
        load_snapshot(snapshot, fingerprint_of(tiny_model), get_backend("cpu-shm"), torch.device("cpu"))


def test_a_snapshot_of_another_model_is_never_served(model: Path, sock: Path, own_world: Path) -> None:
    other = make_checkpoint(own_world / "other", seed=1)
    stale = own_world / "other.snap"
    filled = load_arena(pipeline_source(read_checkpoint(other), LoadSpec()), get_backend("cpu-shm"))
    try:
        write_snapshot(stale, filled.manifest, filled.arena.tensor)
    finally:
        filled.arena.close()
    command = hotweights_command("cache", "serve", "--model", str(model), "--socket", str(sock))
    command += ["--snapshot", str(stale), "--fill-from", "snapshot"]
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("hotweights cache: error: nothing to serve") and f"snapshot {stale} is stale" in last
    assert "model_path: snapshot has" in last and "Traceback" not in done.stderr
    assert not sock.exists()


def test_a_full_disk_leaves_no_snapshot_behind(model: Path, own_world: Path) -> None:
    """A 1 MiB tmpfs (in a mount namespace of its own) cannot hold the tiny model's snapshot."""
    small = own_world / "small"
    small.mkdir()
    out = small / "tiny.snap"
    snap = " ".join(hotweights_command("cache", "snapshot", "--model", str(model), str(out)))
    script = f"mount -t tmpfs -o size=1m none {small} && {snap}; rc=$?; ls -A {small}; exit $rc"
    command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script]
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no user and mount namespaces here: {probe.stderr.decode().strip()}")
    done = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"hotweights cache: error: cannot write snapshot {out}: No space left on device")
    assert "Traceback" not in done.stderr
    assert done.stdout.strip() == ""  # ls: the temporary file is gone, no OUT was made


# --- the controller --------------------------------------------------------------------------------


@pytest.fixture
def stack(model: Path) -> Iterator[ControllerStack]:
    cluster = ControllerStack(model, engines=2)
    try:
        cluster.start_controller()
        cluster.wait_steady()
        yield cluster
    finally:
        cluster.close()


def complete(url: str) -> str:
    body = {"prompt": "The failover took", "max_tokens": 12, "temperature": 0.0}
    response = httpx.post(url + Endpoint.COMPLETIONS, json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def ready_daemon_spare(stack: ControllerStack) -> dict | None:
    """The group's spare daemon process once it is imported and waiting; None before."""
    spares = [s for s in stack.cluster()["daemon_spares"] if s["ready"]]
    if spares:
        assert "--start-fd" in Path(f"/proc/{spares[0]['pid']}/cmdline").read_bytes().decode().split("\0")
    return spares[0] if spares else None


def test_controller_respawns_the_daemon_from_its_spare_which_readopts_under_load(
    stack: ControllerStack, model: Path
) -> None:
    primary = stack.primary()
    before = complete(primary["url"])
    daemon = stack.daemon()
    failures: list[str] = []
    served = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                served.append(complete(primary["url"]))
            except (AssertionError, httpx.HTTPError) as exc:
                failures.append(str(exc))

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    try:
        wait_until(lambda: served, 60, "the first completion under load")
        spare = wait_until(lambda: ready_daemon_spare(stack), 60, "a ready spare daemon")
        assert spare["service"] == daemon["id"] and spare["pid"] != daemon["pid"]
        corrupt_weights(model)  # from now on, only the arena holds the original weights
        os.kill(daemon["pid"], signal.SIGKILL)
        wait_until(lambda: (d := stack.daemon())["serving"] and d["pid"] != daemon["pid"], 60, "respawned daemon")
        wait_until(lambda: stack.events("respawn"), 30, "the respawn event")
    finally:
        stop.set()
        worker.join(timeout=60)
    assert not failures and set(served) == {before}
    respawn = stack.events("respawn")[-1]
    assert respawn["fill_source"] == "readopt" and respawn["fill_ms"] > 0, respawn
    assert "filled from readopt" in respawn["message"]
    assert stack.daemon()["pid"] == spare["pid"] and respawn["spare"] is True and "its spare" in respawn["message"]
    print(f"\ndaemon respawned from its spare, serving {respawn['duration_ms']} ms after the controller's decision")
    following = wait_until(lambda: ready_daemon_spare(stack), 60, "the respawned daemon's own spare")
    assert following["pid"] not in (spare["pid"], daemon["pid"])
    assert status(stack.config_path.parent / "state" / "run" / "g0.sock")["fill"]["disk_read_bytes"] == 0
    standby = next(m for m in stack.members().values() if m["role"] == "standby")
    os.kill(standby["pid"], signal.SIGKILL)
    wait_until(
        lambda: (m := stack.members()[standby["id"]])["status"] == "healthy" and m["pid"] != standby["pid"],
        90,
        "a new standby attached to the re-adopted arena",
    )
    response = stack.client.post("/failover", json={"candidate": standby["id"]})
    assert response.status_code == 200, response.text
    stack.wait_steady()
    assert complete(stack.members()[standby["id"]]["url"]) == before


# --- what cuda-ipc cannot do, and cuda-vmm on a GPU -----------------------------------------------


def test_cuda_ipc_says_it_cannot_be_readopted(model: Path, sock: Path) -> None:
    backend = get_backend("cuda-ipc")
    fd = memfd(bytes(mmap.PAGESIZE))
    with pytest.raises(BackendUnavailable, match="cuda-ipc arenas cannot be re-adopted"):
        backend.adopt({"backend": "cuda-ipc", "nbytes": mmap.PAGESIZE}, fd, torch.device("cpu"))
    with pytest.raises(OSError):
        os.fstat(fd)  # adopt took the fd and closed it
    with pytest.raises(SourceSkipped, match="cuda-ipc arenas cannot be re-adopted"):
        readopt(DaemonPaths(sock).record, fingerprint_of(model), backend, torch.device("cpu"), frozenset({0}))


cuda_vmm = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("cuda.bindings") is None,
    reason="needs a CUDA device and cuda-bindings",
)


@pytest.mark.cuda
@cuda_vmm
def test_cuda_vmm_daemon_readopts_from_an_engine_and_verifies_its_keyed_digest(model: Path, sock: Path) -> None:
    spec = LoadSpec(device="cuda:0")
    with ThreadDaemon(model, sock, spec, backend="cuda-vmm"):
        engine = Engine(model, sock, device="cuda:0")
    # the first daemon is gone (its handle released, its fd closed): the engine's kept fd holds the memory
    with engine:
        before = engine.ask("generate")["tokens"]
        corrupt_weights(model)
        with ThreadDaemon(model, sock, spec, backend="cuda-vmm", fill_from=("readopt",)) as daemon:
            assert daemon.fill_report["source"] == "readopt"
            assert "verified by keyed digest" in daemon.fill_report["detail"]
            with Engine(model, sock, device="cuda:0") as newcomer:
                assert newcomer.ask("generate")["tokens"] == before


@pytest.mark.cuda
@cuda_vmm
def test_cuda_vmm_refuses_an_fd_that_is_not_an_allocation() -> None:
    backend = get_backend("cuda-vmm")
    handle = {"backend": "cuda-vmm", "nbytes": 2 << 20, "device_index": 0, "device_uuid": None}
    with pytest.raises(ValueError, match="not a CUDA allocation"):
        backend.adopt(handle, memfd(bytes(2 << 20)), torch.device("cuda:0"))
