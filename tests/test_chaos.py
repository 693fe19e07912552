"""The drill's instruments on real sockets: the delay proxy, the split-brain detector, the load generator."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hotweights.chaos.clusterview import ClusterView
from hotweights.chaos.load import LoadGenerator, RequestRecord, reference_completion, refusal_text
from hotweights.chaos.measure import RoundResult, apply_events, apply_requests
from hotweights.chaos.proxy import DelayProxy
from hotweights.chaos.report import draw_timeline, label_rounds, mark_events, write_report
from hotweights.chaos.scenarios import RANK_SCENARIOS, SCENARIOS
from hotweights.chaos.splitbrain import SplitBrainDetector
from hotweights.cli import main
from hotweights.contract import SUSPECT_REQUEST
from hotweights.spawn import hotweights_command
from hotweights.stats import ms, whole_ms
from tests.cachehelpers import run_to_the_end
from tests.enginehelpers import EngineProcess


class RoleServer(ThreadingHTTPServer):
    """A tiny HTTP server on loopback whose ``/primary`` answers whatever ``status`` is set to."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), RoleHandler)
        self.status = 503

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class RoleHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: Nagle would hold the body 40 ms
    server: RoleServer

    def do_GET(self) -> None:
        body = b'{"role": "?"}'
        self.send_response(self.server.status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def role_servers(count: int) -> Iterator[list[RoleServer]]:
    servers = [RoleServer() for _ in range(count)]
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    try:
        yield servers
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


async def echo_server() -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, "127.0.0.1", 0)


def test_proxy_delays_both_directions_and_keeps_bytes() -> None:
    async def scenario() -> None:
        server = await echo_server()
        proxy = await DelayProxy(server.sockets[0].getsockname()[1]).start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            payload = bytes(range(256)) * 4096  # 1 MiB, every byte value
            writer.write(b"x")
            assert await reader.readexactly(1) == b"x"  # connection up, no delay yet
            proxy.delay_s = 0.1
            started = time.monotonic()
            writer.write(b"y")
            assert await reader.readexactly(1) == b"y"
            elapsed = time.monotonic() - started
            assert 0.2 <= elapsed < 0.6, f"one round trip through a 100 ms proxy took {elapsed:.3f} s"
            writer.write(payload)
            assert await reader.readexactly(len(payload)) == payload
            writer.close()
        finally:
            await proxy.close()
            server.close()

    asyncio.run(scenario())


def test_a_partitioned_proxy_delivers_nothing_until_healed_and_reset_cuts_what_it_held() -> None:
    """The multi-host drill's partition: a very long delay takes bytes and delivers none; healing (delay 0,
    reset) cuts the connections held behind it, and a new connection flows at once."""

    async def scenario() -> None:
        server = await echo_server()
        proxy = await DelayProxy(server.sockets[0].getsockname()[1]).start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            proxy.delay_s = 1e6
            writer.write(b"lost")
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(4), 0.3)
            proxy.delay_s = 0.0
            await proxy.reset()
            assert await asyncio.wait_for(reader.read(4), 5) == b""  # cut: EOF, never the held bytes
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.port)
            writer.write(b"back")
            assert await asyncio.wait_for(reader.readexactly(4), 5) == b"back"
            writer.close()
        finally:
            await proxy.close()
            server.close()

    asyncio.run(scenario())


def test_a_round_of_several_faults_reports_its_worst_outage() -> None:
    """Flapping: a first kill served over in 0.2 s, a later one with no ready standby in 1 s: 1 s counts."""
    ok = [RequestRecord(t, t + 0.05, 200, "", True) for t in (0.0, 0.1, 0.3, 0.4, 1.3, 1.4)]
    result = RoundResult("flapping", 1, started_at=0.0, fault_at=0.2, later_faults=[0.42])
    apply_requests(result, ok, until=2.0)
    assert result.outage_ms == pytest.approx(1350 - 350)
    assert result.lb_convergence_ms == pytest.approx(1350 - 420)


