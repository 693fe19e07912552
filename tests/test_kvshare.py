"""KV caches that outlive their engine (standby.kvshare, cache.kvdeposits): the ledger's choice of a slot, the
daemon's deposits, and a continuation that starts from a hung and then a killed primary's keys and values."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from hotweights.cache.backends.cuda_vmm import _check
from hotweights.cache.cli import _format_status
from hotweights.cache.client import ReplyLate, attach
from hotweights.cache.connection import call, connect, request
from hotweights.cache.kvdeposits import MAX_RETAINED, MAX_SOURCES, KvLayout
from hotweights.cache.loadspec import LoadSpec
from hotweights.contract import REPLAY_HEADER, Endpoint
from hotweights.standby.kvpool import BLOCK_SIZE
from hotweights.standby.kvshare import KvShare, SlotLedger
from tests.cachehelpers import ProcessDaemon, ThreadDaemon, fingerprint_of, wait_until
from tests.enginehelpers import EngineProcess
from tests.gatewayhelpers import metric

SLOTS, POSITIONS = 3, 16
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEVICES = [pytest.param("cpu", id="cpu-shm"), pytest.param("cuda:0", id="cuda-vmm", marks=[pytest.mark.cuda, CUDA])]
TOKEN = "kv-share-token"
FLAGS = ("--kv-cache-tokens", "512", "--max-batch", "4", "--weight-cache", "client")


def ledger() -> SlotLedger:
    layout = KvLayout("float32", (1, 1 + SLOTS, BLOCK_SIZE, 1, 1), 0, SLOTS, POSITIONS)
    return SlotLedger(torch.zeros(layout.ledger_bytes, dtype=torch.uint8), layout)


# (what the slots hold: (slot, ids, prefilled), the request's ids, least, prefilled wanted, expected (slot, held))
BEST = [
    pytest.param([], [1, 2, 3], 1, None, None, id="empty"),
    pytest.param([(0, [1, 2, 3, 4, 5], 3)], [1, 2, 3, 4, 5, 6], 3, None, (0, 5), id="holds-all-but-the-last"),
    pytest.param([(0, [1, 2, 3, 4, 5], 3)], [1, 2, 3, 4, 5], 3, None, (0, 4), id="the-last-token-is-fed-again"),
    pytest.param([(0, [1, 2, 9, 9], 2)], [1, 2, 3, 4, 5], 2, None, (0, 2), id="diverges-after-two"),
    pytest.param([(0, [1, 2, 9, 9], 2)], [1, 2, 3, 4, 5], 3, None, None, id="diverges-before-least"),
    pytest.param([(0, [1, 2, 3, 4], 3)], [1, 2, 3, 4, 5], 3, 2, None, id="prefilled-otherwise"),
    pytest.param([(0, [1, 2, 3, 4], 3)], [1, 2, 3, 4, 5], 3, 3, (0, 4), id="prefilled-the-same"),
    pytest.param([(0, [1, 2, 3], 2), (2, [1, 2, 3, 4], 2)], [1, 2, 3, 4, 5], 2, None, (2, 4), id="the-longest"),
    pytest.param([(1, [7, 7, 7], 1)], [1, 2, 3, 4], 1, None, None, id="another-request"),
]


@pytest.mark.parametrize(("held", "ids", "least", "prefilled", "expected"), BEST)
def test_the_ledger_picks_the_slot_holding_the_longest_prefix(
    held: list, ids: list[int], least: int, prefilled: int | None, expected: tuple[int, int] | None
) -> None:
    book = ledger()
    for slot, tokens, first in held:
        book.record(slot, tokens, first, [1 + slot])
    best = book.best(torch.tensor(ids, dtype=torch.int32), least, prefilled)
    assert (best[:2] if best else None) == expected


def test_a_slot_given_up_or_being_given_up_is_never_picked() -> None:
    book = ledger()
    book.record(0, [1, 2, 3], 3, [1])
    book.append([0], [3], [4])
    ids = torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32)
    slot, held, generation, _ = book.best(ids, 1, None)
    assert (slot, held) == (0, 4)
    book.generation[0] += 1  # an owner killed at the start of a reset leaves the generation odd
    assert book.best(ids, 1, None) is None
    book.length[0] = 0  # the rest of the reset
    book.generation[0] += 1
    assert book.best(ids, 1, None) is None
    book.record(0, [1, 2, 3], 3, [2])
    assert book.best(ids, 1, None)[2] != generation  # a copy begun before the reset is refused afterwards
    book.reset(0)
    assert book.best(ids, 1, None) is None


@pytest.mark.parametrize(
    ("result", "raised"),
    [((2,), torch.OutOfMemoryError), ((1,), RuntimeError), ((0, 7), None)],
    ids=["out-of-memory", "another-error", "success"],
)
def test_a_driver_without_memory_raises_what_torchs_allocator_raises(result: tuple, raised: type | None) -> None:
    """A spare that finds no device memory for its KV cache warms up at its start instead (``prepare_spare``
    catches torch.OutOfMemoryError), whichever allocated it: torch, or the driver for a shared KV cache."""
    if raised is None:
        assert _check(result, "cuMemCreate") == 7
        return
    with pytest.raises(raised, match="cuMemCreate failed") as caught:
        _check(result, "cuMemCreate")
    assert isinstance(caught.value, torch.OutOfMemoryError) == (raised is torch.OutOfMemoryError)


@pytest.fixture(params=DEVICES)
def daemon(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[tuple[Path, str]]:
    """A daemon serving on the device of the param, with that device's default backend."""
    device = request.param
    runtime = Path(tempfile.mkdtemp(prefix="hw-", dir="/tmp"))  # socket paths must stay short
    backend = "cuda-vmm" if device.startswith("cuda") else "cpu-shm"
    try:
        with ThreadDaemon(tiny_model, runtime / "d.sock", spec=LoadSpec(device=device), backend=backend):
            yield runtime / "d.sock", device
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def shares(model: Path, daemon: tuple[Path, str], count: int) -> list[KvShare]:
    sock, device = daemon
    expected = fingerprint_of(model, device)
    return [KvShare(attach(sock, expected, device), torch.device(device)) for _ in range(count)]


