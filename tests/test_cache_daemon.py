"""The weight cache daemon and zero-copy attach, with real processes, sockets and shared memory."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

from hotweights.cache.client import attach
from hotweights.cache.connection import AttachRefused, DaemonUnavailable, hello, request
from hotweights.cache.fingerprint import Fingerprint
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.paths import DaemonPaths
from hotweights.cache.pipeline import load_processed
from hotweights.cache.protocol import MAX_MESSAGE_BYTES, PROTOCOL_VERSION, recv_message, send_message
from hotweights.cli import main as cli_main
from hotweights.errors import ConfigError
from hotweights.pidlock import PidLock
from hotweights.standby.weights import load_model, prepare
from tests.cachehelpers import ENV, Engine, ProcessDaemon, ThreadDaemon, fingerprint_of, wait_until
from tests.conftest import make_checkpoint


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Path:
    """A short private runtime dir (socket paths must fit in 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="hw-", dir="/tmp"))
    monkeypatch.setenv("HOTWEIGHTS_RUNTIME_DIR", str(path))
    yield path
    shutil.rmtree(path)


@pytest.fixture
def sock(runtime: Path) -> Path:
    return runtime / "d.sock"


def raw_connect(path: Path, timeout: float = 5.0) -> socket.socket:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(timeout)
    conn.connect(str(path))
    return conn


# -- attach: equality, zero copy, sharing ----------------------------------------------------------


def test_attached_tensors_are_bitwise_equal_to_off_mode(tiny_model: Path, sock: Path) -> None:
    reference = load_processed(tiny_model, LoadSpec(), progress=False)
    with ThreadDaemon(tiny_model, sock):
        attachment = attach(sock, fingerprint_of(tiny_model), "cpu")
        try:
            assert attachment.tensors.keys() == reference.keys()
            for name, tensor in reference.items():
                assert attachment.tensors[name].dtype == tensor.dtype
                assert torch.equal(attachment.tensors[name].view(torch.uint8), tensor.view(torch.uint8)), name
        finally:
            attachment.close()


def test_socket_is_private_and_cleaned_up(tiny_model: Path, sock: Path) -> None:
    with ThreadDaemon(tiny_model, sock):
        assert oct(sock.stat().st_mode & 0o777) == oct(0o600)
        assert oct(sock.parent.stat().st_mode & 0o777) == oct(0o700)
        marker = json.loads((sock.with_suffix(".ready")).read_text())
        assert marker["pid"] == os.getpid()
    assert not sock.exists()
    assert not sock.with_suffix(".ready").exists()


def test_two_engine_processes_map_the_daemons_very_pages(tiny_model: Path, sock: Path) -> None:
    """Zero copy: both engines map, shared and read-only, the very memfd the daemon filled (its inode), and
    compute with the same bytes."""
    with ThreadDaemon(tiny_model, sock) as daemon, Engine(tiny_model, sock) as a, Engine(tiny_model, sock) as b:
        inode = str(daemon.arena.identity()["ino"])
        for engine in (a, b):
            maps = [line.split() for line in Path(f"/proc/{engine.process.pid}/maps").read_text().splitlines()]
            assert [fields[1] for fields in maps if len(fields) > 5 and fields[4] == inode] == ["r--s"]
        assert a.ask("checksum")["sums"] == b.ask("checksum")["sums"]


def test_attach_does_not_grow_private_memory(tmp_path: Path, sock: Path) -> None:
    model = make_checkpoint(tmp_path / "wide", hidden_size=1024, intermediate_size=2048, vocab_size=4096)
    with ThreadDaemon(model, sock) as daemon, Engine(model, sock) as engine:
        arena_kib = daemon.manifest["used_bytes"] // 1024
        assert arena_kib > 40_000
        engine.ask("checksum")  # touch every page of every tensor
        grown = engine.ask("memory")["private_kib"] - engine.hello["private_kib_before"]
        assert grown < arena_kib / 4, f"private memory grew {grown} KiB for a {arena_kib} KiB arena"


