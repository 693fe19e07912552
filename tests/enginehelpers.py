"""Real ``hotweights engine`` processes on loopback, always killed at the end."""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Self

import httpx
import pytest

from hotweights.cache.loadspec import LoadSpec
from hotweights.contract import Endpoint
from hotweights.ports import free_port
from hotweights.spawn import SparePipes, hotweights_command, parse_message, send_message
from hotweights.tokenizer import load_tokenizer, stop_token_ids
from tests.cachehelpers import ENV


@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    """A loopback port that a real socket of this test listens on while the block runs."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def in_use(port: int) -> str:
    return f"127.0.0.1:{port} is in use by another process: stop it or choose another port"


def refusal_on_taken_port(*command: str) -> tuple[int, str]:
    """Run the hotweights ``command`` with ``--port`` set to a taken port; return that port and its stderr
    once it has exited 2 (a 30 s limit: a refusal must come before anything slow)."""
    with taken_port() as port:
        result = subprocess.run(
            hotweights_command(*command, "--port", str(port)), capture_output=True, text=True, timeout=30
        )
    assert result.returncode == 2, result.stderr
    return port, result.stderr


class ChildService:
    """A real child process answering HTTP on loopback. Its output goes to a file (a full pipe would block
    its logging) that failures quote; ``close`` kills it, whatever the test did."""

    name = "service"
    ready_path = "/"  # answers 200 once the service is ready

    def __init__(
        self, command: list[str], base_url: str, *, env: dict[str, str] | None = ENV, pass_fds: tuple[int, ...] = ()
    ) -> None:
        self.log = tempfile.NamedTemporaryFile(prefix=f"{self.name}-", suffix=".log", delete=False)  # noqa: SIM115
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=self.log, pass_fds=pass_fds)
        self.client = httpx.Client(base_url=base_url, timeout=30.0)

    def wait_ready(self, timeout: float = 60.0) -> Self:
        """Poll ``ready_path``; fail with the log if the process exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.logs()}")
            with contextlib.suppress(httpx.TransportError):
                if self.client.get(self.ready_path).status_code == 200:
                    return self
            time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready after {timeout} s:\n{self.logs()}")

    def logs(self) -> str:
        return Path(self.log.name).read_text()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.client.close()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)

    def __enter__(self) -> Self:
        try:
            return self.wait_ready()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


class EngineProcess(ChildService):
    """One ``hotweights engine``; with ``token``, role changes need it."""

    name = "engine"
    ready_path = Endpoint.READY

    def __init__(self, model: Path, *extra: str, token: str | None = None, pass_fds: tuple[int, ...] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        self.token_file = Path(tempfile.mkdtemp(prefix="engine-token-")) / "token"
        command = hotweights_command("engine", "--model", str(model), "--port", str(self.port))
        if token is not None:
            self.token_file.write_text(token + "\n")
            command += ["--token-file", str(self.token_file)]
        super().__init__([*command, *extra], self.url, pass_fds=pass_fds)

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def post(self, path: str, **kwargs: object) -> httpx.Response:
        return self.client.post(path, headers=self.auth(), **kwargs)

    def complete(self, **body: object) -> httpx.Response:
        return self.client.post(Endpoint.COMPLETIONS, json=body)

    def stream(self, headers: dict[str, str] | None = None, **body: object) -> list[dict]:
        """The SSE chunks of a streamed completion (``[DONE]`` checked and dropped)."""
        with self.client.stream(
            "POST", Endpoint.COMPLETIONS, json=body | {"stream": True}, headers=headers
        ) as response:
            assert response.status_code == 200, response.read()
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]

    def stop(self, sig: int = signal.SIGKILL, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self.close()

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.token_file.parent, ignore_errors=True)


Reference = Callable[..., tuple[str, int]]

SAMPLINGS = [
    pytest.param({"temperature": 0.0}, id="greedy"),
    pytest.param({"temperature": 0.9, "top_p": 0.9, "seed": 7}, id="seeded"),
]


class SpareEngine(EngineProcess):
    """An engine started as the controller starts a spare (``controller.spares``): it prepares, says so on its
    ready pipe (``wait_prepared``), and goes on only when ``start`` writes its byte."""

    def __init__(self, model: Path, *extra: str) -> None:
        pipes = SparePipes.open()
        self.start_fd, self.ready_fd = pipes.start_fd, pipes.ready_fd
        try:
            super().__init__(model, *extra, *pipes.flags, pass_fds=pipes.theirs)
        finally:
            pipes.close_theirs()

    def wait_prepared(self, timeout: float = 60.0) -> Self:
        readable, _, _ = select.select([self.ready_fd], [], [], timeout)
        if not readable or (message := parse_message(os.read(self.ready_fd, select.PIPE_BUF))) is None:
            raise RuntimeError(f"spare not prepared in {timeout} s:\n{self.logs()}")
        self.holds = message
        return self

    def start(self, slot: dict[str, object] | None = None) -> Self:
        send_message(self.start_fd, slot or {})
        os.close(self.start_fd)
        self.start_fd = -1
        return self.wait_ready()

    def close(self) -> None:
        super().close()
        for fd in (self.start_fd, self.ready_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def reference_completer(model_dir: Path, device: str = "cpu") -> Reference:
    """In-process ``generate()`` at TP=1 on ``device``: (text, completion tokens) for a prompt."""
    from hotweights.standby.model import generate  # the engine's modules import torch: on first use only
    from hotweights.standby.weights import load_model

    model = load_model(model_dir, LoadSpec(device=device)).model
    tokenizer = load_tokenizer(model_dir)
    stop_ids = stop_token_ids(model_dir)

    def complete(prompt: str, max_tokens: int, **sampling: object) -> tuple[str, int]:
        ids = list(generate(model, tokenizer.encode(prompt).ids, max_tokens, stop_ids=stop_ids, **sampling))
        return tokenizer.decode(ids), len(ids)

    return complete


def streamed(chunks: list[dict], n: int = 1) -> tuple[list[str], list[str | None]]:
    texts, reasons = [""] * n, [None] * n
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
            reasons[choice["index"]] = choice["finish_reason"] or reasons[choice["index"]]
    return texts, reasons


def check_equal_to_reference(engine: EngineProcess, reference: Reference, sampling: dict) -> None:
    """Two prompts at once (one batched decode), whole and streamed, give the reference's texts."""
    prompts = ["The quick brown fox", "Once upon a time"]
    expected = [reference(p, 24, **sampling) for p in prompts]

    body = engine.complete(prompt=prompts, max_tokens=24, **sampling)
    assert body.status_code == 200, body.text
    body = body.json()
    assert [c["text"] for c in body["choices"]] == [text for text, _ in expected]
    assert body["usage"]["completion_tokens"] == sum(n for _, n in expected)

    chunks = engine.stream(prompt=prompts, max_tokens=24, stream_options={"include_usage": True}, **sampling)
    texts, reasons = streamed(chunks, 2)
    assert texts == [text for text, _ in expected]
    assert reasons == [c["finish_reason"] for c in body["choices"]]
    assert chunks[-1]["usage"] == body["usage"]