def deposits(share: KvShare) -> list[tuple[bool, int]]:
    """(alive, slots) of every deposit the daemon holds, as its status says."""
    status = share.attachment.call({"op": "status"})[0]["status"]
    return [(d["alive"], d["slots"]) for d in status["kv_deposits"]]


def test_a_deposit_outlives_its_engine_until_released_and_only_the_newest_are_kept(
    tiny_model: Path, daemon: tuple[Path, str]
) -> None:
    """An engine's deposited slot is found and copied by another while its connection lives and after it closed
    (with the other's keys and values, block by block into the blocks the adopter gives it); released, or beyond
    MAX_RETAINED closed ones, it is gone."""
    owner, adopter, *others = shares(tiny_model, daemon, 3 + MAX_RETAINED)
    shape = (2, 2 + SLOTS, BLOCK_SIZE, 2, 4)  # (layers, blocks, block size, kv heads, head dim)
    deposited = owner.allocate(shape, SLOTS, POSITIONS, torch.float32)
    deposited.kv.k.normal_()
    deposited.kv.v.normal_()
    deposited.ledger.record(1, [5, 6, 7, 8], 2, [3])
    owner.deposit(deposited).result()
    own = adopter.allocate(shape, SLOTS, POSITIONS, torch.float32).kv
    assert own.k.device == deposited.kv.k.device == torch.device(daemon[1])
    for alive in (True, False):
        if not alive:
            owner.attachment.close()  # the engine dies: its deposit is retained
            wait_until(lambda: deposits(adopter) == [(False, SLOTS)], what="the deposit retained")
            adopter._listed_at = float("-inf")  # list again now, not REFRESH_S later
        match = adopter.find([5, 6, 7, 8, 9], 2, 2, own)
        assert (match.slot, match.length, match.source.alive) == (1, 4, alive)
        assert adopter.copy(match, own, [2, 1])
        assert torch.equal(own.k[:, 2, :4], deposited.kv.k[:, 3, :4])
        assert torch.equal(own.v[:, 2, :4], deposited.kv.v[:, 3, :4])
        own.k.zero_()
    adopter._used_at = float("-inf")
    adopter.idle()  # unmaps, and releases the failed engine's deposit it used
    assert deposits(adopter) == []
    for other in others:
        other.deposit(other.allocate(shape, SLOTS, POSITIONS, torch.float32)).result()
        other.attachment.close()
    wait_until(lambda: deposits(adopter) == [(False, SLOTS)] * MAX_RETAINED, what="the newest deposits retained")
    adopter.attachment.close()


