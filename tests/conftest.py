"""Shared fixtures: real checkpoints on disk, written once per test session, and a world of its own for
every test.

Every test runs with ``HOTWEIGHTS_HOME`` and ``HOTWEIGHTS_RUNTIME_DIR`` set to fresh directories of its own
(in ``os.environ``, so the hotweights processes it starts inherit them): nothing a user ran before (a
``hotweights up`` under ``~/.cache/hotweights``, daemons in the runtime dir) changes an outcome. The
directories are short ones in /tmp, because the sockets under them must fit in 108 bytes.

Spread over workers (``pytest -n 2``, pytest-xdist), a module's tests run on one worker, one after another, so
module-scoped stacks are started once. The modules that start a real vLLM or SGLang, or drill a fault storm
(``SERIAL``), share one worker and so never run at the same time as each other: each keeps the two cores'
spare time that its timing needs. They start first, then the longest of the others (``LONG``), so that no long
module is left for the end.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from hotweights.paths import DEFAULT_MODEL_NAME

SERIAL = ("test_sglang.py", "test_vllm.py", "test_chaos.py", "test_redundancy_faults.py")
UNIT_MARK = "pytest.mark.unit"  # how a test module marks its unit tests (or all of them, as ``pytestmark``)
LONG = (  # longest first
    "test_rollout.py",
    "test_controller_up.py",
    "test_controller.py",
    "test_recover.py",
    "test_state_dir_faults.py",
    "test_readme.py",
    "test_openapi.py",
)

# Tests spawn many torch processes on small machines; one thread each keeps them from thrashing (torch reads it when
# it starts, in this process too). Nothing here imports torch before a fixture needs it: the fast tier
# (``pytest -m unit``) runs where torch is not installed.
os.environ["OMP_NUM_THREADS"] = "1"
if "torch" in sys.modules:  # a plugin imported it first, before the variable was set
    sys.modules["torch"].set_num_threads(1)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The fast tier (``-m unit``) where torch is not installed: a test module with no unit test is not even
    imported (most import torch); one with unit tests must import without torch (``.ci/run`` runs the tier so)."""
    if config.option.markexpr != "unit" or importlib.util.find_spec("torch") is not None:
        return None
    if collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    return UNIT_MARK not in collection_path.read_text() or None


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """pytest-xdist's module-by-module scheduling, with the ``SERIAL`` modules as one unit, in the order collected."""
    from xdist.scheduler import LoadScopeScheduling

    class Modules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "serial" if Path(module).name in SERIAL else module

    config.option.loadscopereorder = False  # keep the order pytest_collection_modifyitems gives
    return Modules(config, log)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """On a pytest-xdist worker: SERIAL, then LONG, then the rest, in the order collected."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        order = {name: rank for rank, name in enumerate(SERIAL + LONG)}
        items.sort(key=lambda item: order.get(item.path.name, len(order)))


@contextlib.contextmanager
def world(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh HOTWEIGHTS_HOME (``<world>/home``) and runtime dir (``<world>/run``), removed at the end."""
    path = Path(tempfile.mkdtemp(prefix="hw-", dir="/tmp"))
    monkeypatch.setenv("HOTWEIGHTS_HOME", str(path / "home"))
    monkeypatch.setenv("HOTWEIGHTS_RUNTIME_DIR", str(path / "run"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def session_world() -> Iterator[Path]:
    """The world of session- and module-scoped fixtures (set up before any test's own)."""
    with pytest.MonkeyPatch.context() as patch, world(patch) as path:
        yield path


@pytest.fixture(autouse=True)
def own_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This test's world."""
    with world(monkeypatch) as path:
        yield path


@pytest.fixture(scope="session")
def shared_default_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model, generated once per session (outside any test's home)."""
    from hotweights.cache.makemodel import ensure_default_model

    home = tmp_path_factory.mktemp("default-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOTWEIGHTS_HOME", str(home))
        return ensure_default_model()


@pytest.fixture
def default_model(own_world: Path, shared_default_model: Path) -> Path:
    """This test's home with the default model already in place (a link to the session's copy), so
    ``hotweights up`` and the drill without a model path start without generating it again."""
    models = own_world / "home" / "models"
    models.mkdir(parents=True)
    (models / DEFAULT_MODEL_NAME).symlink_to(shared_default_model)
    return models / DEFAULT_MODEL_NAME


def make_checkpoint(out: Path, *, quant: str | None = None, tie: bool = False, seed: int = 0, **fields) -> Path:
    """A tiny-preset checkpoint in float32 at ``out`` (torch imported here, on first use)."""
    import torch

    from hotweights.cache.makemodel import PRESETS, write_checkpoint

    config = replace(PRESETS["tiny"], tie_word_embeddings=tie, **fields)
    return write_checkpoint(
        out, config, dtype=torch.float32, quant=quant, seed=seed, shard_size=1 << 20, progress=False
    )


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny preset in float32 (exact comparisons), split over several shards."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def tiny_fp8_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-fp8", quant="fp8-block")


@pytest.fixture(scope="session")
def tiny_tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-tied", tie=True)