def test_a_stream_cut_mid_way_fails_the_round_as_a_broken_stream() -> None:
    records = [
        RequestRecord(0.0, 0.1, 200, "", True, "x", streamed=True),
        RequestRecord(0.2, 0.3, 200, "broken stream: no [DONE]; last event {}", None, "x", streamed=True),
        RequestRecord(0.2, 0.3, 503, "no primary", None),
    ]
    result = RoundResult("kill-primary", 0, started_at=0.0)
    apply_requests(result, records, until=1.0)
    assert (result.failed, result.broken_streams) == (2, 1)
    assert "1 broken stream(s)" in result.failures(judge_client_errors=True)
    assert result.failures(judge_client_errors=False) == []


@pytest.mark.parametrize("expected", [False, True])
def test_suspect_refusals_are_counted_apart_and_fail_only_rounds_that_do_not_expect_them(expected: bool) -> None:
    """Flapping kills a re-sent request on engine after engine: the gateway's suspect answer (a 422, or a
    stream's last event) is counted apart and accepted there; any other failure still fails the round."""
    refusal = json.dumps({"error": {"message": "not re-sent: 2 engines failed", "type": SUSPECT_REQUEST}})
    records = [
        RequestRecord(0.0, 0.1, 422, refusal_text(refusal), None),
        RequestRecord(0.0, 0.1, 200, refusal_text(refusal), None, "a", streamed=True),
        RequestRecord(0.0, 0.1, 503, refusal_text('{"error": {"message": "no primary", "type": "unavailable"}}'), None),
    ]
    result = RoundResult("flapping", 0, started_at=0.0, suspects_expected=expected)
    apply_requests(result, records, until=1.0)
    assert (result.failed, result.suspects, result.broken_streams) == (3, 2, 0)
    [failure] = result.failures(judge_client_errors=True)
    assert failure.startswith(f"{1 if expected else 3} client-visible error(s), the first 422: suspect"), failure


def test_a_rounds_redundancy_runs_from_its_last_fault_to_the_next_restored_event() -> None:
    """A storm of two faults: full redundancy after the first is not the round's; the one after the last is."""
    result = RoundResult("storm", 0, started_at=0.0, fault_at=100.0, later_faults=[103.0])
    events = [
        {"kind": "redundancy_restored", "time": "1970-01-01T00:01:41.000+00:00", "group": 0},
        {"kind": "redundancy_restored", "time": "1970-01-01T00:01:43.750+00:00", "group": 0},
    ]
    apply_events(result, events, set())
    assert result.redundancy_ms == pytest.approx(750.0)


def test_a_respawn_is_measured_from_its_event() -> None:
    """kill-daemon: the first respawn after the fault gives respawn_ms; the detection is its exit event."""
    result = RoundResult("kill-daemon", 0, started_at=0.0, fault_at=100.0)
    events = [
        {"kind": "exit", "time": "1970-01-01T00:01:40.004+00:00", "service": "g0-cache"},
        {"kind": "respawn", "time": "1970-01-01T00:01:40.090+00:00", "service": "g0-cache", "duration_ms": 85.5},
        {"kind": "respawn", "time": "1970-01-01T00:01:41.000+00:00", "service": "gateway-0", "duration_ms": 900.0},
    ]
    apply_events(result, events, {"g0-cache"})
    assert result.respawn_ms == 85.5 and result.detection_ms == pytest.approx(4.0)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("event_time", "detection_ms"),
    [
        ("1970-01-01T00:01:40.004+00:00", 3.7),  # 3.7 ms after the fault at 100.0003
        ("1970-01-01T00:01:40.000+00:00", 0.0),  # the fault's own millisecond, truncated: 0, never -0.3
        ("1970-01-01T00:01:39.998+00:00", -2.3),  # earlier than truncation explains: kept, so it shows
    ],
)
def test_a_detection_in_the_faults_own_millisecond_is_zero_not_negative(event_time: str, detection_ms: float) -> None:
    result = RoundResult("kill-primary", 0, started_at=0.0, fault_at=100.0003)
    apply_events(result, [{"kind": "exit", "time": event_time, "member": "g0-e0"}], {"g0-e0"})
    assert result.detection_ms == pytest.approx(detection_ms, abs=1e-6)
    assert str(result.to_json()["detection_ms"]).startswith("-") == (detection_ms < 0)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("seconds", "rounded", "whole"),
    [(0.0123456, 12.3, "12"), (-0.00001, 0.0, "0"), (0.0, 0.0, "0"), (-0.0004, -0.4, "0"), (-0.0016, -1.6, "-2")],
)
def test_durations_in_milliseconds_never_read_minus_zero(seconds: float, rounded: float, whole: str) -> None:
    assert str(ms(seconds)) == str(rounded) and whole_ms(seconds * 1000) == whole


