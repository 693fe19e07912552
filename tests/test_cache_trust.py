"""Trust nothing on the socket, the path or the disk: hostile clients, fake daemons, squatters.

A fake daemon (tests/hostile_daemon.py, a real process on a real socket) serves what each test tells
it to; a real engine-side ``attach`` must refuse every lie before it maps a byte. Clients that try to
write the arena run as our uid and as another uid (tests run as root, so a child can setuid).
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hotweights.cache import arena as arena_layout
from hotweights.cache import connection as connection_module
from hotweights.cache.checkpoint import read_checkpoint
from hotweights.cache.client import attach
from hotweights.cache.connection import AttachRefused, DaemonUnavailable, hello
from hotweights.cache.connection import connect as client_connect
from hotweights.cache.daemon import pipeline_source
from hotweights.cache.digest import content_hash
from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.protocol import PROTOCOL_VERSION, recv_message, send_message
from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV, ProcessDaemon, ThreadDaemon, fingerprint_of, wait_until

HOSTILE = Path(__file__).resolve().parent / "hostile_daemon.py"
SYSTEM_PYTHON = "/usr/bin/python3"
OTHER_UID = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="acting as another uid needs root")
has_system_python = pytest.mark.skipif(not Path(SYSTEM_PYTHON).exists(), reason=f"needs {SYSTEM_PYTHON}")


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Path:
    """A short private runtime dir (socket paths must fit in 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="hw-", dir="/tmp"))
    monkeypatch.setenv("HOTWEIGHTS_RUNTIME_DIR", str(path))
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=True)


@pytest.fixture
def sock(runtime: Path) -> Path:
    return runtime / "d.sock"