def test_three_engines_share_one_arena(tiny_model: Path, sock: Path) -> None:
    with ThreadDaemon(tiny_model, sock), Engine(tiny_model, sock) as a, Engine(tiny_model, sock) as b:
        with Engine(tiny_model, sock) as c:
            outputs = [e.ask("generate")["tokens"] for e in (a, b, c)]
            assert outputs[0] == outputs[1] == outputs[2]
            status = request(sock, {"op": "status"})["status"]
            attached = [client["pid"] for client in status["clients"] if client["attached"]]
            assert sorted(attached) == sorted(e.process.pid for e in (a, b, c))
        wait_until(lambda: len([x for x in request(sock, {"op": "status"})["status"]["clients"] if x["attached"]]) == 2)


def test_engines_survive_daemon_sigkill_and_restart_serves_again(tiny_model: Path, sock: Path) -> None:
    reference = None
    with ProcessDaemon(tiny_model, sock) as daemon, Engine(tiny_model, sock) as engine:
        reference = engine.ask("generate")["tokens"]
        sums = engine.ask("checksum")["sums"]
        daemon.kill()
        assert engine.ask("generate")["tokens"] == reference
        assert engine.ask("checksum")["sums"] == sums
        assert engine.process.poll() is None, "the engine must not die with its daemon"
        with pytest.raises(DaemonUnavailable):
            hello(sock, timeout=1)
        with ProcessDaemon(tiny_model, sock), Engine(tiny_model, sock) as fresh:
            assert fresh.hello["source"] == "cache"
            assert fresh.ask("generate")["tokens"] == reference
        assert engine.ask("generate")["tokens"] == reference


def test_sigterm_exits_cleanly(tiny_model: Path, sock: Path) -> None:
    daemon = ProcessDaemon(tiny_model, sock).start()
    try:
        assert daemon.kill(signal.SIGTERM) == 0
        assert not sock.exists() and not sock.with_suffix(".ready").exists()
    finally:
        daemon.__exit__()


def test_second_daemon_on_same_socket_is_refused(tiny_model: Path, sock: Path) -> None:
    with ProcessDaemon(tiny_model, sock):
        second = ProcessDaemon(tiny_model, sock)
        result = subprocess.run(second.command, env=ENV, capture_output=True, text=True, timeout=60)
        assert result.returncode == 2
        assert "another daemon" in result.stderr
        assert hello(sock)["ok"]


# -- engine-side modes ----------------------------------------------------------------------------


def test_client_mode_without_daemon_fails_with_the_fix(tiny_model: Path, sock: Path) -> None:
    with pytest.raises(DaemonUnavailable, match="hotweights cache serve"):
        load_model(tiny_model, LoadSpec(), weight_cache="client", socket_path=str(sock))


def test_client_mode_falls_back_to_disk_only_when_asked(
    tiny_model: Path, sock: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loaded = load_model(tiny_model, LoadSpec(), weight_cache="client", socket_path=str(sock), fallback="disk")
    assert loaded.source == "disk"
    assert "WEIGHT CACHE NOT USED" in caplog.text


def test_a_spares_prepared_load_is_used_only_while_the_checkpoint_is_unchanged(
    tiny_model: Path, sock: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """What a spare prepares (headers, fingerprint, skeleton) is bound after its start; a touched file voids it."""
    model = Path(shutil.copytree(tiny_model, tmp_path / "model"))
    reference = load_model(model, LoadSpec()).model.state_dict()
    with ThreadDaemon(model, sock), caplog.at_level(logging.INFO, logger="hotweights.standby.weights"):
        prepared = prepare(model, LoadSpec(), skeleton=True)
        skeleton = prepared.meta
        loaded = load_model(model, LoadSpec(), weight_cache="client", socket_path=str(sock), prepared=prepared)
        assert loaded.model is skeleton and "prepared before this spare was started" in caplog.text
        assert all(torch.equal(t, reference[name]) for name, t in loaded.model.state_dict().items())
        loaded.attachment.close()
        stale = prepare(model, LoadSpec(), skeleton=True)
        config = model / "config.json"
        os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 1))
        again = load_model(model, LoadSpec(), weight_cache="client", socket_path=str(sock), prepared=stale)
        assert again.model is not stale.meta and "changed since this spare read it" in caplog.text
        assert all(torch.equal(t, reference[name]) for name, t in again.model.state_dict().items())
        again.attachment.close()


