"""The weight cache on a real GPU: both CUDA backends, end to end (skipped without CUDA)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

from hotweights.cache.loadspec import LoadSpec
from hotweights.cache.pipeline import load_processed
from hotweights.standby.model import generate
from hotweights.standby.weights import load_model
from hotweights.tokenizer import load_tokenizer
from tests.attach_worker import PROMPT, tensor_digest
from tests.cachehelpers import Engine, ProcessDaemon, ThreadDaemon

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
DEVICE = "cuda:0"


@pytest.fixture
def sock(monkeypatch: pytest.MonkeyPatch) -> Path:
    path = Path(tempfile.mkdtemp(prefix="hw-", dir="/tmp"))
    monkeypatch.setenv("HOTWEIGHTS_RUNTIME_DIR", str(path))
    return path / "gpu.sock"


def off_mode_tokens(model: Path) -> list[int]:
    loaded = load_model(model, LoadSpec(device=DEVICE))
    ids = load_tokenizer(loaded.checkpoint.path).encode(PROMPT).ids
    return list(generate(loaded.model, ids, 12))


@pytest.mark.parametrize("backend", ["cuda-vmm", "cuda-ipc"])
def test_attached_tensors_equal_off_mode_on_gpu(tiny_model: Path, sock: Path, backend: str) -> None:
    reference = {n: tensor_digest(t) for n, t in load_processed(tiny_model, LoadSpec(device=DEVICE)).items()}
    # The engine is another process: cuda-ipc handles cannot be opened by the process that made them.
    with (
        ThreadDaemon(tiny_model, sock, spec=LoadSpec(device=DEVICE), backend=backend),
        Engine(tiny_model, sock, device=DEVICE) as engine,
    ):
        assert engine.hello["source"] == "cache"
        assert engine.ask("digest")["digests"] == reference


@pytest.mark.parametrize("backend", ["cuda-vmm", "cuda-ipc"])
@pytest.mark.parametrize("fixture", ["tiny_model", "tiny_fp8_model"])
def test_engines_on_gpu_survive_daemon_sigkill(
    request: pytest.FixtureRequest, sock: Path, backend: str, fixture: str
) -> None:
    model = request.getfixturevalue(fixture)
    reference = off_mode_tokens(model)
    extra = ("--device", DEVICE, "--backend", backend)
    with ProcessDaemon(model, sock, *extra) as daemon, Engine(model, sock, device=DEVICE) as engine:
        assert engine.hello["source"] == "cache"
        assert engine.ask("generate")["tokens"] == reference
        daemon.kill()
        assert engine.ask("generate")["tokens"] == reference
        with ProcessDaemon(model, sock, *extra), Engine(model, sock, device=DEVICE) as fresh:
            assert fresh.ask("generate")["tokens"] == reference