def honest_replies(model: Path) -> dict[str, Any]:
    """What a real daemon for ``model`` on cpu-shm would answer, with an all-zero arena (and a manifest that
    says so: its content hash is the zeros')."""
    source = pipeline_source(read_checkpoint(model), LoadSpec())
    entries, used = arena_layout.plan_layout(source.specs())
    arena_bytes = -(-used // 4096) * 4096
    zeros = content_hash(torch.zeros(arena_bytes, dtype=torch.uint8), used)
    manifest = {
        "format": source.fingerprint.arena_format,
        "alignment": arena_layout.ALIGNMENT,
        "fingerprint": source.fingerprint.to_json(),
        "content_hash": zeros,
        "used_bytes": used,
        "arena_bytes": arena_bytes,
        "device": "cpu",
        "backend": "cpu-shm",
        "tensors": [entry.to_json() for entry in entries],
    }
    return {
        "hello": {"ok": True, "version": PROTOCOL_VERSION, "pid": 1, "fingerprint_digest": "x"},
        "attach": {
            "ok": True,
            "version": PROTOCOL_VERSION,
            "manifest": manifest,
            "handle": {"backend": "cpu-shm", "nbytes": arena_bytes},
        },
        "fd": "memfd",
        "fd_bytes": arena_bytes,
        "seals": ["shrink", "grow", "future-write", "seal"],
    }


class Hostile:
    """tests/hostile_daemon.py as a child process, run by the system Python when it changes uid."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec_file = Path(tempfile.mkstemp(prefix="hostile-", suffix=".json")[1])
        self.spec_file.write_text(json.dumps(spec))
        self.spec_file.chmod(0o644)
        python = SYSTEM_PYTHON if {"setuid_before_bind", "setuid_before_listen"} & spec.keys() else sys.executable
        self.process = subprocess.Popen(
            [python, str(HOSTILE), str(self.spec_file)], cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        line = self.process.stdout.readline()
        assert line == b"listening\n", self.process.stderr.read().decode()

    def __enter__(self) -> Hostile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.kill()
        self.process.wait(timeout=10)
        self.process.stdout.close()
        self.process.stderr.close()
        self.spec_file.unlink()


def hostile(model: Path, sock: Path, **changes: Any) -> Hostile:
    return Hostile({**honest_replies(model), "socket": str(sock), **changes})


def lie(model: Path, path: str, value: Any) -> dict[str, Any]:
    """The honest attach reply with one field (``a.b.c``, ints index lists) replaced."""
    reply = copy.deepcopy(honest_replies(model)["attach"])
    *parents, leaf = [int(k) if k.isdigit() else k for k in path.split(".")]
    target = reply
    for key in parents:
        target = target[key]
    target[leaf] = value
    return reply


# -- a fake daemon of a trusted uid: every lie it can tell is refused before mapping ------------------


def test_the_honest_fake_is_attached(tiny_model: Path, sock: Path) -> None:
    """The baseline the refusals below depart from: the fake passes every check when it tells no lie."""
    with hostile(tiny_model, sock):
        attachment = attach(sock, fingerprint_of(tiny_model), "cpu")
        assert float(attachment.tensors["norm.weight"].abs().sum()) == 0.0
        attachment.close()


def test_zeros_under_the_real_manifest_are_refused(tiny_model: Path, sock: Path, runtime: Path) -> None:
    """A daemon of our own uid that serves an all-zero arena under the manifest of the real weights (content
    hash included, copied from a real daemon) is refused on attach: the engine recomputes the content hash.
    That this host's engines checked the real arena already (``cache.verified``) vouches for that daemon's
    arena only, not for another process's bytes under the same manifest."""
    with ThreadDaemon(tiny_model, runtime / "real.sock") as real:
        real_hash = real.manifest["content_hash"]
        for _ in range(2):
            attach(runtime / "real.sock", fingerprint_of(tiny_model), "cpu").close()  # hashed, then remembered
    refused = pytest.raises(AttachRefused, match=f"manifest says {real_hash}: its bytes are not the ones")
    with hostile(tiny_model, sock, attach=lie(tiny_model, "manifest.content_hash", real_hash)), refused:
        attach(sock, fingerprint_of(tiny_model), "cpu")


NORM = 2  # the manifest row of a small tensor, whichever it is
MANIFEST_LIES = {
    "negative dims": ("manifest.tensors.2.2", [-1, -256], "ints >= 0"),
    "bool dim": ("manifest.tensors.2.2", [True], "ints >= 0"),
    "unknown dtype": ("manifest.tensors.2.1", "int4", "unknown dtype 'int4'"),
    "misaligned offset": ("manifest.tensors.2.3", 8, "not a multiple of 256"),
    "past the arena": ("manifest.tensors.2.3", 1 << 40, "overrun"),
    "nbytes disagree": ("manifest.tensors.2.4", 4, "nbytes 4 but shape and dtype need"),
    "float size": ("manifest.used_bytes", 1e9, "used_bytes"),
    "digest not hex": ("manifest.content_hash", "cafe", "not a 64-digit hex digest"),
    "handle size": ("handle.nbytes", 1 << 20, "the handle maps"),
    "other backend": ("handle.backend", "cuda-vmm", "does not match the manifest"),
    "alignment": ("manifest.alignment", 1, "alignment 1"),
}


@pytest.mark.parametrize("case", sorted(MANIFEST_LIES))
def test_a_manifest_that_does_not_hold_together_is_refused(tiny_model: Path, sock: Path, case: str) -> None:
    path, value, named = MANIFEST_LIES[case]
    with hostile(tiny_model, sock, attach=lie(tiny_model, path, value)):
        with pytest.raises(AttachRefused, match="does not hold together") as refused:
            attach(sock, fingerprint_of(tiny_model), "cpu")
        assert named in str(refused.value)


def test_overlapping_rows_are_refused(tiny_model: Path, sock: Path) -> None:
    """All tensors at offset 0 would alias one another."""
    reply = lie(tiny_model, "manifest.alignment", arena_layout.ALIGNMENT)
    for row in reply["manifest"]["tensors"]:
        row[3] = 0
    with hostile(tiny_model, sock, attach=reply), pytest.raises(AttachRefused, match="overlap at byte 0"):
        attach(sock, fingerprint_of(tiny_model), "cpu")


def test_a_manifest_for_another_model_is_refused_field_by_field(tiny_model: Path, sock: Path) -> None:
    expected = fingerprint_of(tiny_model)
    other = dataclasses.replace(expected, model_path="/models/other", tp_size=2)
    reply = lie(tiny_model, "manifest.fingerprint", other.to_json())
    with hostile(tiny_model, sock, attach=reply), pytest.raises(AttachRefused, match="serves another model") as refused:
        attach(sock, expected, "cpu")
    assert refused.value.differences == [("model_path", "/models/other", expected.model_path), ("tp_size", 2, 1)]
    assert "model_path: daemon has '/models/other'" in str(refused.value)


FD_LIES = {
    "regular file of random bytes": ({"fd": "file"}, "not a memfd"),
    "unsealed memfd": ({"seals": []}, "lacks the shrink, grow, future-write, seal seal(s)"),
    "memfd without a write seal": ({"seals": ["shrink", "grow", "seal"]}, "lacks the future-write seal"),
    "memfd that can shrink": ({"seals": ["grow", "future-write", "seal"]}, "lacks the shrink seal"),
    "memfd of another size": ({"fd_bytes": 1 << 16}, "holds 65536 bytes, the handle says"),
}


@pytest.mark.parametrize("case", sorted(FD_LIES))
def test_an_fd_that_could_change_or_vanish_is_refused(tiny_model: Path, sock: Path, case: str) -> None:
    changes, named = FD_LIES[case]
    with hostile(tiny_model, sock, **changes):
        with pytest.raises(AttachRefused, match="we refuse to map") as refused:
            attach(sock, fingerprint_of(tiny_model), "cpu")
        assert named in str(refused.value)


@pytest.mark.parametrize(("field", "value"), [("ok", "yes"), ("ok", 1), ("version", 1.0), ("version", True)])
def test_protocol_fields_must_have_their_exact_type(tiny_model: Path, sock: Path, field: str, value: Any) -> None:
    replies = honest_replies(tiny_model)
    with hostile(tiny_model, sock, hello={**replies["hello"], field: value}, attach=lie(tiny_model, field, value)):
        for call in (lambda: hello(sock), lambda: attach(sock, fingerprint_of(tiny_model), "cpu")):
            with pytest.raises((AttachRefused, DaemonUnavailable), match=f"{value!r}"):
                call()


def test_a_trickling_daemon_cannot_stretch_the_deadline(tiny_model: Path, sock: Path) -> None:
    """One byte every 0.3 s never trips a per-read timeout; the whole-reply deadline ends it."""
    with hostile(tiny_model, sock, trickle_s=0.3):
        start = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="no whole reply"):
            attach(sock, fingerprint_of(tiny_model), "cpu", timeout=2.0)
        assert time.monotonic() - start < 3.0