def test_a_failed_engines_deposit_is_dropped_once_its_retention_ends(tiny_model: Path) -> None:
    runtime = Path(tempfile.mkdtemp(prefix="hw-", dir="/tmp"))
    try:
        with ThreadDaemon(tiny_model, runtime / "d.sock", kv_retain_s=0.5):
            owner, watcher = shares(tiny_model, (runtime / "d.sock", "cpu"), 2)
            owner.deposit(owner.allocate((1, 2, BLOCK_SIZE, 1, 2), 1, 4, torch.float32)).result()
            owner.attachment.close()
            wait_until(lambda: deposits(watcher) == [], what="the deposit dropped after 0.5 s")
            watcher.attachment.close()
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_handed_over_deposit_is_kept_as_a_failed_engines_until_its_retention_ends(tiny_model: Path) -> None:
    """Handed over, an engine's deposit is no longer its own: its next deposit and its withdrawal leave it, it is
    listed as a closed connection's, and it is dropped once its retention ends."""
    runtime = Path(tempfile.mkdtemp(prefix="hw-", dir="/tmp"))
    try:
        with ThreadDaemon(tiny_model, runtime / "d.sock", kv_retain_s=1.0):
            owner, watcher = shares(tiny_model, (runtime / "d.sock", "cpu"), 2)
            owner.deposit(owner.allocate((1, 2, BLOCK_SIZE, 1, 2), 1, 4, torch.float32)).result()
            owner.hand_over().result()
            assert deposits(watcher) == [(False, 1)]
            owner.deposit(owner.allocate((1, 2, BLOCK_SIZE, 1, 2), 2, 4, torch.float32)).result()
            assert sorted(deposits(watcher)) == [(False, 1), (True, 2)]
            owner.withdraw().result()
            assert deposits(watcher) == [(False, 1)]
            wait_until(lambda: deposits(watcher) == [], what="the handed over deposit dropped after 1 s")
            owner.attachment.close()
            watcher.attachment.close()
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def test_deposits_need_an_attached_connection_and_a_refused_one_leaves_it_attached(
    tiny_model: Path, daemon: tuple[Path, str]
) -> None:
    with connect(daemon[0]) as conn:
        reply, _ = call(conn, {"op": "kv_sources"})
    assert (reply["ok"], reply["error"]) == (False, "forbidden")
    (share,) = shares(tiny_model, daemon, 1)
    reply, _ = share.attachment.call({"op": "kv_deposit", "layout": {"dtype": "float32"}, "kv": {}, "ledger": {}})
    assert (reply["ok"], reply["error"]) == (False, "bad_message")
    assert "2 file descriptors" in reply["message"]
    shared = share.allocate((1, 2, BLOCK_SIZE, 1, 2), 1, 4, torch.float32)
    (handle, fds), (ledger_handle, ledger_fds) = (arena.export() for arena in shared.arenas)
    bad = shared.layout.to_json() | {"v_offset": handle["nbytes"]}  # past the allocation
    message = {"op": "kv_deposit", "layout": bad, "kv": handle, "ledger": ledger_handle}
    reply, _ = share.attachment.call(message, (*fds, *ledger_fds))
    assert (reply["ok"], reply["error"]) == (False, "bad_message")
    assert "the KV allocation holds" in reply["message"], reply["message"]
    status = share.attachment.call({"op": "status"})[0]["status"]
    assert [c["attached"] for c in status["clients"]] == [True]
    assert deposits(share) == []
    share.deposit(shared).result()
    assert deposits(share) == [(True, 1)]
    share.attachment.close()


