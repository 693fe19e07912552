"""Multi-host mode (``[dcs]``) against a real etcd: simulated hosts on one machine, each a controller with its
own state dir, runtime dir and loopback address (127.0.0.2, 127.0.0.3), its own cache daemon and engines,
all in failover group 0."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from hotweights.contract import Endpoint
from hotweights.controller.config import load_config
from hotweights.controller.dcs import DcsError, EtcdLeadership
from hotweights.controller.engineapi import EngineApi
from hotweights.ports import free_port
from hotweights.spawn import hotweights_command
from tests.cachehelpers import wait_until
from tests.controllerhelpers import ControllerStack, split_brain_watch
from tests.etcdhelpers import EtcdMember, etcd_cluster, needs_etcd
from tests.gatewayhelpers import GatewayProcess

pytestmark = needs_etcd

TTL_S, LOOP_WAIT_S, RETRY_TIMEOUT_S = 2, 0.25, 0.5
# A primary whose controller lost etcd stops serving at most ttl - retry_timeout after the last renewal
# that reached etcd, which was at most loop_wait before the loss (docs/operations.md, multi-host).
DEMOTE_BOUND_S = TTL_S - RETRY_TIMEOUT_S + LOOP_WAIT_S
SLACK_S = 1.0  # two loaded cores: an HTTP exchange in the test's own polling may take this long


def dcs_section(etcd: list[str], prefix: str, host: str, address: str, ttl_s: int = TTL_S) -> str:
    return (
        f'[dcs]\netcd = {json.dumps(etcd)}\nprefix = "{prefix}"\nhost = "{host}"\naddress = "{address}"\n'
        f"ttl_s = {ttl_s}\nloop_wait_s = {LOOP_WAIT_S}\nretry_timeout_s = {RETRY_TIMEOUT_S}\n"
    )


def simulated_host(model: Path, etcd: list[str], prefix: str, name: str, address: str) -> ControllerStack:
    """A host: its own state dir, HOTWEIGHTS_HOME and runtime dir (daemon socket links), engines on ``address``."""
    stack = ControllerStack(model, engines=2, extra=dcs_section(etcd, prefix, name, address))
    stack.env = {
        **os.environ,
        "HOTWEIGHTS_HOME": str(stack.root / "home"),
        "HOTWEIGHTS_RUNTIME_DIR": str(stack.root / "rt"),
    }
    return stack


def engine_urls(stack: ControllerStack) -> list[str]:
    return [spec.url for spec in stack.config.engines()]


def status(url: str, path: str = Endpoint.PRIMARY) -> int | None:
    try:
        return httpx.get(url + path, timeout=2.0).status_code
    except httpx.TransportError:
        return None


def primaries(urls: list[str]) -> list[str]:
    return [url for url in urls if status(url) == 200]


def kill_host(stack: ControllerStack) -> None:
    """Every process of the simulated host at once (SIGKILL): controller, daemon, engines."""
    for pid in stack.pids_naming_root():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def etcd_put(etcd: str, key: str, value: str) -> None:
    body = {"key": base64.b64encode(key.encode()).decode(), "value": base64.b64encode(value.encode()).decode()}
    httpx.post(f"{etcd}/v3/kv/put", json=body, timeout=5).raise_for_status()


def etcd_delete(etcd: str, key: str) -> None:
    httpx.post(f"{etcd}/v3/kv/deleterange", json={"key": base64.b64encode(key.encode()).decode()}, timeout=5)


def leader_token(etcd: str, key: str) -> int:
    reply = httpx.post(f"{etcd}/v3/kv/range", json={"key": base64.b64encode(key.encode()).decode()}, timeout=5)
    return int(reply.json()["kvs"][0]["mod_revision"])


@pytest.fixture
def etcd() -> Iterator[EtcdMember]:
    with etcd_cluster(1) as members:
        yield members[0]


@pytest.fixture
def prefix() -> str:
    return f"/t{uuid.uuid4().hex[:8]}"


def test_two_hosts_never_both_promote_and_the_survivor_takes_over(
    tiny_model: Path, etcd: EtcdMember, prefix: str
) -> None:
    hosts = [simulated_host(tiny_model, [etcd.url], prefix, name, address)
             for name, address in (("a", "127.0.0.2"), ("b", "127.0.0.3"))]  # fmt: skip
    urls = [url for host in hosts for url in engine_urls(host)]
    leader_key = f"{prefix}/test/leader/0"
    try:
        # Another cluster's record where group 0's leader key lives: no promotion on doubt.
        etcd_put(
            etcd.url, leader_key, json.dumps({"cluster": "other", "group": 0, "host": "x", "member": "m", "url": "u"})
        )
        with split_brain_watch(urls) as detector:
            for host in hosts:
                host.start_controller()
            wait_until(lambda: all(status(u, Endpoint.STANDBY) == 200 for u in urls), 120, "4 ready standbys")
            for host in hosts:
                doubt = wait_until(lambda h=host: h.cluster()["dcs"]["groups"].get("0"), 30, "the doubt seen")
                assert "written by cluster 'other'" in doubt
            assert primaries(urls) == []

            etcd_delete(etcd.url, leader_key)  # both controllers race for the key now
            first = wait_until(lambda: primaries(urls), 30, "a primary")
            assert len(first) == 1
            winner = next(h for h in hosts if first[0] in engine_urls(h))
            survivor = next(h for h in hosts if h is not winner)
            assert survivor.cluster()["dcs"]["groups"]["0"]["url"] == first[0]

            # The other host's gateway learns of this host's primary from the leader key (etcd watch) and routes there.
            with GatewayProcess(survivor.config_path) as gateway:
                gateway.wait_health(lambda h: h["primaries"] == first, 10, "the leader's engine as the primary")
                completion = gateway.client.post(Endpoint.COMPLETIONS, json={"prompt": "The", "max_tokens": 2})
                assert completion.status_code == 200 and completion.headers["x-hotweights-upstream"] == first[0]

            token = leader_token(etcd.url, leader_key)
            stale = httpx.post(first[0] + Endpoint.LEASE, json={"fencing_token": token - 1, "lease_s": 5.0},
                               headers=winner.client.headers, timeout=5)  # fmt: skip
            assert stale.status_code == 409 and "stale fencing token" in stale.json()["message"]

            killed_at = time.monotonic()
            kill_host(winner)
            second = wait_until(lambda: primaries(engine_urls(survivor)), 30, "the survivor's standby promoted")
            assert len(second) == 1
            takeover_s = time.monotonic() - killed_at
            assert leader_token(etcd.url, leader_key) > token
        assert detector.samples == [], detector.samples[:5]
        print(f"takeover after kill-host: {takeover_s:.2f} s (ttl {TTL_S} s)")
    finally:
        for host in hosts:
            host.close()


def test_losing_etcd_demotes_the_primary_within_the_bound_and_its_return_restores_one(
    tiny_model: Path, etcd: EtcdMember, prefix: str
) -> None:
    host = simulated_host(tiny_model, [etcd.url], prefix, "a", "127.0.0.2")
    urls = engine_urls(host)
    try:
        host.start_controller()
        wait_until(lambda: primaries(urls), 120, "a primary")
        etcd.stop()
        lost_at = time.monotonic()
        wait_until(lambda: not primaries(urls), DEMOTE_BOUND_S + SLACK_S + 5, "the primary to demote", interval=0.02)
        demoted_s = time.monotonic() - lost_at
        assert demoted_s <= DEMOTE_BOUND_S + SLACK_S, f"demoted {demoted_s:.2f} s after etcd was lost"
        wait_until(lambda: host.cluster()["dcs"]["etcd_error"], 10, "the controller to see etcd gone")
        wait_until(lambda: all(status(u, Endpoint.STANDBY) == 200 for u in urls), 30, "both engines standbys")
        assert primaries(urls) == []  # no promotion while etcd is out of reach

        etcd.restart()
        wait_until(lambda: primaries(urls), 30, "a primary once etcd is back")
        assert "etcd is out of reach" in host.logs()
    finally:
        host.close()


def run_controller(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        hotweights_command("controller", "--config", str(config)), capture_output=True, text=True, timeout=60
    )


def test_unreachable_etcd_at_start_up_is_one_line_and_exit_2(tiny_model: Path, prefix: str) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    host = simulated_host(tiny_model, [nobody], prefix, "a", "127.0.0.2")
    try:
        result = run_controller(host.config_path)
        assert result.returncode == 2, result.stderr
        line = result.stderr.strip()
        assert "\n" not in line and "Traceback" not in line
        assert nobody in line and "is etcd running?" in line
        assert host.pids_naming_root() == []  # nothing was started
    finally:
        host.close()


def test_a_prefix_another_cluster_uses_is_refused_at_start_up(tiny_model: Path, etcd: EtcdMember, prefix: str) -> None:
    etcd_put(etcd.url, f"{prefix}/test/cluster", json.dumps({"cluster": "someone-else"}))
    host = simulated_host(tiny_model, [etcd.url], prefix, "a", "127.0.0.2")
    try:
        result = run_controller(host.config_path)
        assert result.returncode == 2, result.stderr
        assert "not this cluster's marker" in result.stderr and "choose another prefix" in result.stderr
        assert result.stderr.count("\n") == 1
    finally:
        host.close()


async def refreshed(keeper: EtcdLeadership, attempts: int = 10) -> None:
    """``keeper.refresh()`` once it succeeds (while etcd elects a new raft leader, requests fail)."""
    for attempt in range(attempts):
        try:
            return await keeper.refresh()
        except DcsError:
            if attempt == attempts - 1:
                raise


def test_two_controllers_race_one_key_on_a_three_member_etcd_that_loses_a_member(tmp_path: Path, prefix: str) -> None:
    """In process, no engines: two hosts' leader keepers claim group 0 at the same instant, exactly one wins;
    the etcd member they talk to dies and the holder keeps the key through the others."""
    with etcd_cluster(3) as members:
        urls = [m.url for m in members]
        config = tmp_path / "cluster.toml"

        async def race() -> None:
            async with httpx.AsyncClient(trust_env=False) as client:
                engines = EngineApi(client, None)
                keepers = []
                for name in ("a", "b"):
                    config.write_text(f'[cluster]\nname = "race"\n\n{dcs_section(urls, prefix, name, "127.0.0.1")}')
                    keepers.append(EtcdLeadership(load_config(config), client, engines))
                for keeper in keepers:
                    await keeper.start(lambda: None)
                try:
                    nobody = f"http://127.0.0.1:{free_port()}"
                    claims = await asyncio.gather(*(k.claim(0, f"{k.host}-e0", nobody) for k in keepers))
                    won = [k for k, (body, _) in zip(keepers, claims, strict=True) if body is not None]
                    assert len(won) == 1, claims
                    loser = next(k for k in keepers if k is not won[0])
                    refusal = next(r for body, r in claims if body is None)
                    assert "lost the race" in refusal and f"host {won[0].host}" in refusal
                    token = claims[keepers.index(won[0])][0]["fencing_token"]

                    members[0].stop()  # the member both talk to first (perhaps raft's leader: an election follows)
                    await refreshed(won[0])
                    await refreshed(loser)
                    assert (
                        won[0].held[0].token == token
                        and loser.refusal(0) == f"group 0 is led by {won[0].leaders[0].describe()}"
                    )
                    again, refused = await loser.claim(0, "b-e1", nobody)
                    assert again is None and "lost the race" in refused
                finally:
                    for keeper in keepers:
                        await keeper.stop(revoke=True)

        asyncio.run(race())


KEEPER_TTL_S = 10  # the in-process keepers' lease: a restart on two loaded cores must come well within it


def keeper_config(path: Path, etcd: list[str], prefix: str, host: str, base_port: int = 41000) -> Path:
    """One host's cluster.toml, one engine at ``base_port`` on 127.0.0.2 (nothing listens there)."""
    path.write_text(
        f'[cluster]\nname = "keys"\n\n[[groups]]\nengines = 1\nbase_port = {base_port}\n\n'
        f"{dcs_section(etcd, prefix, host, '127.0.0.2', ttl_s=KEEPER_TTL_S)}"
    )
    return path


