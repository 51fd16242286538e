"""The tiled backward never returns a silently wrong gradient: a graph of the backward
(create_graph=True) is exact through the tiled MLP and refused by the tiled loss (which forms its
gradients in the forward); tensors changed in place between forward and backward raise, as
autograd raises for the untiled module."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.func import functional_call

from tiledmlp import TiledMLP, TiledMLPConfig, tiled_cross_entropy, tiled_mlp

from conftest import assert_close_rel, make_mlp


def _mlp(kind: str) -> nn.Module:
    return make_mlp(kind, 6, 10).double()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["swiglu", "fused_bias", "plain", "relu_inplace", "normed"])
def test_double_backward_is_exact(kind: str) -> None:
    # create_graph=True through the tiled MLP: second-order gradients by finite differences.
    tiled = TiledMLP(_mlp(kind), TiledMLPConfig(num_tiles=3))
    names = [n for n, _ in tiled.named_parameters()]
    params = tuple(p.detach().clone().requires_grad_() for p in tiled.parameters())
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        return functional_call(tiled, dict(zip(names, ps)), (x,))

    assert torch.autograd.gradgradcheck(f, (x, *params), eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("kind", ["swiglu", "normed"])
def test_gradient_penalty_matches_untiled(kind: str) -> None:
    # A WGAN-GP-style penalty on the input gradient plus one on the weight gradients, float32.
    mlp = make_mlp(kind, 16, 24)
    x = torch.randn(2, 7, 16)

    def penalty_grads(fn):
        mlp.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = fn(xi)
        gx, *gp = torch.autograd.grad(y.pow(2).sum(), [xi, *mlp.parameters()], create_graph=True)
        (gx.pow(2).sum() + sum(g.pow(2).sum() for g in gp)).backward()
        return [xi.grad, *(p.grad for p in mlp.parameters())]

    got = penalty_grads(lambda t: tiled_mlp(mlp, t, num_tiles=3))
    ref = penalty_grads(mlp)
    for i, (g, r) in enumerate(zip(got, ref)):
        assert_close_rel(g, r, f"grad {i}", rtol=1e-4)


def test_create_graph_through_tiled_cross_entropy_raises() -> None:
    h = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (9,))
    loss = tiled_cross_entropy(h, w, labels, num_tiles=3)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(loss, [h, w], create_graph=True)


def _last_linear(mlp: nn.Module) -> nn.Linear:
    return [m for m in mlp.modules() if isinstance(m, nn.Linear)][-1]


def test_untiled_module_raises_for_a_weight_changed_before_backward() -> None:
    # What the tiled op must mirror.
    mlp = _mlp("swiglu")
    y = mlp(torch.randn(3, 6, dtype=torch.float64, requires_grad=True))
    with torch.no_grad():
        _last_linear(mlp).weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.parametrize("kind", ["swiglu", "fused", "plain", "normed"])
@pytest.mark.parametrize("x_grad", [True, False])
def test_weight_changed_in_place_before_backward_raises(kind: str, x_grad: bool) -> None:
    mlp = _mlp(kind)
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=x_grad)
    y = tiled_mlp(mlp, x, num_tiles=3)
    with torch.no_grad():
        _last_linear(mlp).weight.mul_(2.0)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: parameter '"):
        y.sum().backward()


def test_input_changed_in_place_before_backward_raises() -> None:
    mlp = _mlp("swiglu")
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    h = x * 1.0
    y = tiled_mlp(mlp, h, num_tiles=3)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


class Scaled(nn.Module):
    """A token-wise module with a per-token extra input: fc2(tanh(fc1(x)) * scale)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.fc2 = nn.Linear(10, 6)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)) * scale)


def test_per_token_input_without_grad_changed_in_place_raises() -> None:
    torch.manual_seed(0)
    mlp = Scaled().double()
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(7, 1, dtype=torch.float64)
    y = tiled_mlp(mlp, x, scale, num_tiles=3)
    with torch.no_grad():
        scale.mul_(3.0)
    with pytest.raises(RuntimeError, match="extra input 0"):
        y.sum().backward()


def test_double_backward_with_a_per_token_input_is_exact() -> None:
    torch.manual_seed(0)
    mlp = Scaled().double()
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    scale = torch.rand(7, 1, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return tiled_mlp(mlp, x, scale, num_tiles=3)

    assert torch.autograd.gradgradcheck(f, (x, scale), eps=1e-6, atol=1e-6, rtol=1e-4)


def _in_place_outcome(mlp: nn.Module, name: str, run, x: torch.Tensor) -> str | None:
    """The error message (None: no error) of run(mlp, x).sum().backward() after `name` was
    changed in place between forward and backward."""
    y = run(mlp, x)
    with torch.no_grad():
        dict(mlp.named_parameters())[name].mul_(2.0)
    try:
        y.float().sum().backward()
    except RuntimeError as e:
        return str(e)
    return None


@pytest.mark.parametrize("kind", ["swiglu", "swiglu_bias", "fused_bias", "plain", "relu_inplace"])
@pytest.mark.parametrize(
    ("x_grad", "frozen_first", "autocast"),
    [(True, False, False), (False, False, False), (False, True, False), (True, False, True)],
)
def test_in_place_message_says_what_the_untiled_module_does(
    kind: str, x_grad: bool, frozen_first: bool, autocast: bool
) -> None:
    # Autograd raises for the untiled module only for tensors its backward keeps (a Linear's
    # weight when its input needs a gradient; never a bias, nor a weight autocast copies).
    # The tiled backward always refuses; its message must say which case it is.
    names = [n for n, _ in make_mlp(kind, 6, 10).named_parameters()]
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else nullcontext()
    for name in names:
        outcomes = []
        for run in (lambda m, t: m(t), lambda m, t: tiled_mlp(m, t, num_tiles=3)):
            mlp = make_mlp(kind, 6, 10)
            if frozen_first:
                for n, p in mlp.named_parameters():
                    p.requires_grad_(not n.startswith(("gate", "up", "fc1")))
            x = torch.randn(2, 5, 6, requires_grad=x_grad)
            with ctx:
                outcomes.append(_in_place_outcome(mlp, name, run, x))
        untiled, tiled = outcomes
        assert tiled is not None and f"parameter {name!r}" in tiled, (name, tiled)
        if untiled is not None:
            assert "The untiled module raises here too." in tiled, (name, tiled)
        else:
            assert "The untiled module would not raise here" in tiled, (name, tiled)
