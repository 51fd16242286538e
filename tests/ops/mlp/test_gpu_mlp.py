"""CUDA: the tiled MLP's weight gradients accumulate in float32 inside the GEMM (error at most
the untiled bf16 module's against a float64 reference), and its peak memory stays below the
untiled module's and the memory model's bound. Skipped with a reason without a GPU; the logic
of the accumulation path is covered on the CPU by the scratch path's tests (tests/ops/mlp/test_lowprec.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tiledmlp import tiled_mlp
from tiledmlp.models.mlps import GatedMLP
from tiledmlp.ops import recognise
from tiledmlp.ops.mlp.memory_model import MemoryModel
from tiledmlp.ops.tiling.grads import fp32_epilogue

pytestmark = pytest.mark.gpu


def _grads(mlp: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor, fn) -> list[torch.Tensor]:
    for p in mlp.parameters():
        p.grad = None
    xi = x.detach().clone().requires_grad_()
    fn(mlp, xi).backward(dy.to(xi.dtype))
    return [xi.grad] + [p.grad for p in mlp.parameters()]


def test_bf16_weight_grads_accumulate_in_float32() -> None:
    assert fp32_epilogue(torch.device("cuda"), torch.bfloat16)
    torch.manual_seed(0)
    base = GatedMLP(1024, 3072).cuda()
    ref = copy.deepcopy(base).double()
    low = copy.deepcopy(base).bfloat16()
    x = torch.randn(1, 16384, 1024, device="cuda")
    dy = torch.randn(1, 16384, 1024, device="cuda")
    want = _grads(ref, x.double(), dy.double(), lambda m, t: m(t))
    untiled = _grads(low, x.bfloat16(), dy, lambda m, t: m(t))
    tiled = _grads(low, x.bfloat16(), dy, lambda m, t: tiled_mlp(m, t, num_tiles=16))
    for i, (w, u, t) in enumerate(zip(want, untiled, tiled)):
        eu = ((u.double() - w).norm() / w.norm()).item()
        et = ((t.double() - w).norm() / w.norm()).item()
        assert et <= 2 * eu + 1e-6, f"tensor {i}: tiled {et:.2e} > 2 x untiled {eu:.2e}"
    for w, u, t in zip(want[1:], untiled[1:], tiled[1:]):  # weights: float32 sums, never worse
        assert (t.double() - w).norm() <= (u.double() - w).norm() * 1.05


@pytest.mark.parametrize("tiles", [1, 4, "auto"])
def test_peak_memory_below_untiled_and_the_model(tiles: int | str) -> None:
    torch.manual_seed(0)
    mlp = GatedMLP(2048, 6144).cuda().bfloat16()
    x = torch.randn(1, 32768, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def peak(fn) -> int:
        torch.cuda.synchronize()
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(x).backward(dy)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    tiled_mlp(mlp, x[:, :64], num_tiles=2)  # structure probe and kernels compiled outside
    untiled = peak(mlp)
    got = peak(lambda t: tiled_mlp(mlp, t, num_tiles=tiles))
    grads = sum(p.numel() * p.element_size() for p in mlp.parameters()) + x.numel() * 2
    structure = recognise(mlp)
    assert structure is not None
    model = MemoryModel(structure, torch.bfloat16)
    assert got <= untiled
    if tiles == 4:
        # output + gradients + one tile's working memory and the accumulators, by the model
        bound = grads + x.numel() * 2 + model.tiled_bytes(32768 // 4)
        assert got <= bound * 1.05, (got / 2**20, bound / 2**20)