@pytest.mark.parametrize("mode", ["client", "daemon"])
def test_engine_refuses_a_lying_daemon_in_one_line_or_falls_back(tiny_model: Path, sock: Path, mode: str) -> None:
    generate = hotweights_command(
        "generate", "--model", str(tiny_model), "--prompt", "hi", "--max-tokens", "2", "--weight-cache", mode
    )
    generate += ["--socket", str(sock)]
    with hostile(tiny_model, sock, attach=lie(tiny_model, "manifest.tensors.2.2", [-1, -256])):
        refused = subprocess.run(generate, env=ENV, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2, refused.stderr
        assert "Traceback" not in refused.stderr
        name, dtype, _shape, offset, nbytes = honest_replies(tiny_model)["attach"]["manifest"]["tensors"][NORM]
        assert [line for line in refused.stderr.splitlines() if "error" in line] == [
            f"hotweights generate: error: daemon on {sock} sent a manifest that does not hold together: "
            f"manifest row {[name, dtype, [-1, -256], offset, nbytes]}: "
            "name must be a string, dims/offset/nbytes ints >= 0"
        ]
        fallback = subprocess.run(
            [*generate, "--weight-cache-fallback", "disk"], env=ENV, capture_output=True, text=True, timeout=120
        )
        assert fallback.returncode == 0, fallback.stderr
        assert "WEIGHT CACHE NOT USED" in fallback.stderr


# -- a daemon of another uid, or a socket someone else could have replaced ----------------------------


@as_root
@has_system_python
def test_a_daemon_of_another_uid_in_its_own_directory_is_refused(tiny_model: Path, runtime: Path) -> None:
    runtime.chmod(0o711)  # the other uid must reach its own directory inside
    folder = runtime / "theirs"
    folder.mkdir(mode=0o755)
    os.chown(folder, OTHER_UID, OTHER_UID)
    sock = folder / "d.sock"
    refused = pytest.raises(AttachRefused, match=f"socket {sock} is owned by uid {OTHER_UID}")
    with hostile(tiny_model, sock, setuid_before_bind=OTHER_UID, echo_fingerprint=True), refused:
        attach(sock, fingerprint_of(tiny_model), "cpu")


@as_root
@has_system_python
def test_a_daemon_whose_peer_credentials_are_another_uid_is_refused(tiny_model: Path, sock: Path) -> None:
    """The socket file is ours, in our directory, but the process listening on it is not."""
    with hostile(tiny_model, sock, setuid_before_listen=OTHER_UID, echo_fingerprint=True):
        assert sock.stat().st_uid == os.getuid()
        with pytest.raises(AttachRefused, match=rf"\(pid \d+\) runs as uid {OTHER_UID}"):
            attach(sock, fingerprint_of(tiny_model), "cpu")


def test_a_socket_directory_others_can_write_is_refused(tiny_model: Path, runtime: Path) -> None:
    folder = runtime / "open"
    folder.mkdir()
    folder.chmod(0o777)
    sock = folder / "d.sock"
    with hostile(tiny_model, sock), pytest.raises(AttachRefused, match=r"mode 777\).*not writable by group or others"):
        attach(sock, fingerprint_of(tiny_model), "cpu")


# -- clients cannot write the arena -----------------------------------------------------------------

# Run by the system Python (another uid may not read the virtualenv): attach over the raw protocol,
# then try every way to write the arena through the fd it was given. Prints {attempt: outcome}.
WRITE_ATTEMPTS = r"""
import ctypes, errno, json, mmap, os, socket, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
conn = socket.socket(socket.AF_UNIX)
conn.connect(sys.argv[1])
body = json.dumps({"op": "attach", "version": 1, "fingerprint": json.loads(sys.argv[2])}).encode()
conn.sendall(struct.pack(">I", len(body)) + body)
head, fds, _, _ = socket.recv_fds(conn, 4, 1)
(fd,) = fds
size = os.fstat(fd).st_size
def attempt(action):
    try:
        action()
        return "WROTE"
    except OSError as exc:
        return errno.errorcode[exc.errno]
def c_call(result):
    if result == -1 or result == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "")
def mprotect_upgrade(fd):
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    c_call(addr)
    c_call(libc.mprotect(addr, size, mmap.PROT_READ | mmap.PROT_WRITE))
    ctypes.memset(addr, 1, 1)
out, handles = {}, {"fd": fd}
try:
    handles["reopened"] = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # allowed: a memfd is mode 0777
except OSError:
    pass
for label, handle in handles.items():
    out[f"{label}: write"] = attempt(lambda: os.write(handle, b"x"))
    out[f"{label}: pwrite"] = attempt(lambda: os.pwrite(handle, b"x", 4096))
    out[f"{label}: shared writable mmap"] = attempt(lambda: mmap.mmap(handle, size, mmap.MAP_SHARED, mmap.PROT_WRITE))
    out[f"{label}: mprotect a read-only map writable"] = attempt(lambda: mprotect_upgrade(handle))
    out[f"{label}: ftruncate"] = attempt(lambda: os.ftruncate(handle, 0))
    out[f"{label}: grow"] = attempt(lambda: os.ftruncate(handle, size * 2))
    out[f"{label}: punch a hole"] = attempt(lambda: c_call(libc.fallocate(handle, 3, 0, size)))
print(json.dumps(out))
"""


def try_every_write(sock: Path, uid: int | None) -> dict[str, str]:
    result = subprocess.run(
        [SYSTEM_PYTHON, "-c", WRITE_ATTEMPTS, str(sock), json.dumps(fingerprint_of_sock(sock))],
        cwd="/",
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=None if uid is None else (lambda: os.setuid(uid)),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def fingerprint_of_sock(sock: Path) -> dict:
    with socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(sock))
        send_message(conn, {"op": "status"})
        return recv_message(conn)[0]["status"]["fingerprint"]


@has_system_python
@pytest.mark.parametrize("uid", [None, OTHER_UID], ids=["same uid", "other uid"])
def test_no_client_can_write_the_arena(tiny_model: Path, sock: Path, uid: int | None) -> None:
    if uid is not None and os.getuid() != 0:
        pytest.skip("acting as another uid needs root")
    sock.parent.chmod(0o711)
    with ProcessDaemon(tiny_model, sock, "--allow-uid", str(OTHER_UID)):
        outcomes = try_every_write(sock, uid)
        assert "WROTE" not in outcomes.values(), outcomes
        assert outcomes["reopened: write"] == "EPERM", outcomes  # opened read-write, refused by the seal
        assert len(outcomes) == 14, outcomes
        verify = subprocess.run(
            hotweights_command("cache", "verify", "--socket", str(sock)),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert verify.returncode == 0, verify.stdout + verify.stderr
        assert verify.stdout.startswith("OK: content hash ")


def test_not_even_the_daemon_can_write_its_arena(tiny_model: Path, sock: Path) -> None:
    """Once filled and hashed, the arena is write-sealed (F_SEAL_WRITE) and the daemon itself maps it read-only:
    no process can change a byte of what engines checked once and remember (``cache.verified``)."""
    request = {"op": "attach", "version": PROTOCOL_VERSION, "fingerprint": fingerprint_of(tiny_model).to_json()}
    with ThreadDaemon(tiny_model, sock), client_connect(sock) as conn:  # the daemon is a thread of this process
        _, (fd,) = connection_module.call(conn, request, max_fds=1)
        seals, inode = fcntl.fcntl(fd, fcntl.F_GET_SEALS), os.fstat(fd).st_ino
        os.close(fd)
        maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
        modes = [fields[1] for fields in maps if len(fields) > 5 and fields[4] == str(inode)]
    assert seals & fcntl.F_SEAL_WRITE and modes == ["r--s"], (seals, modes)


def test_verify_reports_bytes_that_are_not_the_manifests(tiny_model: Path, sock: Path, runtime: Path) -> None:
    """``cache verify`` recomputes the content hash over the bytes served: zeros under the manifest of the real
    weights are a mismatch (exit 1)."""
    with ThreadDaemon(tiny_model, runtime / "real.sock") as real:
        real_hash = real.manifest["content_hash"]
    status = {"fingerprint": fingerprint_of(tiny_model).to_json(), "device": "cpu"}
    lies = {"attach": lie(tiny_model, "manifest.content_hash", real_hash), "status": {"ok": True, "status": status}}
    with hostile(tiny_model, sock, **lies):
        command = hotweights_command("cache", "verify", "--socket", str(sock))
        result = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout.startswith("MISMATCH"), result.stdout + result.stderr


# -- the daemon's side: deadlines and a connection cap --------------------------------------------


def test_a_trickling_client_is_cut_off_at_the_request_deadline(tiny_model: Path, sock: Path) -> None:
    body = json.dumps({"op": "hello", "version": PROTOCOL_VERSION}).encode()
    frame = len(body).to_bytes(4, "big") + body
    with ThreadDaemon(tiny_model, sock, request_timeout=1.0), socket.socket(socket.AF_UNIX) as conn:
        conn.connect(str(sock))
        start = time.monotonic()
        with pytest.raises(OSError):
            for byte in frame:
                conn.sendall(bytes([byte]))
                time.sleep(0.2)  # the trickle under test, not a synchronisation
        assert time.monotonic() - start < 2.5, "the daemon waited past its whole-request deadline"


def test_many_slow_connections_are_shed_and_a_real_client_still_attaches(tiny_model: Path, sock: Path) -> None:
    slow: list[socket.socket] = []
    with ThreadDaemon(tiny_model, sock, request_timeout=60.0, max_connections=8) as daemon:
        baseline = threading.active_count()
        try:
            for _ in range(40):
                conn = socket.socket(socket.AF_UNIX)
                conn.settimeout(5.0)
                conn.connect(str(sock))
                conn.sendall(b"\0")  # the start of a request that never finishes
                slow.append(conn)
            wait_until(lambda: len(daemon.clients) <= 8 and threading.active_count() <= baseline + 8, timeout=10)
            attachment = attach(sock, fingerprint_of(tiny_model), "cpu")
            assert threading.active_count() <= baseline + 9
            shed = sum(conn.recv(1) == b"" for conn in slow[:30])
            assert shed == 30, "the oldest slow connections should have been closed"
            attachment.close()
        finally:
            for conn in slow:
                conn.close()


# -- the socket path: never delete what is not ours, check before the slow load ----------------------


def serve_command(model: Path, sock: Path) -> list[str]:
    return hotweights_command("cache", "serve", "--model", str(model), "--socket", str(sock))


def run_serve(model: Path, sock: Path) -> subprocess.CompletedProcess:
    return subprocess.run(serve_command(model, sock), env=ENV, capture_output=True, text=True, timeout=120)


def assert_one_line_refusal(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "loading" not in result.stderr, "the path must be checked before the model is loaded"
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_a_directory_at_the_socket_path_is_refused_before_loading(tiny_model: Path, sock: Path) -> None:
    sock.mkdir()
    assert_one_line_refusal(run_serve(tiny_model, sock), f"{sock} is a directory, not a socket")
    assert sock.is_dir()


def test_a_regular_file_at_the_socket_path_is_not_deleted(tiny_model: Path, sock: Path) -> None:
    sock.write_text("precious")
    assert_one_line_refusal(run_serve(tiny_model, sock), f"{sock} is a file, not a socket", "will not remove it")
    assert sock.read_text() == "precious"


def test_a_live_foreign_listener_is_not_replaced(tiny_model: Path, sock: Path) -> None:
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(sock))
        listener.listen(1)
        inode = sock.stat().st_ino
        assert_one_line_refusal(run_serve(tiny_model, sock), f"{sock} is in use by another process (pid {os.getpid()}")
        assert sock.stat().st_ino == inode


def test_a_stale_socket_is_replaced(tiny_model: Path, sock: Path) -> None:
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(sock))  # bound, never listening: what a SIGKILLed daemon leaves behind
    with ProcessDaemon(tiny_model, sock):
        assert hello(sock)["ok"]


def test_the_daemon_takes_only_its_exact_protocol_version(tiny_model: Path, sock: Path) -> None:
    """1.0 and true compare equal to 1 in Python; on the wire they are other versions."""
    from hotweights.cache.connection import request

    fingerprint = fingerprint_of(tiny_model).to_json()
    with ThreadDaemon(tiny_model, sock):
        for version in (1.0, True, "1"):
            for op in ("hello", "attach"):
                reply = request(sock, {"op": op, "version": version, "fingerprint": fingerprint})
                assert reply["error"] == "version_mismatch", (op, version, reply)


def test_a_connect_refused_by_a_full_backlog_is_retried_within_the_deadline(
    sock: Path, caplog: pytest.LogCaptureFixture
) -> None:
    retrying = threading.Event()

    class Retried(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "retrying" in record.getMessage():
                retrying.set()

    caplog.set_level(logging.DEBUG, logger=connection_module.__name__)
    handler = Retried()
    connection_module.log.addHandler(handler)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(sock))
    listener.listen(0)
    queued: list[socket.socket] = []
    result: dict[str, Any] = {}
    try:
        while True:  # fill the backlog until the kernel answers EAGAIN
            conn = socket.socket(socket.AF_UNIX)
            conn.setblocking(False)
            queued.append(conn)
            try:
                conn.connect(str(sock))
            except BlockingIOError:
                break
        worker = threading.Thread(target=lambda: result.update(conn=client_connect(sock, timeout=10.0)))
        worker.start()
        assert retrying.wait(10), "a connect refused by a full backlog should be retried"
        accepted = [listener.accept()[0] for _ in queued[:-1]]
        worker.join(10)
        assert isinstance(result.get("conn"), socket.socket)
        result["conn"].close()
        for conn in accepted:
            conn.close()
    finally:
        connection_module.log.removeHandler(handler)
        for conn in queued:
            conn.close()
        listener.close()
