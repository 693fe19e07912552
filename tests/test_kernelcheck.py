"""The kernels' check at warm-up (``standby.kernelcheck``): which ways of a decode step a decoder keeps, from what
each kernel's calls compute against plain torch on the same inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hotweights.standby import kernelcheck
from hotweights.standby.decodeattention import CHECKED
from hotweights.standby.fused import checked, checking
from hotweights.standby.kernelcheck import KernelVerdict, call_disagreement, probe_inputs, verdict

REFERENCE = torch.tensor([[4.0, -2.0, 0.5], [1.0, 3.0, -4.0]])


def rounded(logits: torch.Tensor) -> torch.Tensor:
    return logits + 0.01  # rounding of another sum order: well inside the tolerance


def wrong(logits: torch.Tensor) -> torch.Tensor:
    return logits.flip(-1)


def nan(logits: torch.Tensor) -> torch.Tensor:
    return torch.full_like(logits, float("nan"))


def fails(logits: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("PTX assembly aborted\nmore detail")


@pytest.mark.parametrize(
    ("split_kv", "attention", "fused", "expected", "warned"),
    [
        (True, rounded, rounded, (True, True), []),
        (True, wrong, rounded, (False, True), ["split-KV attention"]),
        (True, nan, fails, (False, False), ["split-KV attention", "the fused kernels"]),
        (True, rounded, fails, (True, False), ["the fused kernels"]),
        (False, fails, rounded, (False, True), []),  # no split-KV to check: never run
    ],
)
def test_a_decoder_keeps_only_the_kernels_that_compute_the_reference(
    split_kv: bool, attention: object, fused: object, expected: tuple[bool, bool], warned: list[str]
) -> None:
    calls: list[tuple[int | None, bool]] = []

    def step(kv_len: int | None, fuse: bool) -> torch.Tensor:
        """A step's one attention call (split-KV where ``kv_len`` is None), then with ``fuse`` one fused kernel's
        call, each checked against plain torch's on the same inputs; the logits are the last call's."""
        calls.append((kv_len, fuse))
        logits = REFERENCE if kv_len is not None else checked(CHECKED, attention(REFERENCE), lambda: REFERENCE)  # type: ignore[operator]
        return checked("rms_norm", fused(logits), lambda: logits) if fuse else logits  # type: ignore[operator]

    found = verdict(step, split_kv, 4096)
    assert (found.split_kv, found.fused) == expected
    assert [line.split(" on this device")[0] for line in found.warnings] == warned
    # The fused kernels are tried on top of the attention that passed, else the reference's masked length.
    assert calls[-1] == (None if found.split_kv else 4096, True)
    assert all("\n" not in line for line in found.warnings)


def test_the_probe_spreads_its_rows_over_the_whole_cache() -> None:
    tokens, positions = probe_inputs(4, 4096, 100, torch.device("cpu")).tolist()
    assert positions == [0, 1365, 2730, 4095] and all(0 <= t < 100 for t in tokens)
    assert probe_inputs(1, 512, 100, torch.device("cpu"))[1].tolist() == [511]


def test_each_kernel_call_is_held_against_plain_torch_on_its_own_inputs() -> None:
    """Rounding passes; a kernel far from plain torch on its inputs is named with its departure, one that gives a
    value that is not finite departs infinitely; logits that are not finite fail whatever the calls did."""
    tensor = torch.tensor([[4.0, -2.0, 0.5]])

    def step(*calls: tuple[str, torch.Tensor]) -> torch.Tensor:
        for name, got in calls:
            checked(name, got, lambda: tensor)
        return tensor

    assert call_disagreement(lambda: step(("rope", tensor + 0.01), ("silu_mul", tensor))) is None
    reason = call_disagreement(lambda: step(("rope", tensor.flip(-1)), ("silu_mul", tensor + float("nan"))))
    assert reason == "rope departs by 0.875 of the largest value, silu_mul departs by inf of the largest value"
    assert call_disagreement(lambda: tensor * float("nan")) == "a logit is not finite"
    with checking() as worst:
        checked("add_rms_norm", (tensor, tensor + 0.02), lambda: (tensor, tensor))
    assert list(worst) == ["add_rms_norm"] and 0 < worst["add_rms_norm"] < kernelcheck.TOLERANCE


def test_a_verdict_is_remembered_for_the_host_and_a_bad_file_is_checked_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOTWEIGHTS_HOME", str(tmp_path))
    key = kernelcheck.host_key(torch.device("cpu"), {"hidden": 64}, torch.bfloat16, 4096)
    assert key != kernelcheck.host_key(torch.device("cpu"), {"hidden": 64}, torch.bfloat16, 2048)
    assert kernelcheck.remembered(key) is None
    found = KernelVerdict(True, False, ("the fused kernels on this device do not compute what plain torch does",), 0.25)
    kernelcheck.remember(key, found)
    assert kernelcheck.remembered(key) == found
    assert [p.name for p in kernelcheck.verdict_path(key).parent.iterdir()] == [f"{key}.json"]  # no temporary left
    kernelcheck.verdict_path(key).write_text("{not json")
    assert kernelcheck.remembered(key) is None