def test_a_daemon_slow_to_answer_a_kv_request_leaves_the_engine_attached(tiny_model: Path) -> None:
    """A stopped daemon's late reply is dropped ahead of the next request's, instead of detaching the engine; until
    it comes, requests fail at once; a deposit sent meanwhile is withdrawn once the daemon answers again."""
    runtime = Path(tempfile.mkdtemp(prefix="hw-", dir="/tmp"))
    try:
        with ProcessDaemon(tiny_model, runtime / "d.sock") as daemon:
            (share,) = shares(tiny_model, (runtime / "d.sock", "cpu"), 1)
            _stop(daemon.process.pid)
            shared = share.allocate((1, 2, BLOCK_SIZE, 1, 2), 1, 4, torch.float32)
            share.deposit(shared).result()  # sent; no reply in time
            assert share.deposited and share.attachment.waits_for_reply
            with pytest.raises(ReplyLate, match="has not answered an earlier request yet"):
                share.attachment.call({"op": "kv_sources"}, max_fds=2 * MAX_SOURCES)  # not sent: it would wait
            daemon.process.send_signal(signal.SIGCONT)
            status = wait_until(lambda: _answered(share, {"op": "status"}), what="the daemon answering again")
            assert [c["attached"] for c in status["status"]["clients"]] == [True]
            assert deposits(share) == [(True, 1)] and not share.attachment.waits_for_reply
            share.withdraw().result()
            assert deposits(share) == []
            _stop(daemon.process.pid)
            with pytest.raises(ReplyLate, match="no reply to 'kv_sources' in time"):
                share.attachment.call({"op": "kv_sources"}, max_fds=2 * MAX_SOURCES, timeout=0.2)
            daemon.process.send_signal(signal.SIGCONT)
            assert wait_until(lambda: _answered(share, {"op": "kv_sources"}), what="the next request answered")["ok"]
            share.attachment.close()
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def _stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until every thread of it has stopped (the signal takes effect asynchronously)."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: _thread_states(pid) == {"T"}, what=f"pid {pid} stopped")


