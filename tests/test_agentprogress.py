"""Progress-based health of an engine behind the agent (``standby.agentprogress``): the decision, table-driven, and
the agent with a real engine process whose streams pause (tests/pacing_engine.py). The same with real vLLM and
SGLang servers, whose engine core is stopped: tests/test_vllm.py, tests/test_sglang.py."""

from __future__ import annotations

import re
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from hotweights.contract import Endpoint
from hotweights.standby.agentprogress import (
    Relayed,
    RelayWatch,
    metric_total,
    prompt_tokens,
    relay_progress,
    size_class,
)
from hotweights.standby.progress import STALL_FLOOR_S, stall_bound_s, stall_refusal
from tests.cachehelpers import wait_until
from tests.test_agent import _answers, agent

ENGINE = Path(__file__).with_name("pacing_engine.py")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("body", "tokens"),
    [
        ({"prompt": "abcdefgh"}, 2),
        ({"prompt": "abcdefghi"}, 3),  # rounded up
        ({"prompt": [1, 2, 3]}, 3),  # token ids count one each
        ({"prompt": ["abcd", "abcde"]}, 3),
        ({"prompt": [[1, 2], [3]]}, 3),
        ({"messages": [{"role": "user", "content": "abcdefgh"}]}, 2),  # the role is no prompt
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "abcd"}]}]}, 1),
        ({"prompt": True}, 0),
        ({"prompt": None}, 0),
        ([1, 2], 0),
        (None, 0),
    ],
)
def test_a_prompts_size_is_estimated_without_a_tokenizer(body: object, tokens: int) -> None:
    assert prompt_tokens(body) == tokens


@pytest.mark.unit
@pytest.mark.parametrize(("tokens", "size"), [(0, 16), (1, 16), (16, 16), (17, 32), (1000, 1024), (4096, 4096)])
def test_a_prompt_is_timed_under_its_size_rounded_up_to_a_power_of_two(tokens: int, size: int) -> None:
    assert size_class(tokens) == (1, size)


def decoding(tokens: int = 4) -> Relayed:
    return Relayed(90.0, tokens, streamed=True, first=95.0, last=100.0)


def waiting(tokens: int) -> Relayed:
    return Relayed(100.0, tokens, streamed=True)


SHORT = {(1, 16): 0.05}  # the readiness completion's first token took 50 ms


@pytest.mark.unit
@pytest.mark.parametrize(
    ("judged", "decode_s", "first_tokens", "now", "stalled"),
    [
        ([], 0.01, SHORT, 1000.0, None),  # idle: never stalled
        ([decoding()], 0.01, SHORT, 100.9, None),  # a decode step expected: the floor
        ([decoding()], 0.01, SHORT, 101.1, "no progress for 1.1 s with 1 request(s) pending (its bound: 1.0 s)"),
        ([decoding(), decoding()], 0.3, SHORT, 102.9, None),  # slow but progressing: ten steps
        ([decoding()], 0.3, SHORT, 103.1, "the engine has made no progress for 3.1 s with 1 request(s)"),
        ([decoding()], 0.0, SHORT, 900.0, None),  # no step timed yet: nothing to expect by
        ([waiting(10)], 0.0, SHORT, 101.1, "pending, in a first token of a prompt of about 10 tokens for 1.1 s"),
        ([waiting(4000)], 0.0, SHORT, 900.0, None),  # a long prompt never timed: scaled up from a short one
        ([waiting(4000)], 0.0, {(1, 4096): 2.0} | SHORT, 119.0, None),  # its own size's time: ten of them
        ([waiting(4000)], 0.0, {(1, 4096): 2.0} | SHORT, 121.0, "(its bound: 20.0 s)"),
        ([waiting(10), decoding()], 0.5, SHORT, 104.9, None),  # a first token is expected in no less than a step
        ([waiting(10)], 0.0, {}, 900.0, None),  # no first token timed: nothing to expect by
        ([decoding()] * 4 + [waiting(10)] * 40, 0.2, {(1, 16): 3.0}, 129.0, None),  # overloaded: a long queue
    ],
)
def test_an_engine_with_requests_pending_and_no_progress_past_its_bound_is_stalled(
    judged: list[Relayed], decode_s: float, first_tokens: dict, now: float, stalled: str | None
) -> None:
    reason = stall_refusal(relay_progress(judged, 100.0, decode_s, first_tokens), now)
    assert reason == stalled if stalled is None else stalled in reason


@pytest.mark.unit
def test_the_bound_is_the_reference_engines_floor_and_factor() -> None:
    assert stall_bound_s(relay_progress([decoding()], 100.0, 0.001, SHORT)) == STALL_FLOOR_S
    assert stall_bound_s(relay_progress([waiting(10)], 100.0, 0.0, {(1, 16): 0.5})) == 5.0


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "total"),
    [
        ('# HELP vllm:generation_tokens_total x\nvllm:generation_tokens_total{engine="0"} 12.0\n', 12.0),
        ('vllm:generation_tokens_total{engine="0"} 12.0\nvllm:generation_tokens_total{engine="1"} 3.0\n', 15.0),
        ("vllm:generation_tokens_total 7\n", 7.0),
        ('vllm:generation_tokens_total_other{engine="0"} 12.0\nvllm:generation_tokens_created 1.7e9\n', None),
        ("", None),
    ],
)
def test_a_counters_total_sums_its_label_sets(text: str, total: float | None) -> None:
    assert metric_total(text, "vllm:generation_tokens_total") == total