def test_the_quiet_outage_is_the_same_formula_before_the_fault() -> None:
    """Requests every 0.1 s taking 0.05 s: 0.5 s before the fault the gap is one interval plus one request."""
    ok = [RequestRecord(t / 10, t / 10 + 0.05, 200, "", True) for t in range(10)]
    result = RoundResult("kill-primary", 0, started_at=0.0, fault_at=0.72)
    apply_requests(result, ok, until=2.0)
    assert result.quiet_outage_ms == pytest.approx((0.35 - 0.15) * 1000)  # last end 0.15 before 0.22, then 0.3 s
    late = RoundResult("kill-primary", 0, started_at=0.0, fault_at=0.26)  # its quiet instant has no earlier success
    apply_requests(late, ok, until=2.0)
    assert late.quiet_outage_ms is None


def test_a_cluster_is_whole_only_once_the_spare_daemon_it_wants_is_ready() -> None:
    """A drill round starts from a whole cluster: a kill of the daemon before its respawned spare is imported
    would measure a respawn from nothing, not the spare's."""
    members = [{"id": "g0-e0", "group": 0, "role": "primary", "status": "healthy", "state": "ready", "pid": 1}]
    services = [{"id": "g0-cache", "alive": True, "serving": True}]
    waiting = {"group": 0, "service": "g0-cache", "pid": None, "ready": False}
    assert ClusterView(members, services).incomplete() is None
    assert ClusterView(members, services, daemon_spares=[waiting]).incomplete() == (
        "the spare daemon for g0-cache not ready"
    )
    assert ClusterView(members, services, daemon_spares=[waiting | {"pid": 7, "ready": True}]).incomplete() is None


def test_split_brain_detector_counts_sweeps_with_two_primaries() -> None:
    async def scenario(servers: list[RoleServer]) -> SplitBrainDetector:
        detector = SplitBrainDetector([s.url for s in servers])
        async with detector.running():
            servers[0].status = 200
            await asyncio.sleep(0.3)
            assert not detector.samples, "one primary is not a split brain"
            servers[1].status = 200
            await asyncio.sleep(0.1)
            servers[1].status = 503
            await asyncio.sleep(0.2)
        return detector

    with role_servers(3) as servers:
        detector = asyncio.run(scenario(servers))
    assert detector.sweeps >= 30, f"only {detector.sweeps} sweeps in 0.6 s: polling slower than every 20 ms"
    assert 3 <= len(detector.samples) <= 20
    assert all(sample.primaries == (servers[0].url, servers[1].url) for sample in detector.samples)


def test_load_generator_records_correct_completions(tiny_model: Path) -> None:
    async def scenario(url: str) -> LoadGenerator:
        import httpx

        async with httpx.AsyncClient() as client:
            reference = await reference_completion(client, url)
        load = LoadGenerator(url, rps=20, reference=reference)
        async with load.running():
            await asyncio.sleep(1.0)
        load.reference = "something else"
        async with load.running():
            await asyncio.sleep(0.2)
        return load

    with EngineProcess(tiny_model, "--kv-cache-tokens", "256") as engine:
        load = asyncio.run(scenario(engine.url))
    good = [r for r in load.records if r.correct]
    wrong = [r for r in load.records if r.correct is False]
    assert 15 <= len(good) <= 25, [r.error for r in load.records]
    assert wrong and all(r.status == 200 and "wrong output" in r.error for r in wrong)
    assert all(r.end >= r.start for r in load.records)


