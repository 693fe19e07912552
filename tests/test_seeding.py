"""Seeding: a daemon fills its arena from a peer daemon (real daemons, real TCP through a real proxy, a real etcd
for the placement), and the pure parts (the choice of source, the fan-out) table-tested."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import re
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from hotweights.cache.connection import request
from hotweights.cache.diskio import disk_read_bytes, evict
from hotweights.cache.protocol import ProtocolError, recv_message, send_message
from hotweights.cache.seedtransport import (
    SEED_VERSION,
    RangeSink,
    TcpChannel,
    TcpTransport,
    proof,
    proof_matches,
    split_address,
)
from hotweights.chaos.proxy import DelayProxy
from hotweights.controller.clusterctl import render_seed
from hotweights.controller.config import load_config
from hotweights.controller.dcs import EtcdLeadership
from hotweights.controller.engineapi import EngineApi
from hotweights.controller.seedplacement import (
    SeedRecord,
    SeedState,
    choose_sources,
    copy_times_bound,
    simulate_fanout,
)
from hotweights.controller.stack import Layout
from hotweights.errors import ConfigError
from hotweights.ports import free_port
from hotweights.waiting import wait_until
from tests.cachehelpers import ENV, ProcessDaemon, ThreadDaemon
from tests.etcdhelpers import etcd_cluster, needs_etcd

if TYPE_CHECKING:  # they import torch: on first use only (tests/conftest.py)
    from hotweights.cache.fingerprint import Fingerprint
    from hotweights.cache.recovery import Filled
    from hotweights.cache.seedserver import SeedServer

SERVING, SEEDING, FILLING = SeedState.SERVING, SeedState.SEEDING, SeedState.FILLING
DCS = '[dcs]\netcd = ["http://127.0.0.1:2379"]\n[seeding]\n'
SERVES_WITHIN_S = 2.0  # from the copy's last byte to the daemon serving


def rec(host: str, state: SeedState = SERVING, source: str = "", group: int = 0, rank: int = 0) -> SeedRecord:
    return SeedRecord(host, group, rank, f"{host}:1", state, source=source)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("records", "me", "max_clients", "expected"),
    [
        ([], "new", 1, []),  # nobody serves: the daemon fills from its snapshot or checkpoint
        ([rec("new")], "new", 1, []),  # never ourselves
        ([rec("a", group=1), rec("b", rank=1)], "new", 1, []),  # another group's or rank's weights
        ([rec("a", FILLING), rec("b", SEEDING, "c:1")], "new", 1, []),  # not serving yet
        ([rec("a"), rec("b"), rec("x", SEEDING, "a:1")], "new", 1, ["b:1", "a:1"]),  # the free one first, busy last
        ([rec("a"), rec("b"), rec("x", SEEDING, "a:1"), rec("y", SEEDING, "b:1"), rec("z", SEEDING, "b:1")],
         "new", 3, ["a:1", "b:1"]),  # both free: fewer copies first
        ([rec("a"), rec("b"), rec("new", SEEDING, "a:1"), rec("x", SEEDING, "b:1")], "new", 1, ["a:1", "b:1"]),
        # our own copy does not count against the source we copy from
    ],
)  # fmt: skip
def test_the_source_is_a_serving_peer_of_the_same_weights_least_busy_first(
    records: list[SeedRecord], me: str, max_clients: int, expected: list[str]
) -> None:
    assert choose_sources(records, me, 0, 0, max_clients) == expected


@pytest.mark.unit
def test_joiners_reading_the_same_records_spread_over_equal_sources() -> None:
    sources = [rec(name) for name in "abcd"]
    firsts = {choose_sources(sources, f"joiner{i}", 0, 0, 1)[0] for i in range(32)}
    assert firsts == {"a:1", "b:1", "c:1", "d:1"}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("hosts", "max_clients", "copy_times", "first_marks"),
    [(1000, 1, 10, [2, 4, 8, 16]), (2, 1, 1, [2]), (5, 1, 3, [2, 4, 5]), (9, 2, 4, [1, 3, 3, 9])],
)
def test_the_fan_out_is_a_tree(hosts: int, max_clients: int, copy_times: float, first_marks: list[int]) -> None:
    fanout = simulate_fanout(hosts, max_clients)
    assert fanout.copy_times == copy_times and fanout.seeded_at[: len(first_marks)] == first_marks
    assert fanout.seeded_at[-1] == hosts and fanout.max_copies_per_source == max_clients
    if max_clients == 1:
        assert fanout.copy_times <= copy_times_bound(hosts)


@pytest.mark.unit
def test_each_end_proves_the_token_bound_to_its_role_and_both_nonces() -> None:
    good = proof("token", "client", "n1", "n2")
    assert proof_matches(good, proof("token", "client", "n1", "n2"))
    for other in (proof("tokem", "client", "n1", "n2"), proof("token", "server", "n1", "n2"),
                  proof("token", "client", "n1", "n3"), None, 7):  # fmt: skip
        assert not proof_matches(other, good)


@pytest.mark.unit
def test_status_shows_a_copy_s_progress_and_rate() -> None:
    copying = SeedRecord("d", 0, 0, "127.0.0.5:8300", SEEDING, source="127.0.0.2:8300", bytes_done=5 * 10**8,
                         bytes_total=2 * 10**9, rate_gbps=3.25)  # fmt: skip
    assert render_seed(copying.to_json()) == (
        "  d g0 r0 127.0.0.5:8300: seeding from 127.0.0.2:8300 25% (0.50 of 2.00 GB) at 3.25 GB/s"
    )
    assert render_seed(rec("a").to_json()) == "  a g0 r0 a:1: serving"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("table", "refusal"),
    [
        ("", "seeding.enabled needs [dcs]"),
        (DCS, "seeding.token_file is empty"),
        (DCS + 'token_file = "/nonexistent/seed.token"\n', "seeding.token_file"),
        (DCS + 'token_file = "{token}"\nport = 70000\n', "seeding.port 70000 gives ports up to 70000"),
        (DCS + 'token_file = "{token}"\nmax_clients = 0\n', "seeding.max_clients must be >= 1, found 0"),
    ],
)
def test_a_bad_seeding_table_is_refused_in_one_line(tmp_path: Path, table: str, refusal: str) -> None:
    token = tmp_path / "seed.token"
    token.write_text("t0ken\n")
    dcs, seeding = table.split("[seeding]\n") if "[seeding]" in table else ("", table)
    path = tmp_path / "cluster.toml"
    path.write_text(f"{dcs}[seeding]\nenabled = true\n{seeding.format(token=token)}")
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        load_config(path)


# --- real daemons -------------------------------------------------------------------------------------------


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "seed.token"
    path.write_text(uuid.uuid4().hex + "\n")
    path.chmod(0o600)
    return path


def spawn(daemon: ProcessDaemon) -> ProcessDaemon:
    """Started, not waited for."""
    daemon.process = subprocess.Popen(daemon.command, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return daemon


def status(daemon: ProcessDaemon) -> dict:
    return request(daemon.paths.socket, {"op": "status"})["status"]


def progress(daemon: ProcessDaemon) -> dict:
    try:
        return json.loads(daemon.paths.seeding.read_text())
    except (FileNotFoundError, ValueError):
        return {}


def last_line(daemon: ProcessDaemon) -> str:
    """The last line of a daemon that could not fill, after its exit code 2."""
    assert daemon.process is not None and daemon.process.wait(timeout=60) == 2
    return daemon.process.stderr.read().decode().strip().splitlines()[-1]


def test_a_peer_with_a_wrong_token_or_other_weights_is_refused_in_one_line(
    tiny_model: Path, tmp_path: Path, token_file: Path
) -> None:
    port = free_port()
    wrong = tmp_path / "wrong.token"
    wrong.write_text("not-the-token\n")
    peer = ["--seed-from", f"127.0.0.1:{port}", "--fill-from", "peer"]
    with ProcessDaemon(tiny_model, tmp_path / "a.sock", "--seed-listen", f"127.0.0.1:{port}", "--seed-token-file",
                       str(token_file)) as source:  # fmt: skip
        stranger = spawn(ProcessDaemon(tiny_model, tmp_path / "b.sock", *peer, "--seed-token-file", str(wrong)))
        other = spawn(ProcessDaemon(tiny_model, tmp_path / "c.sock", *peer, "--seed-token-file", str(token_file),
                                    "--dtype", "bf16"))  # fmt: skip
        token_line, weights_line = last_line(stranger), last_line(other)
        reader = read_without_the_token(port)
        refused = status(source)["seeding"]
    assert "every source in ['peer'] refused" in token_line and "does not know the seeding token" in token_line
    assert "serves other weights" in weights_line and "dtype" in weights_line, weights_line
    assert reader == {"ok": False, "error": "forbidden", "message": "wrong seeding token"}
    assert refused["refused"] == 2 and refused["bytes_sent"] == 0 and refused["sessions"] == 0


def read_without_the_token(port: int) -> dict:
    """A stranger that goes on after the server's proof, with a made-up one of its own: the server's answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        send_message(conn, {"op": "seed_hello", "version": SEED_VERSION, "nonce": "n"})
        recv_message(conn)
        send_message(conn, {"op": "seed_auth", "proof": "0" * 64, "fingerprint": {}, "session": "s", "listen": ""})
        return recv_message(conn)[0]