@pytest.mark.unit
def test_a_request_not_streamed_is_judged_only_while_the_engines_step_counter_is_read() -> None:
    watch = RelayWatch()
    whole, stream = watch.sent({"prompt": "x"}), watch.sent({"prompt": "x", "stream": True})
    assert watch.judged() == [stream]
    watch.counted(5.0)
    assert set(watch.judged()) == {whole, stream}
    watch.ended(stream, finished=True)
    watch.counted(None)
    assert watch.judged() == []


@pytest.mark.unit
def test_a_first_token_is_timed_only_for_a_request_that_found_the_engine_idle() -> None:
    watch = RelayWatch()
    alone = watch.sent({"prompt": "x" * 400, "stream": True})
    queued = watch.sent({"prompt": "x" * 4, "stream": True})
    for relayed in (alone, queued):
        watch.moved(relayed)
    assert list(watch.first_tokens) == [size_class(100)]


@contextmanager
def paced_agent(tmp_path: Path) -> Iterator[str]:
    """An agent (primary) in front of tests/pacing_engine.py, ready: its URL."""
    process = agent(tmp_path, sys.executable, str(ENGINE), "{port}", role="primary")
    url = f"http://127.0.0.1:{process.port}"  # type: ignore[attr-defined]
    try:
        wait_until(lambda: _answers(lambda: httpx.get(url + Endpoint.READY, timeout=5).status_code == 200), 60, "ready")
        yield url
    finally:
        process.terminate()
        process.communicate(timeout=30)


def streamed(url: str, bodies: list[dict]) -> list[threading.Thread]:
    """Each body's streamed completion read to its end by a thread of its own (started)."""

    def read(body: dict) -> None:
        with httpx.stream("POST", url + Endpoint.COMPLETIONS, json=body | {"stream": True}, timeout=60) as response:
            assert response.status_code == 200
            for _ in response.iter_lines():
                pass

    threads = [threading.Thread(target=read, args=(body,), daemon=True) for body in bodies]
    for thread in threads:
        thread.start()
    return threads


def readiness_while(url: str, threads: list[threading.Thread]) -> list[tuple[float, int, str]]:
    """(time, status, reason) of the agent's /health/ready every 50 ms until ``threads`` end."""
    seen = []
    while any(thread.is_alive() for thread in threads):
        reply = httpx.get(url + Endpoint.READY, timeout=5)
        seen.append((time.monotonic(), reply.status_code, reply.json().get("reason", "")))
        time.sleep(0.05)  # a sampling period, not a synchronisation: the threads' end is the event waited for
    return seen


def test_a_stream_that_pauses_past_its_bound_makes_the_agent_unready_until_it_moves_again(tmp_path: Path) -> None:
    """A stream at 20 ms a token pauses for 3 s: /health/ready turns 503 with the reason (bound: the floor) within a
    second past the bound, and 200 again once tokens flow."""
    with paced_agent(tmp_path) as url:
        body = {"prompt": "hello", "max_tokens": 40, "step_s": 0.02, "pause_at": 10, "pause_s": 3.0}
        started = time.monotonic()
        seen = readiness_while(url, streamed(url, [body]))
    stalls = [(at, reason) for at, status, reason in seen if status == 503]
    assert stalls, seen
    first, reason = stalls[0]
    assert "the engine has made no progress for" in reason and "1 request(s) pending" in reason, reason
    bound = float(re.search(r"its bound: ([0-9.]+) s", reason).group(1))
    paused = started + 10 * 0.02  # when the tenth chunk was due: the pause began about then
    print(f"\nagent stall: 503 {first - paused:.2f} s after the pause began (bound {bound:.1f} s)")
    assert bound == STALL_FLOOR_S and first - paused <= bound + 1.0
    assert seen[-1][1] == 200  # progress again: ready


def test_slow_streams_a_long_first_token_and_an_idle_engine_keep_the_agent_ready(tmp_path: Path) -> None:
    """Slow but progressing (0.4 s a token), a long prompt's 2.5 s to its first token, and no requests at all:
    /health/ready stays 200 throughout."""
    with paced_agent(tmp_path) as url:
        slow = {"prompt": "hello", "max_tokens": 8, "step_s": 0.4}
        long = {"prompt": "word " * 4000, "max_tokens": 4, "first_s": 2.5}
        seen = readiness_while(url, streamed(url, [slow, long]))
        assert httpx.get(url + Endpoint.READY, timeout=5).status_code == 200  # idle
    assert len(seen) > 5 and {status for _, status, _ in seen} == {200}, [s for s in seen if s[1] != 200]
