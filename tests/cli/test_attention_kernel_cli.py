"""`tiledmlp train --attention-kernel`: a kernel this machine or dtype cannot run is refused in
one line before any work; math, auto and (on the CPU) by_heads are taken."""

from __future__ import annotations

import pytest
import torch

from tiledmlp.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal of a CPU-only machine")
@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient"])
def test_train_refuses_a_gpu_kernel_on_the_cpu(
    kernel: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["train", "--model", "tiny", "--max-steps", "1", "--attention-kernel", kernel])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert err == [
        f"tiledmlp train: error: --attention-kernel {kernel}: the {kernel} attention kernel runs "
        "on CUDA GPUs, and this machine has none; use auto or math"
    ]


def test_train_refuses_an_unknown_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", "--model", "tiny", "--max-steps", "1", "--attention-kernel", "fast"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1
    assert "attention_kernel must be auto, auto:<GB> or one of cudnn, by_heads, flash" in err[0]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's run of by_heads")
def test_train_takes_by_heads_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    """by_heads runs on the CPU (its flash kernel by head groups): taken, one step trains
    (about 20 s)."""
    code = main(["train", "--model", "tiny", "--max-steps", "1", "--seq-len", "64",
                 "--attention-kernel", "by-heads"])  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.err
