"""``hotweights.standby.sglang_server``'s choice of start method, from SGLang's arguments (its servers run in
tests/test_sglang.py)."""

from __future__ import annotations

import multiprocessing

import pytest

from hotweights.standby import sglang_server

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("argv", "device"),
    [
        (["--model-path", "m", "--device", "cpu"], "cpu"),
        (["--device=cpu", "--port", "1"], "cpu"),
        (["--device", "cuda", "--device", "cpu"], "cpu"),  # the last one, as argparse takes it
        (["--device", "cpu", "--device=cuda"], "cuda"),
        (["--model-path", "m"], None),
        (["--device"], None),  # no value: SGLang's argparse refuses it
        (["--served-model-name", "--device"], None),
    ],
)
def test_the_device_is_the_last_one_named(argv: list[str], device: str | None) -> None:
    assert sglang_server.device(argv) == device


def test_forked_children_whatever_start_method_sglang_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    original = multiprocessing.set_start_method
    monkeypatch.setattr(multiprocessing, "set_start_method", original)  # put back after the test
    previous = multiprocessing.get_start_method(allow_none=True)
    try:
        sglang_server.fork_children()
        multiprocessing.set_start_method("spawn", force=True)  # what SGLang's engine does at its start
        assert multiprocessing.get_start_method() == "fork"
    finally:
        original(previous, force=True)