def test_a_restarted_keeper_retakes_only_keys_naming_its_host_and_engine_under_a_live_lease(
    tmp_path: Path, prefix: str
) -> None:
    """In process, no engines: what a restarted controller's leader keeper adopts at start-up."""
    with etcd_cluster(1) as members:
        etcd = [members[0].url]

        async def restart() -> None:
            running: list[EtcdLeadership] = []
            async with httpx.AsyncClient(trust_env=False) as client:

                async def keeper(host: str, base_port: int = 41000) -> EtcdLeadership:
                    config = keeper_config(tmp_path / f"{host}-{base_port}.toml", etcd, prefix, host, base_port)
                    running.append(EtcdLeadership(load_config(config), client, EngineApi(client, None)))
                    await running[-1].start(lambda: None)
                    return running[-1]

                try:
                    first = await keeper("a")
                    body, _ = await first.claim(0, "g0-e0", "http://127.0.0.2:41000")
                    assert body is not None
                    await running.pop().stop(revoke=False)  # killed: its lease and key live on for the TTL
                    again = await keeper("a")
                    assert again.lease == first.lease and again.held[0].token == body["fencing_token"]
                    assert again.refusal(0) is None and 0 < again._lease_s() <= KEEPER_TTL_S - RETRY_TIMEOUT_S
                    other_host, other_engine = await keeper("b"), await keeper("a", base_port=42000)
                    assert other_host.held == {} and other_engine.held == {}  # not its host, not its engine
                    await running.pop(running.index(again)).stop(revoke=True)  # the lease goes, its key with it
                    late = await keeper("a")
                    assert late.held == {} and late.lease != first.lease
                finally:
                    for started in running:
                        await started.stop(revoke=True)

        asyncio.run(restart())