def test_a_drill_stacks_engines_run_the_limits_it_was_given(tmp_path: Path, default_model: Path) -> None:
    """Every field of the engines' limits (the benchmarks' admission flags among them) reaches cluster.toml."""
    from hotweights.chaos.stack import DRILL_LIMITS, DrillStack  # it writes checkpoints with torch: on first use

    limits = replace(DRILL_LIMITS, queue_budget_s=2.5, batch_invariant=True)
    stack = DrillStack.create(tmp_path, "gateway", proxied=False, model=str(default_model), limits=limits)
    assert asdict(stack.config.engine) == asdict(limits) != asdict(DRILL_LIMITS)


# The scenarios CI's drill leaves to another test, and that test: one that runs the same fault (the same scenario's,
# or the same planned operation) on real processes under load and checks at least what the drill's round checks. CI's
# drill runs every other scenario, on a stack without a batch engine or a second model; the drill of every scenario on
# one stack runs with HOTWEIGHTS_TEST_SLOW=1.
ELSEWHERE = {  # scenario: (its test's module in tests/, the test)
    "kill-primary": ("test_readme.py", "test_the_try_it_commands_run_as_written"),  # the README's drill
    "hang-primary": ("test_readme.py", "test_the_try_it_commands_run_as_written"),
    "kill-daemon": ("test_recover.py", "test_controller_respawns_the_daemon_from_its_spare_which_readopts_under_load"),
    "kill-gateway": ("test_controller_up.py", "test_a_gateway_crash_refuses_no_connection"),
    "rolling-restart": ("test_rollout.py", "test_a_rollout_under_load_restarts_every_engine_with_no_client_error"),
    "model-update": (
        "test_rollout.py",
        "test_a_model_update_under_load_switches_the_answers_once_and_frees_the_old_arena",
    ),
    "preempt-batch": (
        "test_batch.py",
        "test_a_batch_engine_yields_for_a_replacement_standby_and_follows_a_model_update",
    ),
}
CI_DRILL = [name for name in SCENARIOS if name not in ELSEWHERE]
NOT_ON_ONE_RANK = {"slow-primary-netem", *RANK_SCENARIOS}  # skipped there: one rank, and netem where tc lacks it
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.unit
def test_every_scenario_runs_in_cis_drill_or_in_the_test_named_for_it() -> None:
    assert set(ELSEWHERE) < set(SCENARIOS) and "storm" in CI_DRILL  # the drill's report of a storm: only here
    for module, test in set(ELSEWHERE.values()):
        assert f"def {test}(" in (REPO / "tests" / module).read_text(), f"{module}::{test} is gone: drill it here"
    (line,) = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("hotweights drill ")]
    assert {name for name, (module, _) in ELSEWHERE.items() if module == "test_readme.py"} <= set(line.split()), line