def test_fingerprint_mismatch_refuses_or_falls_back(tiny_model: Path, sock: Path) -> None:
    with ThreadDaemon(tiny_model, sock):
        with pytest.raises(AttachRefused, match="dtype: daemon has 'float32', engine expects 'bfloat16'"):
            load_model(tiny_model, LoadSpec(dtype="bf16"), weight_cache="client", socket_path=str(sock))
        loaded = load_model(
            tiny_model, LoadSpec(dtype="bf16"), weight_cache="client", socket_path=str(sock), fallback="disk"
        )
        assert loaded.source == "disk"


def test_daemon_mode_starts_a_detached_daemon(tiny_model: Path, runtime: Path) -> None:
    loaded = load_model(tiny_model, LoadSpec(), weight_cache="daemon")
    try:
        assert loaded.source == "cache"
        ready = next(runtime.glob("*.ready"))
        pid = json.loads(ready.read_text())["pid"]
        assert pid != os.getpid()
        again = load_model(tiny_model, LoadSpec(), weight_cache="daemon")
        assert again.source == "cache"
        assert json.loads(ready.read_text())["pid"] == pid, "a second daemon was started"
        again.attachment.close()
    finally:
        loaded.attachment.close()
        os.kill(pid, 15)
        wait_until(lambda: not ready.exists(), what="daemon exit")


# -- refusals -------------------------------------------------------------------------------------

ALTERED = {
    "model_path": "/elsewhere/model",
    "config_hash": "0" * 32,
    "weights_index_hash": "1" * 32,
    "tp_size": 2,
    "tp_rank": 1,
    "pp_size": 2,
    "pp_rank": 1,
    "dp_size": 4,
    "dp_rank": 3,
    "quantization": "fp8-block",
    "quantization_config_hash": "2" * 32,
    "dtype": "bfloat16",
    "device_kind": "cuda:NVIDIA H200",
    "compute_capability": "9.0",
    "torch_version": "0.0.1",
    "arena_format": 99,
    "layout": "vllm-0.0.0:LlamaForCausalLM",
}


def test_every_fingerprint_field_is_checked(tiny_model: Path, sock: Path) -> None:
    expected = fingerprint_of(tiny_model)
    assert set(ALTERED) == {f.name for f in dataclasses.fields(Fingerprint)}, "a field has no refusal test"
    with ThreadDaemon(tiny_model, sock):
        for field, value in ALTERED.items():
            wrong = dataclasses.replace(expected, **{field: value})
            with pytest.raises(AttachRefused) as refused:
                attach(sock, wrong, "cpu")
            assert [d[0] for d in refused.value.differences] == [field]
            assert refused.value.differences[0][1:] == (getattr(expected, field), value)
            assert field in str(refused.value)
        assert hello(sock)["ok"]


