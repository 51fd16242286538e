"""The recognised tiled MLP as the custom operators tiledmlp::mlp and tiledmlp::mlp_backward,
for torch.compile (listed in ops/library.py; ops/mlp/traced.py calls them).

The forward runs FastEngine's tile loop; its autograd formula calls tiledmlp::mlp_backward,
FastEngine's backward: minimal recompute, each weight's gradient summed over tiles in one buffer
and returned once. The MLP is given as tensors (weights and biases), its kind, its activation's
name and the tile sizes, never as a module.

Invariant: the same tile math, plan and results as TiledMLPFunction on the same module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tiledmlp.ops.mlp.fast import FastEngine
from tiledmlp.ops.mlp.structure import MLPKind, MLPStructure
from tiledmlp.ops.tiling.backend import LOCAL
from tiledmlp.ops.tiling.operators import autograd_inside, operator_compute_dtype
from tiledmlp.ops.tiling.state import AutocastState
from tiledmlp.ops.tiling.tiles import TilePlan

__all__ = ["ACTIVATIONS", "mlp", "mlp_backward"]

#: the activations the MLP operator computes by name (ops/mlp/glu/activation.py's kinds)
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


def _activation(name: str) -> nn.Module:
    if name == "silu":
        return nn.SiLU()
    if name == "gelu_tanh":
        return nn.GELU(approximate="tanh")
    if name == "gelu":
        return nn.GELU()
    raise ValueError(f"tiledmlp::mlp: activation must be one of {ACTIVATIONS}, got {name!r}")


class _Projection:
    """A weight and an optional bias standing where MLPStructure holds an nn.Linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]


def _structure(
    kind: str, act: str, gate_first: bool, projections: list[_Projection]
) -> MLPStructure:
    return MLPStructure(
        kind=MLPKind(kind),
        first=tuple(projections[:-1]),  # type: ignore[arg-type]
        down=projections[-1],  # type: ignore[arg-type]
        act=_activation(act),
        gate_first=gate_first,
        act_in_place=False,
        child_ids=(),
    )


def _engine(
    kind: str,
    act: str,
    gate_first: bool,
    tensors: list[torch.Tensor | None],
    autocast_dtype: torch.dtype | None,
    device: torch.device,
    kernels: bool,
) -> FastEngine:
    """The fast engine of the MLP whose (weight, bias) pairs are `tensors` (first projections,
    then down; a gated MLP's up projection second)."""
    pairs = [(tensors[i], tensors[i + 1]) for i in range(0, len(tensors), 2)]
    projections = [_Projection(w, b) for w, b in pairs if w is not None]
    autocast = AutocastState(
        device_type=device.type,
        enabled=autocast_dtype is not None,
        dtype=autocast_dtype if autocast_dtype is not None else torch.float32,
        cache_enabled=False,
    )
    return FastEngine(_structure(kind, act, gate_first, projections), autocast, LOCAL, kernels)


@torch.library.custom_op("tiledmlp::mlp", mutates_args=())
def mlp(
    x: torch.Tensor,
    first_weight: torch.Tensor,
    first_bias: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    kind: str,
    act: str,
    gate_first: bool,
    splits: list[int],
    autocast_dtype: torch.dtype | None,
    kernels: bool,
) -> torch.Tensor:
    """The tiled MLP's forward on x (tokens, hidden): (tokens, out) in the compute dtype.

    kind: "gated" (first = gate, up = up), "fused_gated" (first = gate_up; gate_first says which
    half is the gate) or "plain" (first = fc1); act: one of ACTIVATIONS; splits: the tile sizes
    (summing to tokens); autocast_dtype: the autocast dtype the call runs under, or None.
    """
    tensors = [first_weight, first_bias, up_weight, up_bias, down_weight, down_bias]
    engine = _engine(kind, act, gate_first, tensors, autocast_dtype, x.device, kernels)
    (out,) = engine.forward(x, TilePlan(tuple(splits)), [])
    assert out is not None
    return out


@mlp.register_fake
def _mlp_fake(
    x: torch.Tensor,
    first_weight: torch.Tensor,
    first_bias: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    kind: str,
    act: str,
    gate_first: bool,
    splits: list[int],
    autocast_dtype: torch.dtype | None,
    kernels: bool,
) -> torch.Tensor:
    cd = operator_compute_dtype(x, first_weight, autocast_dtype)
    return x.new_empty((x.shape[0], down_weight.shape[0]), dtype=cd)


@torch.library.custom_op("tiledmlp::mlp_backward", mutates_args=())
def mlp_backward(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    first_weight: torch.Tensor,
    first_bias: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    kind: str,
    act: str,
    gate_first: bool,
    splits: list[int],
    autocast_dtype: torch.dtype | None,
    kernels: bool,
    needs: list[bool],
) -> list[torch.Tensor]:
    """The tiled MLP's backward: [d(x), then one gradient per weight and bias in the order
    first, up, down (weight, bias each)]; an empty tensor where `needs` (x first, then the same
    six) is False or the tensor is absent."""
    tensors = [first_weight, first_bias, up_weight, up_bias, down_weight, down_bias]
    engine = _engine(kind, act, gate_first, tensors, autocast_dtype, x.device, kernels)
    present = [i for i, t in enumerate(tensors) if t is not None]
    with autograd_inside():
        dx, _, pgrads = engine.backward(
            x, [], [grad_out], TilePlan(tuple(splits)), needs[0], [],
            [needs[1 + i] for i in present],
        )  # fmt: skip
    out = [x.new_empty(0) if dx is None else dx]
    by_slot: list[torch.Tensor | None] = [None] * len(tensors)
    for i, g in zip(present, pgrads):
        by_slot[i] = g
    return out + [x.new_empty(0) if g is None else g for g in by_slot]


@mlp_backward.register_fake
def _mlp_backward_fake(
    grad_out: torch.Tensor,
    x: torch.Tensor,
    first_weight: torch.Tensor,
    first_bias: torch.Tensor | None,
    up_weight: torch.Tensor | None,
    up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    kind: str,
    act: str,
    gate_first: bool,
    splits: list[int],
    autocast_dtype: torch.dtype | None,
    kernels: bool,
    needs: list[bool],
) -> list[torch.Tensor]:
    tensors = [x, first_weight, first_bias, up_weight, up_bias, down_weight, down_bias]
    return [
        x.new_empty(0) if t is None or not need else torch.empty_like(t)
        for t, need in zip(tensors, needs)
    ]


def _mlp_setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs[:7])
    ctx.options = inputs[7:]


def _mlp_grad(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    saved = ctx.saved_tensors
    needs = list(ctx.needs_input_grad[:7])
    got = mlp_backward(grad, *saved, *ctx.options, needs)
    grads = tuple(g if need else None for g, need in zip(got, needs))
    return (*grads, *([None] * len(ctx.options)))


mlp.register_autograd(_mlp_grad, setup_context=_mlp_setup)
