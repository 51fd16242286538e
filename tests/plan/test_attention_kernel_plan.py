"""The planner's attention buffers per kernel (plan/device_overhead.py) and `tiledmlp plan
--attention-kernel`'s refusal of a kernel the planned device cannot run."""

from __future__ import annotations

import pytest
import torch

from tiledmlp.cli import main
from tiledmlp.ops.attention.buffers import AttentionShape, backward_buffer_bytes
from tiledmlp.plan.device_overhead import device_overhead


@pytest.mark.parametrize("kernel", ["cudnn", "flash", "efficient", "math"])
def test_each_kernels_buffers_at_the_simulated_call(kernel: str) -> None:
    buffers = device_overhead("cuda", kernel).buffers
    assert buffers is not None and buffers.kernel == kernel
    q = torch.empty(1, 32, 1000, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 8, 1000, 128, dtype=torch.bfloat16, device="meta")
    got = buffers.nbytes(None, (q, q, k, k))
    assert got == backward_buffer_bytes(kernel, AttentionShape(1, 32, 8, 1000, 128, 2))
    # by hand: cuDNN 1000 x 32 x 257 x 4 + 256; flash softmax_d + dq_accum (1,024 rows) and
    # dk, dv expanded to 32 heads
    hand = {"cudnn": 1000 * 32 * 257 * 4 + 256,
            "flash": 32 * 1024 * 4 + 1024 * 32 * 128 * 4 + 2 * 1000 * 32 * 128 * 2,
            "efficient": 32 * 1000 * 4 + 1000 * 32 * 128 * 4,
            "math": 2 * 32 * 1000 * 1000 * 4}  # fmt: skip
    assert got == hand[kernel]
    assert device_overhead("cpu", kernel).buffers is None


def test_plan_refuses_a_kernel_the_device_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "tiny", "--device", "cpu", "--seq-len", "256",
                 "--attention-kernel", "flash"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert err[-1] == (
        "tiledmlp plan: error: --attention-kernel flash: the flash attention kernel runs on CUDA "
        "GPUs, not on cpu; use auto or another kernel"
    )
