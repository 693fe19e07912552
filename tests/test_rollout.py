"""``hotweights rollout`` / ``POST /rollout``: every engine of a group restarted one at a time on a real
stack, under load through the gateway, with new engine settings from cluster.toml; refusals up front."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import shutil
import signal
import struct
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from hotweights.cache.checkpoint import parse_config
from hotweights.chaos import memory
from hotweights.chaos.load import MAX_TOKENS, PROMPT
from hotweights.contract import Endpoint
from hotweights.controller.config import EngineSection, GroupSection, load_config, rollout_changes
from hotweights.controller.supervisor import read_identity
from hotweights.errors import ConfigError
from hotweights.layout import checkpoint_tensors
from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV
from tests.conftest import make_checkpoint
from tests.controllerhelpers import ControllerStack, completion_text, gateway_load, split_brain_watch, wait_until
from tests.enginehelpers import reference_completer

RPS = 10.0
# A model update loads a second arena and restarts every engine beside the load: on two cores shared with another
# test worker, 10 requests/s filled the test engines' queue (two slots) now and then, so it runs at a rate they keep.
MODEL_UPDATE_RPS = 6.0


def _flag(pid: int, flag: str) -> str:
    """The value of ``flag`` on process ``pid``'s command line."""
    words = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return words[words.index(flag) + 1]


def test_rollout_changes_name_the_engine_settings_and_refuse_the_rest() -> None:
    old = load_config(None)
    new = replace(old, engine=EngineSection(max_batch=8), groups=(GroupSection(start_timeout_s=30.0),))
    assert rollout_changes(old, new) == ["engine.max_batch", "groups[0].start_timeout_s"]
    assert rollout_changes(old, old) == []
    with pytest.raises(ConfigError, match=r"groups\[0\].base_port changed; a rollout applies only \[engine\]"):
        rollout_changes(old, replace(old, groups=(GroupSection(base_port=9300),)))