class LyingPeer:
    """A peer that knows the token and the manifest of the weights, and sends zeros for every range."""

    def __init__(self, token: str, manifest: dict) -> None:
        self.token, self.manifest = token, manifest
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        with contextlib.suppress(OSError, ProtocolError), self.listener.accept()[0] as conn:
            hello = recv_message(conn)[0]
            send_message(conn, {"ok": True, "version": SEED_VERSION, "nonce": "s",
                                "proof": proof(self.token, "server", hello["nonce"], "s")})  # fmt: skip
            recv_message(conn)
            send_message(conn, {"ok": True, "manifest": self.manifest})
            while True:
                asked = recv_message(conn)[0]
                send_message(conn, {"ok": True, "start": asked["start"], "end": asked["end"]})
                conn.sendall(bytes(asked["end"] - asked["start"]))


def test_bytes_that_do_not_hash_to_the_peers_manifest_are_never_served(
    tiny_model: Path, tmp_path: Path, token_file: Path
) -> None:
    with ThreadDaemon(tiny_model, tmp_path / "t.sock") as truth:
        liar = LyingPeer(token_file.read_text().strip(), truth.manifest)
        joiner = spawn(ProcessDaemon(tiny_model, tmp_path / "b.sock", "--seed-from", liar.address, "--seed-streams",
                                     "1", "--seed-token-file", str(token_file), "--fill-from", "peer"))  # fmt: skip
        line = last_line(joiner)
    assert "hash to" in line and f"its manifest says {truth.manifest['content_hash']}: refused, nothing served" in line
    assert not joiner.paths.ready.exists() and progress(joiner)["state"] == "failed"


