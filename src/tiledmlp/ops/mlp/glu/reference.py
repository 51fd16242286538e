"""PyTorch references of the fused GLU kernels: h = act(g) * u and its backward, in place.

In a gated MLP tile g = x W_gate^T and u = x W_up^T are (n, m) in the compute dtype and
h = act(g) * u feeds the down projection. Given dh = dy @ W_down, the backward is
du = dh * act(g) and dg = dh * u * act'(g), for SiLU, GELU with the tanh approximation and
exact (erf) GELU. These references run wherever the Triton kernels (ops/mlp/glu/triton_kernels.py) do not.

Invariant: the references evaluate the kernels' formulas, operation for operation, in float32
(float64 for float64 tensors, which only the references take) and round once, to the tensors'
dtype: a kernel and its reference give the same results.
"""

from __future__ import annotations

import math

import torch

from tiledmlp.ops.mlp.glu.activation import check_act

__all__ = ["act_and_grad", "glu_backward_reference", "glu_forward_reference"]

# Formula constants. The kernels spell them as literals (Triton reads no non-constexpr globals);
# Python floats round to the same float32 values in both.
_K2 = 2.0 * math.sqrt(2.0 / math.pi)  # 1.5957691216057308: gelu_tanh(x) = x * sigmoid(z)
_K2C = _K2 * 0.044715  # 0.07135481627260025: z = x * (_K2 + _K2C * x^2)
_K2C3 = 3.0 * _K2C  # 0.21406444881780073: dz/dx = _K2 + _K2C3 * x^2
_SQRT1_2 = math.sqrt(0.5)  # 0.7071067811865476
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)  # 0.3989422804014327


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def act_and_grad(x: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(x) and act'(x), elementwise in x's dtype, in the kernels' order of operations."""
    if act == "gelu":
        half_1pe = 0.5 * (1.0 + torch.erf(x * _SQRT1_2))
        return x * half_1pe, half_1pe + x * (_INV_SQRT_2PI * torch.exp(-0.5 * (x * x)))
    # silu(x) = x * sigmoid(x); gelu_tanh(x) = 0.5 x (1 + tanh(z/2)) = x * sigmoid(z) with
    # z = 2 sqrt(2/pi) (x + 0.044715 x^3): no tanh, no cancellation in 1 + tanh for x << 0.
    z = x if act == "silu" else x * (_K2 + _K2C * (x * x))
    s = torch.sigmoid(z)
    a = x * s
    da = s + a * (1.0 - s) if act == "silu" else s + a * (1.0 - s) * (_K2 + _K2C3 * (x * x))
    return a, da


def glu_forward_reference(
    g: torch.Tensor, u: torch.Tensor, act: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """h = act(g) * u in float32 (float64 for float64 g), stored in g's dtype.

    Elementwise, so any shape and strides; `out` may alias g or u exactly.

    Args:
        g: gate pre-activation, (n, m) or any shape.
        u: up projection, g's shape.
        act: "silu", "gelu_tanh" or "gelu".
        out: where to store h (g's shape); a new tensor when None.

    Returns:
        h, with g's shape and dtype (`out` when given).
    """
    check_act(act)
    x = g.to(_opmath(g.dtype))
    a, _ = act_and_grad(x, act)
    h = (a * u.to(x.dtype)).to(g.dtype)
    if out is None:
        return h
    return out.copy_(h)


def glu_backward_reference(
    g: torch.Tensor,
    u: torch.Tensor,
    dh: torch.Tensor,
    act: str,
    *,
    h_out: torch.Tensor | None = None,
) -> None:
    """In place: g <- dg = dh * u * act'(g), u <- du = dh * act(g) [, h_out <- act(g) * u].

    Computed in float32 (float64 for float64 g) from the values before any write, stored in
    each destination's dtype. Elementwise, so any shape and strides; `dh` and `h_out` may alias
    each other exactly.

    Args:
        g: gate pre-activation, (n, m); overwritten with dg.
        u: up projection, (n, m); overwritten with du.
        dh: gradient of h, (n, m).
        act: "silu", "gelu_tanh" or "gelu".
        h_out: optional (n, m) destination for the forward value h.
    """
    check_act(act)
    x = g.to(_opmath(g.dtype))
    uf = u.to(x.dtype)
    dhf = dh.to(x.dtype)
    a, da = act_and_grad(x, act)
    h = a * uf if h_out is not None else None
    dg = (dhf * uf) * da
    du = dhf * a
    g.copy_(dg)
    u.copy_(du)
    if h_out is not None:
        h_out.copy_(h)  # type: ignore[arg-type]