def test_refused_quantization_never_serves(tmp_path: Path, sock: Path) -> None:
    model = make_checkpoint(tmp_path / "awq")
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (model / "config.json").write_text(json.dumps(config))
    daemon = ProcessDaemon(model, sock)
    result = subprocess.run(daemon.command, env=ENV, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "quantization method 'awq' is refused" in result.stderr
    assert not sock.exists()


def test_wrong_uid_is_forbidden(tiny_model: Path, sock: Path) -> None:
    sock.parent.chmod(0o711)  # other uids are allowed: they must be able to reach the socket
    with ThreadDaemon(tiny_model, sock, allowed_uids=frozenset([os.getuid() + 12345])):
        assert oct(sock.stat().st_mode & 0o777) == oct(0o666)  # the kernel-checked uid is the gate
        reply = request(sock, {"op": "hello", "version": PROTOCOL_VERSION})
        assert reply == {"ok": False, "error": "forbidden", "message": f"uid {os.getuid()} may not use this cache"}


# Run by the system Python as another user, who may not read this checkout or its virtualenv.
HELLO_AS = """
import json, socket, struct, sys
conn = socket.socket(socket.AF_UNIX)
conn.connect(sys.argv[1])
body = json.dumps({"op": "hello", "version": 1}).encode()
conn.sendall(struct.pack(">I", len(body)) + body)
(length,) = struct.unpack(">I", conn.recv(4))
print(conn.recv(length).decode())
"""
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(os.getuid() != 0, reason="acting as other uids needs root")
@pytest.mark.skipif(not Path(SYSTEM_PYTHON).exists(), reason=f"needs {SYSTEM_PYTHON} for the other uid")
def test_allowed_other_uid_is_served_and_others_are_not(tiny_model: Path, sock: Path) -> None:
    sock.parent.chmod(0o711)
    allowed, stranger = 65534, 65533

    def hello_as(uid: int) -> str:
        result = subprocess.run(
            [SYSTEM_PYTHON, "-c", HELLO_AS, str(sock)],
            cwd="/",
            capture_output=True,
            text=True,
            timeout=60,
            preexec_fn=lambda: os.setuid(uid),
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    with ThreadDaemon(tiny_model, sock, allowed_uids=frozenset([os.getuid(), allowed])):
        assert json.loads(hello_as(allowed))["ok"] is True
        assert json.loads(hello_as(stranger))["error"] == "forbidden"


def test_socket_directory_others_can_write_is_refused(tiny_model: Path, sock: Path) -> None:
    sock.parent.chmod(0o777)
    daemon = ThreadDaemon(tiny_model, sock)
    with pytest.raises(ConfigError, match="writable by others"):
        daemon.daemon.run()
    sock.parent.chmod(0o700)


@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (struct.pack(">I", 5) + b"nope!", "bad_message"),
        (struct.pack(">I", 2) + b"[]", "bad_message"),
        (struct.pack(">I", MAX_MESSAGE_BYTES + 1), "bad_message"),
        (struct.pack(">I", 100) + b'{"op": "hel', "bad_message"),  # truncated, then the peer goes quiet
        (struct.pack(">I", 17) + b'{"op": "destroy"}', "unknown_op"),
        (struct.pack(">I", 15) + b'{"op": "hello"}', "version_mismatch"),
        (struct.pack(">I", 34) + b'{"op": "attach", "fingerprint": 7}', "version_mismatch"),
        (struct.pack(">I", 5007) + b'{"op":' + b"1" * 5000 + b"}", "bad_message"),  # int over 4300 digits
        (struct.pack(">I", 200000) + b"[" * 100000 + b"]" * 100000, "bad_message"),  # nested too deep
    ],
)
def test_malformed_messages_get_an_error_and_a_closed_connection(
    tiny_model: Path, sock: Path, payload: bytes, code: str
) -> None:
    with ThreadDaemon(tiny_model, sock, request_timeout=0.5):
        with raw_connect(sock) as conn:
            conn.sendall(payload)
            reply, _ = recv_message(conn)
            assert reply["ok"] is False and reply["error"] == code, reply
            assert conn.recv(1) == b"", "connection should be closed after an error"
        assert hello(sock)["ok"]


def test_attach_with_malformed_fingerprint(tiny_model: Path, sock: Path) -> None:
    with ThreadDaemon(tiny_model, sock):
        fp = fingerprint_of(tiny_model).to_json()
        for bad in (7, {**fp, "tp_size": "1"}, {k: v for k, v in fp.items() if k != "dtype"}, {**fp, "x": 1}):
            reply = request(sock, {"op": "attach", "version": PROTOCOL_VERSION, "fingerprint": bad})
            assert reply["error"] == "bad_message", reply


def test_client_sending_fds_is_refused(tiny_model: Path, sock: Path) -> None:
    with ThreadDaemon(tiny_model, sock), raw_connect(sock) as conn, open(os.devnull) as f:
        send_message(conn, {"op": "hello", "version": PROTOCOL_VERSION}, [f.fileno()])
        reply, _ = recv_message(conn)
        assert reply["error"] == "bad_message" and "file descriptors" in reply["message"]