def _thread_states(pid: int) -> set[str]:
    """The scheduler states of ``pid``'s threads (/proc/PID/task/*/stat)."""
    return {(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in Path(f"/proc/{pid}/task").iterdir()}


def _answered(share: KvShare, message: dict) -> dict | None:
    """The daemon's reply to ``message`` on ``share``'s attach connection; None while an earlier one is late."""
    try:
        return share.attachment.call(message)[0]
    except ReplyLate:
        return None


def status_text(sock: Path) -> str:
    """What ``hotweights cache status`` prints for the daemon on ``sock``."""
    return _format_status(request(sock, {"op": "status"})["status"])


@pytest.fixture(params=DEVICES)
def pair(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[tuple[EngineProcess, EngineProcess, Path]]:
    """Engines "a" (primary) and "b" (standby), both serving from one daemon's arena (on CUDA, each with its KV
    cache reserved at start-up and its CUDA graphs captured against it)."""
    runtime = Path(tempfile.mkdtemp(prefix="hw-", dir="/tmp"))
    sock = runtime / "d.sock"
    flags = (*FLAGS, "--socket", str(sock), "--device", request.param)
    try:
        with (
            ProcessDaemon(tiny_model, sock, "--device", request.param),
            EngineProcess(tiny_model, *flags, "--role", "primary", token=TOKEN) as a,
            EngineProcess(tiny_model, *flags, "--role", "standby", token=TOKEN) as b,
        ):
            yield a, b, sock
    finally:
        shutil.rmtree(runtime, ignore_errors=True)


def test_a_continuation_starts_from_the_hung_and_then_the_killed_primarys_keys_and_values(
    pair: tuple[EngineProcess, EngineProcess, Path],
) -> None:
    """A stream cut on "a" (SIGSTOP after its third chunk) continues on "b" from the tokens released, taking a's
    slot instead of computing it: the text is the uncut run's and b counts the tokens it adopted; once "a" is
    SIGKILLed too, its deposit is still there for the same continuation."""
    a, b, sock = pair
    body = {"prompt": "Keys and values outlive", "max_tokens": 400, "temperature": 0.0, "return_token_ids": True}
    whole = a.complete(**body).json()["choices"][0]
    with httpx.Client(base_url=a.url, timeout=30) as client, client.stream(
        "POST", Endpoint.COMPLETIONS, json=body | {"stream": True}
    ) as response:  # fmt: skip
        chunks = []
        for line in response.iter_lines():
            if line:
                chunks.append(json.loads(line.removeprefix("data: "))["choices"][0])
            if len(chunks) == 3:
                a.process.send_signal(signal.SIGSTOP)
                break
    prompt, released = chunks[0]["prompt_token_ids"], [i for c in chunks for i in c["token_ids"]]
    sent = "".join(c["text"] for c in chunks)
    assert b.post(Endpoint.PROMOTE).status_code == 200
    rest = body | {"prompt": prompt + released, "max_tokens": 400 - len(released)}
    for fault in (signal.SIGSTOP, signal.SIGKILL):
        if fault is signal.SIGKILL:
            a.process.kill()
            a.process.wait(timeout=10)
            wait_until(lambda: "KV caches deposited: 2 (1 of failed or demoted" in status_text(sock), what="a's kept")
        adopted = metric(b, "hotweights_engine_kv_adopted_tokens")
        answer = b.client.post(Endpoint.COMPLETIONS, json=rest, headers={REPLAY_HEADER: str(len(released))})
        assert answer.status_code == 200, answer.text
        assert sent + answer.json()["choices"][0]["text"] == whole["text"], fault.name
        assert metric(b, "hotweights_engine_kv_adopted_tokens") - adopted == len(prompt) + len(released) - 1


def cut_while_draining(engine: EngineProcess, body: dict) -> tuple[list[int], list[int], str]:
    """A stream of ``body`` from ``engine``, cut after its third chunk once ``engine`` drains (as the gateway cuts a
    switchover's streams); its prompt's ids, the token ids and the text it had sent. The drain has finished."""
    with ThreadPoolExecutor(1) as pool:
        with httpx.Client(base_url=engine.url, timeout=30) as client, client.stream(
            "POST", Endpoint.COMPLETIONS, json=body | {"stream": True}
        ) as response:  # fmt: skip
            lines = (line for line in response.iter_lines() if line)
            chunks = [json.loads(next(lines).removeprefix("data: "))["choices"][0] for _ in range(3)]
            drained = pool.submit(engine.post, Endpoint.DRAIN, json={"timeout_s": 60})
            wait_until(lambda: engine.client.get(Endpoint.PRIMARY).status_code == 503, what="the engine draining")
        assert drained.result().status_code == 200
    prompt, released = chunks[0]["prompt_token_ids"], [i for c in chunks for i in c["token_ids"]]
    return prompt, released, "".join(c["text"] for c in chunks)


def test_a_demoted_primary_hands_the_streams_cut_from_it_over_to_the_next(
    pair: tuple[EngineProcess, EngineProcess, Path],
) -> None:
    """A stream cut from "a" while it drains keeps its slot. Resumed, "a" gives it up; cut again and demoted, "a"
    hands its KV cache over to the daemon with that one slot, and "b", promoted, continues the stream from it as
    from a failed primary's: the text is the uncut run's, and b adopts every token the stream had sent."""
    a, b, sock = pair
    body = {"prompt": "Handed over", "max_tokens": 400, "temperature": 0.0, "return_token_ids": True}
    whole = a.complete(**body).json()["choices"][0]
    cut_while_draining(a, body)
    assert a.post(Endpoint.PROMOTE).json()["message"].startswith("resumed")
    prompt, released, sent = cut_while_draining(a, body)
    demoted = a.post(Endpoint.DEMOTE).json()
    assert demoted["kv_slots_handed_over"] == 1, demoted
    assert "the slots of 1 cut request(s) handed over" in demoted["message"]
    wait_until(lambda: "KV caches deposited: 1 (1 of failed or demoted" in status_text(sock), what="a's handed over")
    assert b.post(Endpoint.PROMOTE).status_code == 200
    rest = body | {"prompt": prompt + released, "max_tokens": 400 - len(released)}
    answer = b.client.post(Endpoint.COMPLETIONS, json=rest, headers={REPLAY_HEADER: str(len(released))})
    assert answer.status_code == 200, answer.text
    assert sent + answer.json()["choices"][0]["text"] == whole["text"]
    assert metric(b, "hotweights_engine_kv_adopted_tokens") == len(prompt) + len(released) - 1