@contextlib.contextmanager
def proxy_to(port: int) -> Iterator[Callable[[], None]]:
    """A real TCP proxy in front of ``port`` (on a loop of its own); yields its port and a function that cuts
    every connection through it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def run(coroutine: Awaitable) -> object:
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(10)

    proxy = run(DelayProxy(port).start())
    try:
        yield proxy.port, lambda: run(proxy.reset())
    finally:
        run(proxy.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_a_connection_dropped_mid_copy_resumes_with_the_missing_bytes_only(
    tiny_model: Path, tmp_path: Path, token_file: Path
) -> None:
    port, token = free_port(), ["--seed-token-file", str(token_file)]
    # paced at 5 MB/s, so that the copy of the tiny model (7 MB) is cut in its middle
    with ProcessDaemon(tiny_model, tmp_path / "a.sock", "--seed-listen", f"127.0.0.1:{port}", *token,
                       "--seed-rate-gbps", "0.005") as source, proxy_to(port) as (proxied, cut):  # fmt: skip
        joiner = spawn(ProcessDaemon(tiny_model, tmp_path / "b.sock", "--seed-from", f"127.0.0.1:{proxied}", *token,
                                     "--fill-from", "peer", "--seed-streams", "2"))  # fmt: skip
        try:
            seen = wait_until(lambda: 0 < progress(joiner).get("bytes_done", 0) < progress(joiner)["bytes_total"],
                              30, "the copy under way")  # fmt: skip
            cut()
            wait_until(lambda: joiner.serving() or joiner.process.poll() is not None, 60, "the joiner serving")
            assert joiner.process.poll() is None, joiner.process.stderr.read().decode()
            done, filled = progress(joiner), status(joiner)
            assert filled["content_hash"] == status(source)["content_hash"] and filled["fill"]["source"] == "peer"
        finally:
            joiner.__exit__()
    assert seen and done["resumes"] >= 1 and done["state"] == "done"
    assert done["bytes_done"] == done["bytes_total"]  # nothing received twice: the rest of each range, not all of it


# --- the sending paths, on a server in this process ----------------------------------------------------------

ARENA_BYTES = (3 << 20) + 12345  # four ranges of SMALL_CHUNK, the last one short
SMALL_CHUNK, SMALL_PIECE = 1 << 20, 96 << 10  # ranges of 11 pieces, the last one short: the ring of 4 wraps


class Served:
    """A seeding server in this process, serving a frozen cpu-shm arena of ARENA_BYTES random bytes; ``staged``:
    through the staging ring with acknowledgements (the device's path, on a host arena)."""

    def __init__(self, staged: bool) -> None:
        import torch

        from hotweights.cache.backends import get_backend
        from hotweights.cache.digest import content_hash
        from hotweights.cache.seeding import SeedOptions
        from hotweights.cache.seedserver import SeedServer

        self.token, self.fingerprint = uuid.uuid4().hex, made_up_fingerprint()
        self.arena = get_backend("cpu-shm").allocate(ARENA_BYTES, torch.device("cpu"))
        random = torch.Generator().manual_seed(7)
        self.arena.tensor[:ARENA_BYTES] = torch.randint(0, 256, (ARENA_BYTES,), dtype=torch.uint8, generator=random)
        self.arena.freeze()
        self.expected = self.arena.tensor[:ARENA_BYTES].clone()
        manifest = {"used_bytes": ARENA_BYTES, "fingerprint": self.fingerprint.to_json(),
                    "content_hash": content_hash(self.arena.tensor, ARENA_BYTES)}  # fmt: skip
        self.address = f"127.0.0.1:{free_port()}"
        self.server: SeedServer = SeedServer.bind(SeedOptions(listen=self.address, token=self.token))
        self.server.serve(self.fingerprint, manifest, self.arena.tensor, staged=staged)

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.close()
        self.arena.close()

    def copied_exactly(self, transport: TcpTransport | None = None) -> bool:
        """Whether a new arena seeded from this server has its bytes (the content hash checked on the way)."""
        filled = seed(self.address, self.token, transport)
        try:
            return bool(filled.arena.tensor[:ARENA_BYTES].equal(self.expected))
        finally:
            filled.arena.close()


def seed(address: str, token: str, transport: TcpTransport | None = None) -> Filled:
    """A new arena of ``made_up_fingerprint`` seeded from ``address`` over two streams (a ``peer`` fill)."""
    import torch

    from hotweights.cache.backends import get_backend
    from hotweights.cache.seeding import SeedOptions, seed_arena

    options = SeedOptions(sources=address, token=token, streams=2)
    return seed_arena(options, made_up_fingerprint(), get_backend("cpu-shm"), torch.device("cpu"), transport=transport)


def made_up_fingerprint() -> Fingerprint:
    from dataclasses import fields

    from hotweights.cache.fingerprint import Fingerprint

    return Fingerprint(**{f.name: 0 if f.type == "int" else "seeding-test" for f in fields(Fingerprint)})


@pytest.fixture
def sendfile_bytes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes each os.sendfile call of this process sent, in order (the real call underneath)."""
    sent: list[int] = []
    real = os.sendfile

    def counted(*args: int) -> int:
        sent.append(real(*args))
        return sent[-1]

    monkeypatch.setattr(os, "sendfile", counted)
    return sent


@pytest.mark.parametrize(("staged", "by_sendfile"), [(False, 0), (True, ARENA_BYTES)], ids=["host", "staged"])
def test_staged_bytes_leave_by_sendfile_a_host_arena_s_from_its_mapping_both_exactly(
    staged: bool, by_sendfile: int, sendfile_bytes: list[int]
) -> None:
    with Served(staged) as served:
        assert served.copied_exactly()
    assert sum(sendfile_bytes) == by_sendfile  # staged: every byte, none copied into the socket


def test_where_sendfile_cannot_send_the_staged_bytes_are_copied_into_the_socket(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unable(*args: int) -> int:
        raise OSError(errno.EINVAL, "sendfile: not from this file")

    monkeypatch.setattr(os, "sendfile", unable)
    with Served(staged=True) as served:
        assert served.copied_exactly()
        assert served.server.reader is not None and not served.server.reader.zero_copy


class DroppingTransport(TcpTransport):
    """Real TCP channels; the first that reads the range starting at ``at`` drops its connection once ``after``
    bytes of it arrived. Records every range asked for."""

    def __init__(self, at: int, after: int) -> None:
        self.at, self.after, self.dropped = at, after, False
        self.asked: list[tuple[int, int]] = []

    def connect(self, address: str) -> TcpChannel:
        return DroppingChannel(address, self)


class DroppingChannel(TcpChannel):
    def __init__(self, address: str, transport: DroppingTransport) -> None:
        super().__init__(address)
        self.transport = transport

    def read_range(self, start: int, end: int, sink: RangeSink, progress: Callable[[int], None]) -> None:
        transport, moved = self.transport, [0]
        transport.asked.append((start, end))

        def counted(n: int) -> None:
            moved[0] += n
            progress(n)
            if start == transport.at and moved[0] >= transport.after and not transport.dropped:
                transport.dropped = True
                self.sock.close()  # bytes unread in its buffer: the server's end is reset

        super().read_range(start, end, sink, counted)


def test_staged_pieces_are_acknowledged_over_many_ranges_and_a_range_cut_midway_resumes_from_its_cut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hotweights.cache import seeding, seedserver

    monkeypatch.setattr(seeding, "CHUNK_BYTES", SMALL_CHUNK)
    monkeypatch.setattr(seedserver, "PIECE_BYTES", SMALL_PIECE)  # the server's pieces, and what each ack is for
    transport = DroppingTransport(at=SMALL_CHUNK, after=3 * SMALL_PIECE)
    with Served(staged=True) as served:
        assert served.server.reader is not None and served.server.reader.ack == SMALL_PIECE
        assert served.copied_exactly(transport)
    resumed = [(start, end) for start, end in transport.asked if SMALL_CHUNK < start < 2 * SMALL_CHUNK]
    assert transport.dropped and resumed and resumed[0][1] == 2 * SMALL_CHUNK
    assert resumed[0][0] >= SMALL_CHUNK + 3 * SMALL_PIECE  # the rest of the range, not all of it
    assert len(transport.asked) == 5  # four ranges, one of them twice


def test_a_peer_of_another_seeding_protocol_version_is_refused_in_one_line() -> None:
    from hotweights.cache.recovery import SourceRefused

    with Served(staged=False) as served, socket.create_connection(split_address(served.address)) as conn:
        send_message(conn, {"op": "seed_hello", "version": 1, "nonce": "n"})  # a client of version 1
        refusal = recv_message(conn, deadline=time.monotonic() + 10)[0]
    assert refusal == {"ok": False, "error": "version_mismatch",
                       "message": "expected seed_hello of seeding protocol 2, found 'seed_hello' 1"}  # fmt: skip
    old = OldPeer()  # a server of version 1, to our client
    with pytest.raises(SourceRefused) as refused:
        seed(old.address, old.token)
    assert (
        str(refused.value) == f"{old.address}: seeding peer {old.address} speaks seeding protocol version 1, we speak 2"
    )


class OldPeer:
    """A seeding server of protocol version 1 that knows the token: answers one hello, then hangs up."""

    def __init__(self) -> None:
        self.token = "t0ken"
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        with contextlib.suppress(OSError, ProtocolError), self.listener, self.listener.accept()[0] as conn:
            nonce = recv_message(conn)[0]["nonce"]
            send_message(
                conn, {"ok": True, "version": 1, "nonce": "s", "proof": proof(self.token, "server", nonce, "s")}
            )


# --- placement in etcd mode ----------------------------------------------------------------------------------


def host_config(root: Path, index: int, etcd: str, prefix: str, model: Path, token_file: Path, seed_port: int) -> Path:
    """Simulated host ``index``: its own state dir and loopback address (127.0.0.<index + 2>), seeding on."""
    root.mkdir(parents=True)
    path = root / "cluster.toml"
    path.write_text(
        f'[cluster]\nname = "seed"\nstate_dir = "{root}/state"\n\n[model]\npath = "{model}"\n\n'
        f"[[groups]]\nengines = 1\nbase_port = {free_port()}\n\n"
        f'[dcs]\netcd = ["{etcd}"]\nprefix = "{prefix}"\nhost = "h{index}"\naddress = "127.0.0.{index + 2}"\n'
        f"ttl_s = 10\nloop_wait_s = 0.25\nretry_timeout_s = 0.5\n\n"
        f'[seeding]\nenabled = true\nport = {seed_port}\ntoken_file = "{token_file}"\n'
    )
    return path


async def until(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)  # the DCS refresh this waits on runs on this loop


@needs_etcd
def test_a_fourth_host_is_seeded_from_a_peer_without_reading_its_checkpoint(
    tiny_model: Path, tmp_path: Path, token_file: Path
) -> None:
    seed_port, prefix = free_port(), f"/t{uuid.uuid4().hex[:8]}"
    with etcd_cluster(1) as members:
        configs = [host_config(tmp_path / f"h{i}", i, members[0].url, prefix, tiny_model, token_file, seed_port)
                   for i in range(4)]  # fmt: skip
        layouts = [Layout.create(load_config(path), path) for path in configs]
        daemons = [ProcessDaemon(tiny_model, layout.socket(0)) for layout in layouts]
        for daemon, layout in zip(daemons, layouts, strict=True):
            daemon.command = layout.daemon_command(0)  # what the host's controller runs

        async def scenario() -> None:
            async with httpx.AsyncClient(trust_env=False) as client:
                hosts = [EtcdLeadership(load_config(path), client, EngineApi(client, None), layout)
                         for path, layout in zip(configs, layouts, strict=True)]  # fmt: skip
                try:
                    for host in hosts[:3]:
                        await host.start(lambda: None)
                    await asyncio.gather(*(asyncio.to_thread(daemon.start) for daemon in daemons[:3]))
                    serving = lambda: sum(r.state is SERVING for r in hosts[0].seeding.records)  # noqa: E731
                    await until(lambda: serving() == 3, 30, "three hosts serving in etcd")
                    evict(tiny_model.glob("*.safetensors"))  # a read of it would count in read_bytes
                    await hosts[3].start(lambda: None)  # lists the three peers in its daemon's sources file
                    await asyncio.to_thread(daemons[3].start)
                    await joined(daemons, hosts[3], tiny_model)
                finally:
                    for host in hosts:
                        await host.stop(revoke=True)

        try:
            asyncio.run(scenario())
        finally:
            for daemon in daemons:
                daemon.__exit__()


async def joined(daemons: list[ProcessDaemon], host: EtcdLeadership, model: Path) -> None:
    """The fourth daemon was seeded from a peer, read nothing from disk, served within SERVES_WITHIN_S of the copy's
    end, and is a source now."""
    joiner, shards = daemons[3], sum(shard.stat().st_size for shard in model.glob("*.safetensors"))
    filled, done = status(joiner), progress(joiner)
    # read_bytes of /proc/PID/io: around the fill (the daemon's own reading) nothing; over the whole process (its
    # imports too) less than the checkpoint, which is not in the page cache: no shard was read
    assert filled["fill"]["source"] == "peer" and filled["fill"]["disk_read_bytes"] == 0, filled["fill"]
    assert disk_read_bytes(joiner.process.pid) < shards
    assert filled["content_hash"] == status(daemons[0])["content_hash"]
    assert done["source"] in {status(d)["seeding"]["listen"] for d in daemons[:3]}
    assert joiner.paths.ready.stat().st_mtime - done["copied_at"] < SERVES_WITHIN_S
    await until(lambda: any(r.host == "h3" and r.state is SERVING for r in host.seeding.records), 30, "h3 a source")
