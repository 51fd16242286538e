"""Hub kernels (the `kernels` package's `kernelize`, which transformers' models use through
`use_kernel_forward_from_hub`): a module whose forward a hub kernel replaced is left alone and
named in the report, never wrapped twice; the rest of the model is tiled exactly.

The kernel here comes from a repository object of this test (kernels' RepositoryProtocol: a
`load()` returning the layer class), so nothing is downloaded; `kernelize` itself is the real
one and does what it does with a hub repository (binds the layer's forward on the instance and
records the repository in `_kernel_repo`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tiledmlp import patch_model, unpatch_model
from tiledmlp.patching.state import STATE

from conftest import assert_close_rel

kernels = pytest.importorskip("kernels")


class _SwiGLUKernel(nn.Module):
    """The hub layer: a forward over the module's own weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Repository:
    layer_name = "_SwiGLUKernel"

    def load(self) -> type[nn.Module]:
        return _SwiGLUKernel


@kernels.use_kernel_forward_from_hub("TestSwiGLU")
class _HubMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(16, 24, bias=False)
        self.up_proj = nn.Linear(16, 24, bias=False)
        self.down_proj = nn.Linear(24, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))  # not the kernel's


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hub = _HubMLP()
        self.plain_mlp = _plain()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plain_mlp(self.hub(x))


def _plain() -> nn.Module:
    from conftest import make_mlp

    return make_mlp("swiglu", hidden=16, intermediate=24)


def _kernelized() -> nn.Module:
    torch.manual_seed(0)
    model = _Model()
    with kernels.use_kernel_mapping({"TestSwiGLU": {"cpu": _Repository()}}):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")
    assert model.hub.__dict__.get("_kernel_repo") is not None  # kernelize replaced its forward
    return model


def _step(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(x)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return [out.detach(), *(p.grad.clone() for p in model.parameters())]  # type: ignore[union-attr]


def test_a_hub_kernel_is_left_alone_and_named_the_rest_tiled_exactly() -> None:
    x = torch.randn(2, 9, 16)
    ref = _step(_kernelized(), x)
    model = _kernelized()
    hub_forward = model.hub.__dict__["forward"]
    for _ in range(2):  # patch, unpatch, patch again: never wrapped twice
        report = patch_model(model, num_tiles=3, hidden_size=16)
        assert report.patched == ["plain_mlp"]
        assert any(
            name == "hub" and "runs a hub kernel (_SwiGLUKernel" in why and "left alone" in why
            for name, why in report.skipped
        ), report.skipped
        assert STATE not in model.hub.__dict__ and model.hub.__dict__["forward"] is hub_forward
        for i, (a, b) in enumerate(zip(_step(model, x), ref)):
            assert_close_rel(a, b, f"tensor {i}")
        unpatch_model(model)
        assert model.hub.__dict__["forward"] is hub_forward