def drill(report: Path, scenarios: list[str], timeout: float) -> dict:
    """Run ``hotweights drill SCENARIO...`` (none: every scenario) to its end through the gateway; its report. Exit 0
    means no split brain, no wrong output, no leak, every scenario's promise kept and no client-visible error."""
    command = hotweights_command("drill", *scenarios, "--rps", "10", "--storm-faults", "3", "--report", str(report))
    result = run_to_the_end(command, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    document = json.loads((report / "report.json").read_text())
    assert document["totals"]["split_brain"] == 0
    assert (report / "timeline.png").stat().st_size > 10_000
    (storm,) = [r for r in document["rounds"] if r["scenario"] == "storm"]
    assert len(storm["later_faults"]) == 2 and len(storm["fault_outages_ms"]) == 3 and storm["redundancy_ms"] > 0
    return document


def ran(document: dict) -> set[str]:
    return {r["scenario"] for r in document["rounds"] if "skipped" not in r}


@pytest.mark.timeout(360)
def test_drill_of_the_scenarios_no_other_test_runs(tmp_path: Path, default_model: Path) -> None:
    """CI's drill: one round of each scenario in CI_DRILL on the tiny model, through the gateway."""
    document = drill(tmp_path / "report", CI_DRILL, timeout=300)  # 15 rounds and their stack: ~150 s on 2 loaded cores
    assert ran(document) >= set(CI_DRILL) - NOT_ON_ONE_RANK and not ran(document) & set(ELSEWHERE)
    assert "| kill-standby | 1 |" in (tmp_path / "report" / "summary.md").read_text()


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("HOTWEIGHTS_TEST_SLOW") != "1", reason="minutes long: HOTWEIGHTS_TEST_SLOW=1")
@pytest.mark.timeout(480)
def test_drill_every_scenario_once_through_the_gateway(tmp_path: Path, default_model: Path) -> None:
    """One round of every scenario on one stack (a batch engine and a second model among it), through the gateway."""
    document = drill(tmp_path / "report", [], timeout=420)  # 22 rounds and their stack: 256 s alone on 2 loaded cores
    assert ran(document) >= set(SCENARIOS) - NOT_ON_ONE_RANK, ran(document)
    assert "| kill-primary | 1 |" in (tmp_path / "report" / "summary.md").read_text()


def two_kill_rounds() -> tuple[float, list[RoundResult], list[RequestRecord]]:
    """Two kill rounds whose fault, detection and promotion come within milliseconds, and their requests."""
    began = time.time()
    results = [
        RoundResult("kill-primary", i, began + 10 * i, ended_at=began + 10 * i + 8, fault_at=began + 10 * i + 2,
                    detected_at=began + 10 * i + 2.01, promoted_at=began + 10 * i + 2.02, requests=2)
        for i in range(2)
    ]  # fmt: skip
    records = [RequestRecord(began + t, began + t + 0.05, 200, "", True) for t in (1.0, 3.0, 11.0, 13.0)]
    return began, results, records


def test_the_report_without_matplotlib_is_complete_and_says_how_to_get_the_picture(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    began, results, records = two_kill_rounds()
    args = argparse.Namespace(lb="gateway", rps=10.0)
    summary = write_report(tmp_path / "out/", args, results, records, 3, began)
    assert summary == tmp_path / "out" / "summary.md"  # one slash: printed as the drill's last line
    assert sorted(p.name for p in summary.parent.iterdir()) == ["report.json", "summary.md"]
    text = summary.read_text()
    assert "| kill-primary | 2 |" in text
    assert "timeline.png" not in text and "pip install 'hotweights[drill]'" in text
    assert "pip install 'hotweights[drill]'" in caplog.text
    assert json.loads((summary.parent / "report.json").read_text())["rounds"][1]["scenario"] == "kill-primary"


def test_the_timeline_names_each_round_and_tells_coinciding_markers_apart(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    began, results, records = two_kill_rounds()
    assert draw_timeline(tmp_path / "t.png", results, records, began) == tmp_path / "t.png"
    assert (tmp_path / "t.png").stat().st_size > 10_000
    fig, ax = plt.subplots()
    try:
        label_rounds(ax, results, began)
        mark_events(ax, results, began)
        assert [t.get_text().strip() for t in ax.texts] == ["kill-primary #1", "kill-primary #2"]
        styles = {line.get_linestyle() for line in ax.lines}
        heights = {
            tuple(c.get_offsets()[:, 1]) for c in ax.collections if c.get_label() in ("fault", "detected", "promoted")
        }
        assert len(styles) == 3 and len(heights) == 3  # three kinds, each its own line style and glyph height
    finally:
        plt.close(fig)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--hosts", "1"], "--hosts must be 2..9 with --dcs etcd"),
        (["--hosts", "3", "--lb", "haproxy"], "--dcs etcd drills its own simulated hosts through the gateway"),
    ],
)
def test_bad_multihost_drill_flags_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], expected: str
) -> None:
    assert main(["drill", "--dcs", "etcd", *flags, "--report", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert expected in error and "\n" not in error
