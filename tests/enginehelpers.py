"""Real ``hotweights engine`` processes on loopback, always killed at the end."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tests.cachehelpers import ENV


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    """One engine; stderr goes to a file (a full pipe would block the engine's logging)."""

    def __init__(self, model: Path, *extra: str, token: str | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.token = token
        self.log = tempfile.NamedTemporaryFile(prefix="engine-", suffix=".log", delete=False)  # noqa: SIM115
        command = [sys.executable, "-m", "controller.cli", "engine", "--model", str(model), "--port", str(self.port)]
        if token is not None:
            token_file = Path(self.log.name).with_suffix(".token")
            token_file.write_text(token + "\n")
            command += ["--token-file", str(token_file)]
        self.process = subprocess.Popen([*command, *extra], env=ENV, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.client = httpx.Client(base_url=self.url, timeout=30.0)

    def wait_ready(self, timeout: float = 60.0) -> EngineProcess:
        """Poll /health/ready; fail with the engine's log if it exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"engine exited with {self.process.returncode}:\n{self.logs()}")
            try:
                if self.client.get("/health/ready").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"engine not ready after {timeout} s:\n{self.logs()}")

    def logs(self) -> str:
        return Path(self.log.name).read_text()

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def post(self, path: str, **kwargs: object) -> httpx.Response:
        return self.client.post(path, headers=self.auth(), **kwargs)

    def complete(self, **body: object) -> httpx.Response:
        return self.client.post("/v1/completions", json=body)

    def stream(self, **body: object) -> list[dict]:
        """The SSE chunks of a streamed completion (``[DONE]`` checked and dropped)."""
        with self.client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response:
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
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)
        self.client.close()
        self.process.stdout.close()
        self.log.close()
        for path in (Path(self.log.name), Path(self.log.name).with_suffix(".token")):
            path.unlink(missing_ok=True)

    def __enter__(self) -> EngineProcess:
        try:
            return self.wait_ready()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