def test_silent_client_times_out_without_stalling_others(tiny_model: Path, sock: Path) -> None:
    with ThreadDaemon(tiny_model, sock, request_timeout=1.0), raw_connect(sock) as silent:
        start = time.monotonic()
        assert hello(sock)["ok"]
        assert time.monotonic() - start < 0.5, "a silent client stalled another"
        reply, _ = recv_message(silent)
        assert reply["error"] == "bad_message" and "no request within" in reply["message"]
        assert time.monotonic() - start >= 0.9


def test_protocol_fuzz_never_kills_the_daemon(tiny_model: Path, sock: Path) -> None:
    rng = random.Random(1234)
    seeds = [b'{"op": "attach", "version": 1}', b'{"op": "status"}', b'{"op": "hello", "version": 1}']
    with ThreadDaemon(tiny_model, sock, request_timeout=0.3):
        for _ in range(60):
            body = bytearray(rng.choice(seeds))
            for _ in range(rng.randint(1, 4)):
                body[rng.randrange(len(body))] = rng.randrange(256)
            length = len(body) if rng.random() < 0.7 else rng.randrange(0, 1 << 32)
            with raw_connect(sock) as conn:
                try:
                    conn.sendall(struct.pack(">I", length) + bytes(body))
                    recv_message(conn)
                except (OSError, Exception):
                    pass
        assert hello(sock)["ok"]
        assert request(sock, {"op": "status"})["ok"]


# -- leaks ----------------------------------------------------------------------------------------


def memfd_maps(pid: int) -> int:
    return sum("memfd:hotweights-arena" in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


def test_no_leaks_after_50_attach_detach_cycles(tiny_model: Path, sock: Path) -> None:
    expected = fingerprint_of(tiny_model)
    with ThreadDaemon(tiny_model, sock) as daemon:

        def snapshot() -> tuple[int, int, int]:
            return len(os.listdir("/proc/self/fd")), memfd_maps(os.getpid()), threading.active_count()

        warm = attach(sock, expected, "cpu")
        warm.close()
        # The daemon's side of a connection ends on its own thread after we hang up: let it, then count.
        wait_until(lambda: not daemon.clients, timeout=5, what="the warm-up connection to end")
        baseline = snapshot()
        for _ in range(50):
            attachment = attach(sock, expected, "cpu")
            assert attachment.tensors["norm.weight"].sum() != 0
            attachment.close()
        wait_until(lambda: snapshot() == baseline, timeout=5, what=f"fds/maps/threads back to {baseline}")


def test_accept_failure_does_not_stop_the_daemon(tiny_model: Path, sock: Path) -> None:
    """EMFILE (or ECONNABORTED) on accept costs one connection attempt, not the daemon."""
    with ThreadDaemon(tiny_model, sock) as daemon:
        listener = daemon._listener

        class FailsOnce:
            failed = False

            def accept(self):
                if not self.failed:
                    self.failed = True
                    raise OSError(24, "Too many open files")
                return listener.accept()

        daemon._listener = FailsOnce()
        try:
            wait_until(lambda: daemon._listener.failed, timeout=5, what="a failed accept")
            assert hello(sock)["ok"]
        finally:
            daemon._listener = listener


def test_unknown_backend_in_attach_reply_closes_the_fds() -> None:
    from hotweights.cache.client import _import

    read_end, write_end = os.pipe()
    try:
        with pytest.raises(DaemonUnavailable, match="cannot map the nope arena"):
            _import({"handle": {"backend": "nope"}}, [read_end], torch.device("cpu"), "d.sock")
        with pytest.raises(OSError):
            os.fstat(read_end)
    finally:
        os.close(write_end)


def test_bad_tp_request_is_a_config_error_in_daemon_and_client(tiny_model: Path, sock: Path) -> None:
    from hotweights.cache.checkpoint import read_checkpoint
    from hotweights.cache.daemon import pipeline_source
    from hotweights.errors import ConfigError

    checkpoint = read_checkpoint(tiny_model)
    for spec in (LoadSpec(tp_size=3), LoadSpec(tp_size=0), LoadSpec(tp_size=2, tp_rank=5)):
        with pytest.raises(ConfigError, match="--tp-"):
            pipeline_source(checkpoint, spec)
        with pytest.raises(ConfigError, match="--tp-"):
            load_model(tiny_model, spec, weight_cache="client", socket_path=str(sock))


def test_daemon_refuses_a_tensor_that_does_not_fit_its_slot(tiny_model: Path, sock: Path) -> None:
    """copy_ would cast or broadcast silently; the daemon must fail loudly instead."""
    from hotweights.cache.checkpoint import read_checkpoint
    from hotweights.cache.daemon import CacheDaemon, pipeline_source
    from hotweights.cache.paths import DaemonPaths
    from hotweights.errors import BindingError

    source = pipeline_source(read_checkpoint(tiny_model), LoadSpec())

    def cast_norm():
        for name, tensor in source.tensors():
            yield name, tensor.half() if name == "norm.weight" else tensor

    daemon = CacheDaemon(
        dataclasses.replace(source, tensors=cast_norm),
        DaemonPaths(sock),
        backend="cpu-shm",
        allowed_uids=frozenset([os.getuid()]),
    )
    with pytest.raises(BindingError, match=r"'norm\.weight' as \[256\] torch.float16, the arena expects"):
        daemon.load()
    assert daemon.arena is None  # the half-filled arena was closed, never served


def _leftover_socket(path: Path) -> None:
    """A socket file nobody listens on: what a SIGKILLed daemon leaves."""
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(path))