def test_a_rollout_under_load_restarts_every_engine_with_no_client_error(tiny_model: Path) -> None:
    # Each restarted engine's start (torch import, attach, warm-up) takes a core for seconds; on two shared
    # cores that can starve the primary past 2 checks of 500 ms, and a primary that fails its checks aborts
    # the rollout (the loop must be free to fail over). Four in a row: 2 s unanswered. A host stalled that long hands
    # the primary its held load at once, which its queue takes (owed, or within the shipped queue budget).
    stack = ControllerStack(tiny_model, failure_threshold=4)
    try:
        stack.start_controller("up")
        before = stack.wait_steady()
        gateway = f"http://127.0.0.1:{stack.config.gateway.port}"
        stack.config_path.write_text(stack.config_path.read_text().replace("max_batch = 2", "max_batch = 3"))
        urls = [m["url"] for m in before.values()]
        with gateway_load(gateway, RPS) as load, split_brain_watch(urls) as detector:
            cli = subprocess.Popen(
                hotweights_command("rollout", "--config", str(stack.config_path)),
                env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            running = wait_until(
                lambda: cli.poll() is not None or [r for r in stack.cluster()["rollouts"] if r["step"]],
                60,
                "a running rollout",
            )
            assert running is not True, cli.communicate()
            assert running[0]["group"] == 0 and running[0]["steps"] == 4 and running[0]["started"]
            second = stack.client.post(Endpoint.ROLLOUT, json={})
            out, err = cli.communicate(timeout=240)
        assert second.status_code == 409 and "already running" in second.json()["detail"], second.text
        assert cli.returncode == 0, out + err
        assert "step 1 of 4 (restart" in out and "step 3 of 4 (switchover" in out and "rolled out group 0" in out
        after = stack.wait_steady()
        assert all(after[i]["pid"] != before[i]["pid"] for i in before), (before, after)
        assert all(_flag(m["pid"], "--max-batch") == "3" for m in after.values())
        failures = [r.error or r.status for r in load.records if not r.ok]
        steps = [e for e in stack.events("rollout") if e["step"] in ("restart", "switchover")]
        took = ", ".join(f"{e['step']} {e['member']} {e['total_ms']:.0f} ms" for e in steps)
        print(f"\nrollout under {RPS:g} req/s: {len(load.records)} requests, {len(failures)} client errors ({took})")
        assert failures == [] and len(load.records) > 20, f"{len(failures)} failed: {sorted(set(failures))}"
        assert detector.sweeps > 100 and detector.samples == [], f"split brain: {detector.samples}"
        assert [e["index"] for e in steps] == [1, 2, 3, 4] and all(e["total_ms"] > 0 for e in steps)
        assert stack.events("rollout")[-1]["step"] == "done"
    finally:
        stack.close()


def test_a_failed_step_aborts_the_rollout_and_the_group_keeps_serving(tiny_model: Path) -> None:
    stack = ControllerStack(tiny_model, engines=2)
    try:
        stack.start_controller()
        before = stack.wait_steady()
        primary = stack.primary()
        standby = next(m for m in before.values() if m["role"] == "standby")
        cli = subprocess.Popen(
            hotweights_command("rollout", "--config", str(stack.config_path)),
            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        restarted = wait_until(
            lambda: (pid := stack.members()[standby["id"]]["pid"]) not in (None, standby["pid"]) and pid,
            60,
            "the standby's restart",
            interval=0.01,
        )
        os.kill(restarted, signal.SIGKILL)  # before it is ready: its start takes seconds
        out, err = cli.communicate(timeout=120)
        assert cli.returncode == 1, out + err
        assert f"aborted at step 1 of 3 (restart {standby['id']})" in err and "keeps serving" in err, err
        assert stack.primary()["pid"] == primary["pid"]
        assert stack.engine_primary_status(primary["url"]) == 200
        aborted = stack.events("rollout")[-1]
        assert aborted["step"] == "aborted" and aborted["member"] == standby["id"], aborted
        assert "aborted at step 1 of 3" in out  # printed as it happened, too
        after = stack.wait_steady()  # the loop restarts the standby that did not come back
        assert after[primary["id"]]["pid"] == primary["pid"] and stack.cluster()["rollouts"] == []
    finally:
        stack.close()


def sparse_checkpoint(out: Path, like: Path, hidden: int, intermediate: int) -> Path:
    """A valid checkpoint too big for this machine that takes no disk: ``like``'s tokenizer and config with
    larger shapes, one safetensors file whose header is real and whose data is a hole (a sparse file)."""
    shutil.copytree(like, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    config = json.loads((out / "config.json").read_text()) | {"hidden_size": hidden, "intermediate_size": intermediate}
    (out / "config.json").write_text(json.dumps(config))
    header, offset = {}, 0
    for spec in checkpoint_tensors(parse_config(config, out / "config.json")[0]):
        size = 4 * math.prod(spec.shape)
        header[spec.name] = {"dtype": "F32", "shape": list(spec.shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return out


def test_a_model_update_under_load_switches_the_answers_once_and_frees_the_old_arena(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    new_model = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-seed1", seed=1)
    new_text = reference_completer(new_model)(PROMPT, MAX_TOKENS, temperature=0.0)[0]
    stack = ControllerStack(tiny_model, failure_threshold=4)  # see the rollout test above
    try:
        stack.start_controller("up")
        before = stack.wait_steady()
        old_daemon = stack.daemon()
        gateway = f"http://127.0.0.1:{stack.config.gateway.port}"
        urls = [m["url"] for m in before.values()]
        with gateway_load(gateway, MODEL_UPDATE_RPS, also=(new_text,)) as load, split_brain_watch(urls) as detector:
            assert load.reference != new_text, "the two models must answer differently"
            cli = subprocess.run(
                hotweights_command("rollout", "--config", str(stack.config_path), "--model", str(new_model)),
                env=ENV, capture_output=True, text=True, timeout=300,
            )  # fmt: skip
            wait_until(lambda: sum(r.text == new_text for r in load.records) >= 10, 60, "answers from the new model")
        assert cli.returncode == 0, cli.stdout + cli.stderr
        assert "step 1 of 6 (load" in cli.stdout and "step 6 of 6 (retire" in cli.stdout, cli.stdout
        answers = [r.text for r in sorted(load.records, key=lambda r: r.end) if r.ok]
        switches = sum(a != b for a, b in itertools.pairwise(answers))
        failures = [r.error or r.status for r in load.records if not r.ok]
        rate = f"{MODEL_UPDATE_RPS:g} req/s"
        print(f"\nmodel update under {rate}: {len(load.records)} requests, {len(failures)} client errors")
        assert failures == [] and answers[0] == load.reference and answers[-1] == new_text and switches == 1
        assert detector.sweeps > 100 and detector.samples == [], f"split brain: {detector.samples}"
        after = stack.wait_steady()
        assert all(m["generation"] == 1 and m["pid"] != before[i]["pid"] for i, m in after.items()), after
        assert stack.cluster()["generations"] == [
            {"group": 0, "generation": 1, "model": str(new_model.resolve()), "served": True}
        ]
        daemons = [s for s in stack.cluster()["services"] if s["kind"] == "daemon"]
        assert [(d["id"], d["serving"]) for d in daemons] == [("g0-cache-gen1", True)]
        assert read_identity(old_daemon["pid"]) is None, "the old generation's daemon still runs"
        assert memory.snapshot((str(stack.root),)).arenas == 1  # the old arena is gone with its last engine
        stack.kill_controller()  # a restarted controller keeps the generation
        stack.start_controller("up")
        assert all(m["generation"] == 1 for m in stack.wait_steady().values())
        assert stack.daemon()["id"] == "g0-cache-gen1"
    finally:
        stack.close()


def test_a_model_update_whose_engines_fail_before_serving_reverts_to_the_old_weights(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """NEW loads, but no engine comes up on it (each is SIGKILLed as soon as it appears, as an engine that runs
    out of memory would die): the update aborts, the group goes back to its old generation, its standbys restart
    on the old weights and NEW's daemon is retired; the answers never changed."""
    new_model = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-seed3", seed=3)
    stack = ControllerStack(tiny_model, engines=2)  # the update aborts at its first restart: one standby is enough
    try:
        stack.start_controller("up")
        before = stack.wait_steady()
        primary = stack.primary()
        gateway = f"http://127.0.0.1:{stack.config.gateway.port}"
        reference = completion_text(gateway)
        killed: set[int] = set()
        stop = threading.Event()

        def kill_new_engines() -> None:
            while not stop.is_set():
                for m in stack.members().values():
                    if m["generation"] == 1 and m["pid"] and m["pid"] not in killed:
                        killed.add(m["pid"])
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(m["pid"], signal.SIGKILL)
                stop.wait(0.01)

        killer = threading.Thread(target=kill_new_engines, daemon=True)
        killer.start()
        try:
            response = stack.client.post(Endpoint.ROLLOUT, json={"model": str(new_model)}, timeout=300)
        finally:
            stop.set()
            killer.join(timeout=10)
        assert response.status_code == 503, response.text
        detail = response.json()["detail"]
        assert "aborted at step 2 of 5" in detail and "reverted group 0 to generation 0" in detail, detail
        assert killed, "no engine of the new generation was started"
        after = stack.wait_steady()
        assert after[primary["id"]]["pid"] == primary["pid"]  # the primary served throughout
        assert sorted(after) == sorted(before) and all(m["generation"] == 0 for m in after.values()), after
        assert stack.cluster()["generations"][0]["generation"] == 0
        wait_until(
            lambda: [s["id"] for s in stack.cluster()["services"] if s["kind"] == "daemon"] == ["g0-cache"],
            60, "the new generation's daemon retired",
        )  # fmt: skip
        assert [e["step"] for e in stack.events("rollout")][-2:] == ["aborted", "reverted"]
        assert stack.events("retire")[-1]["service"] == "g0-cache-gen1"
        assert completion_text(gateway) == reference  # the old weights' answer, before and after
    finally:
        stack.close()


def test_a_controller_restarted_mid_update_keeps_the_new_generation_and_stops_the_old_daemon(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The controller dies after the update's load and first restart: its successor starts on the new
    generation, stops the old generation's daemon (the engines still on it keep serving what they mapped), and
    a plain rollout then moves the rest."""
    new_model = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-seed2", seed=2)
    stack = ControllerStack(tiny_model)
    try:
        stack.start_controller()
        stack.wait_steady()
        old_daemon = stack.daemon()
        cli = subprocess.Popen(
            hotweights_command("rollout", "--config", str(stack.config_path), "--model", str(new_model)),
            env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        wait_until(lambda: [e for e in stack.events("rollout") if e.get("index") == 2], 120, "the first restart")
        stack.kill_controller()
        cli.wait(timeout=60)
        stack.start_controller()
        members = stack.wait_steady()
        assert sorted(m["generation"] for m in members.values()) == [0, 1, 1], members
        assert [(s["id"], s["current"]) for s in stack.cluster()["services"] if s["kind"] == "daemon"] == [
            ("g0-cache-gen1", True)
        ]
        assert read_identity(old_daemon["pid"]) is None
        assert "a daemon this stack no longer has" in str(stack.events("controller_start")[-1]["adopted"])
        assert stack.client.post(Endpoint.ROLLOUT, json={}, timeout=300).status_code == 200
        assert all(m["generation"] == 1 for m in stack.wait_steady().values())
    finally:
        stack.close()


@pytest.fixture(scope="module")
def lone_engine(tiny_model: Path) -> Iterator[ControllerStack]:
    """A steady group of one engine (no standby): every rollout and model update is refused up front on it, so the
    refusal tests share it; each leaves cluster.toml and the engines as it found them."""
    stack = ControllerStack(tiny_model, engines=1)
    try:
        stack.start_controller()
        stack.wait_steady()
        yield stack
    finally:
        stack.close()


def test_a_rollout_is_refused_up_front_when_the_group_cannot_keep_serving(lone_engine: ControllerStack) -> None:
    stack = lone_engine
    pid = stack.wait_steady()["g0-e0"]["pid"]
    good = stack.config_path.read_text()
    stack.config_path.write_text(good.replace("max_batch = 2", "max_batch = -1"))
    try:
        response = stack.client.post(Endpoint.ROLLOUT, json={})
    finally:
        stack.config_path.write_text(good)
    assert response.status_code == 412 and "engine.max_batch must be >= 0" in response.json()["detail"]
    response = stack.client.post(Endpoint.ROLLOUT, json={"group": 0})
    assert response.status_code == 412 and "no ready standby" in response.json()["detail"], response.text
    assert stack.client.post(Endpoint.ROLLOUT, json={"group": 3}).status_code == 404
    assert stack.anonymous.post(Endpoint.ROLLOUT, json={}).status_code == 401
    cli = subprocess.run(
        hotweights_command("rollout", "--config", str(stack.config_path)),
        env=ENV, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cli.returncode == 2 and "412: group 0 has no ready standby" in cli.stderr, cli.stderr
    assert stack.members()["g0-e0"]["pid"] == pid and stack.events("rollout") == []
    assert stack.cluster()["rollouts"] == []


def test_a_model_update_is_refused_up_front_when_the_model_is_bad_or_too_big(
    lone_engine: ControllerStack, tiny_model: Path, tmp_path: Path
) -> None:
    """The model's checks come before the group's (a group without a standby is refused for them first)."""
    stack = lone_engine
    pids = {i: m["pid"] for i, m in stack.wait_steady().items()}
    huge = sparse_checkpoint(tmp_path / "huge", tiny_model, hidden=32768, intermediate=131072)
    untokenized = shutil.copytree(tiny_model, tmp_path / "untokenized")
    (untokenized / "tokenizer.json").unlink()  # valid weights; every engine would fail to start on them
    for model, expected in [
        (tmp_path / "absent", "does not exist or is not a directory"),
        (untokenized, f"{untokenized / 'tokenizer.json'} is missing: the checkpoint has no tokenizer"),
        (tiny_model, "runs " + str(tiny_model.resolve()) + " already"),
        (huge, "the new generation's arena needs"),
    ]:
        response = stack.client.post(Endpoint.ROLLOUT, json={"model": str(model)})
        assert response.status_code == 412 and expected in response.json()["detail"], response.text
        assert "nothing restarted" in response.json()["detail"]
    assert "bytes on cpu" in response.json()["detail"] and "are free" in response.json()["detail"]
    assert stack.client.post(Endpoint.ROLLOUT, json={"model": "relative/dir"}).status_code == 422
    cli = subprocess.run(
        hotweights_command("rollout", "--config", str(stack.config_path), "--model", str(huge)),
        env=ENV, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert cli.returncode == 2 and "412: group 0: the new generation's arena needs" in cli.stderr, cli.stderr
    assert {i: m["pid"] for i, m in stack.members().items()} == pids
    assert [s["id"] for s in stack.cluster()["services"] if s["kind"] == "daemon"] == ["g0-cache"]
    assert stack.events("rollout") == []