def test_a_wall_clock_jump_changes_no_lease_arithmetic(
    tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller's lease deadlines run on the monotonic clock: the wall clock stepping an hour either way
    (NTP, `date -s`) neither shortens nor stretches a primary's lease, nor makes the holder doubt its key. The
    jump is this process's ``time.time`` (the machine's clock is not ours to step)."""
    with etcd_cluster(1) as members:
        config = keeper_config(tmp_path / "cluster.toml", [members[0].url], prefix, "a")

        async def jumps() -> None:
            async with httpx.AsyncClient(trust_env=False) as client:
                keeper = EtcdLeadership(load_config(config), client, EngineApi(client, None))
                await keeper.start(lambda: None)
                try:
                    body, _ = await keeper.claim(0, "g0-e0", "http://127.0.0.2:41000")
                    assert body is not None
                    wall = time.time
                    for jump_s in (3600.0, -3600.0):
                        monkeypatch.setattr(time, "time", lambda jump_s=jump_s: wall() + jump_s)
                        await keeper.refresh()
                        assert keeper.refusal(0) is None and keeper.held[0].token == body["fencing_token"]
                        assert KEEPER_TTL_S / 2 < keeper._lease_s() <= KEEPER_TTL_S - RETRY_TIMEOUT_S
                        again, refused = await keeper.claim(0, "g0-e0", "http://127.0.0.2:41000")
                        assert refused is None and again is not None
                        assert KEEPER_TTL_S / 2 < again["lease_s"] <= KEEPER_TTL_S - RETRY_TIMEOUT_S
                        body = again
                finally:
                    await keeper.stop(revoke=True)

        asyncio.run(jumps())