def test_cache_status_reports_leftovers_as_stale_and_removes_only_those(
    tiny_model: Path, own_world: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Other clusters' killed daemons leave sockets and published links in the shared runtime dir: they are
    reported as stale and removed, and the status of the live daemon is a success. A leftover whose lock a
    starting daemon holds is left alone (and is a failure: that daemon does not answer yet)."""
    run = own_world / "run"
    run.mkdir(mode=0o700)
    elsewhere = own_world / "other-cluster"
    elsewhere.mkdir()
    _leftover_socket(elsewhere / "g0.sock")
    (run / "cpu-aaaa.sock").symlink_to(elsewhere / "g0.sock")  # a stack's published link, its daemon killed
    (run / "cpu-bbbb.sock").symlink_to(own_world / "gone" / "g0.sock")  # its whole state dir removed since
    _leftover_socket(run / "cpu-cccc.sock")  # a stand-alone daemon's own socket
    (run / "cpu-cccc.ready").write_text('{"pid": 999999999}')
    with ThreadDaemon(tiny_model, run / "live.sock"):
        assert cli_main(["cache", "status", "--json"]) == 0
        statuses = {Path(s["socket"]).name: s for s in json.loads(capsys.readouterr().out)}
        assert sorted(statuses) == ["cpu-aaaa.sock", "cpu-bbbb.sock", "cpu-cccc.sock", "live.sock"]
        assert all("stale" in statuses[name] for name in ["cpu-aaaa.sock", "cpu-bbbb.sock", "cpu-cccc.sock"])
        assert statuses["live.sock"]["pid"] == os.getpid()
        assert sorted(p.name for p in run.iterdir() if p.suffix in (".sock", ".ready")) == ["live.ready", "live.sock"]
        assert (elsewhere / "g0.sock").exists(), "a link's target belongs to its stack, left alone"
        _leftover_socket(run / "cpu-dddd.sock")
        starting = PidLock(DaemonPaths(run / "cpu-dddd.sock").lock)
        starting.acquire()  # a daemon that took its lock and is loading: its socket is not ours to remove
        try:
            assert cli_main(["cache", "status"]) == 1
            assert "cpu-dddd.sock: DOWN" in capsys.readouterr().out
            assert (run / "cpu-dddd.sock").exists()
        finally:
            starting.release()
