"""The tiled ops as PyTorch custom operators (namespace `tiledmlp`), declared in one place.

`torch.compile` cannot trace the tiled ops' autograd Functions (their tile loops, Python-side
plans and anchors), so a compiled model reaches them through these operators instead: each has a
fake (meta) implementation, so dynamo and AOTAutograd see its output shapes without running it,
and an autograd formula whose backward is itself a custom operator, so the compiled backward graph
calls the same tile loop as the eager backward. Eager code keeps calling the autograd Functions
(ops/mlp/function.py, ops/loss/tile_loop.py); the operators run the same tile math.

    tiledmlp::mlp              the recognised MLP (gated, fused gated, plain), forward
    tiledmlp::mlp_backward     its backward: d(x) and every weight's gradient, each once
    tiledmlp::lm_head_loss     the tiled LM-head cross-entropy reduced by "mean" / "sum", with
                               its gradients formed in the forward (as the eager head does)

Invariants: the operators' arguments are tensors, ints, floats, bools, strings and lists of
them (the tile plan is a list of split sizes, computed once by the caller); the backward
returns each weight's gradient once, summed over tiles in one buffer per weight; registering
happens when this module is imported (`OPS` lists the operators), never as a side effect of
importing anything else.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from tiledmlp.ops.mlp.fast import FastEngine
from tiledmlp.ops.mlp.structure import MLPKind, MLPStructure
from tiledmlp.ops.tiling.backend import LOCAL
from tiledmlp.ops.tiling.state import AutocastState
from tiledmlp.ops.tiling.tiles import TilePlan

__all__ = ["ACTIVATIONS", "OPS", "lm_head_loss", "mlp", "mlp_backward"]

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


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor, autocast: torch.dtype | None) -> Any:
    castable = {torch.float32, torch.float16, torch.bfloat16}
    if autocast is not None and x.dtype in castable and weight.dtype in castable:
        return autocast
    return x.dtype


@contextlib.contextmanager
def _autograd_inside() -> Iterator[None]:
    """Autograd back on inside an operator's body, which the dispatcher runs below autograd.

    The tile loops differentiate a few elementwise functions locally (an activation's or a
    soft-cap's derivative, torch.autograd.grad on one tile); the tensors involved are the
    body's own, never the caller's. Private dispatcher API: tests/ops/test_library.py fails
    loudly if it moves.
    """
    keys = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)
    before = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in keys]
    for k in keys:
        torch._C._dispatch_tls_set_dispatch_key_excluded(k, False)
    try:
        with torch.enable_grad():
            yield
    finally:
        for k, was in zip(keys, before):
            torch._C._dispatch_tls_set_dispatch_key_excluded(k, was)


# -- the MLP ----------------------------------------------------------------------------------


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
    cd = _compute_dtype(x, first_weight, autocast_dtype)
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
    with _autograd_inside():
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


# -- the LM-head loss ---------------------------------------------------------------------------


@torch.library.custom_op("tiledmlp::lm_head_loss", mutates_args=())
def lm_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    mask: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    splits: list[int],
    ignore_index: int,
    reduction: str,
    shift: int,
    softcap: float,
    logit_scale: float,
    label_smoothing: float,
    z_loss: float,
    autocast_dtype: torch.dtype | None,
    needs: list[bool],
) -> list[torch.Tensor]:
    """tiled_cross_entropy reduced by "mean" or "sum" on hidden (tokens, hidden) and labels
    (tokens,) (mask: (tokens,) or None): [loss (float32 scalar), alpha (float32 scalar: the
    constant the formed gradients leave out), d(hidden), d(weight), d(bias)] for an upstream
    gradient of 1, an empty tensor for each gradient `needs` (hidden, weight, bias) leaves out.
    shift: 0, or the sequence length by which the flat labels are shifted per sequence. The
    labels are checked here, where their values exist."""
    from tiledmlp.ops.loss.cross_entropy import scalar_loss_parts

    with _autograd_inside():
        return scalar_loss_parts(
            hidden, weight, bias, labels, mask, class_weight, TilePlan(tuple(splits)),
            ignore_index, reduction, shift, softcap, logit_scale, label_smoothing, z_loss,
            autocast_dtype, needs,
        )  # fmt: skip


@lm_head_loss.register_fake
def _lm_head_loss_fake(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    mask: torch.Tensor | None,
    class_weight: torch.Tensor | None,
    splits: list[int],
    ignore_index: int,
    reduction: str,
    shift: int,
    softcap: float,
    logit_scale: float,
    label_smoothing: float,
    z_loss: float,
    autocast_dtype: torch.dtype | None,
    needs: list[bool],
) -> list[torch.Tensor]:
    cd = _compute_dtype(hidden, weight, autocast_dtype)
    wide = torch.promote_types(cd, torch.float32)
    scalar = hidden.new_empty((), dtype=wide)
    grads = [
        hidden.new_empty(0) if t is None or not need else torch.empty_like(t)
        for t, need in zip((hidden, weight, bias), needs)
    ]
    return [scalar, hidden.new_empty((), dtype=torch.float32), *grads]


def _loss_setup(ctx: Any, inputs: tuple[Any, ...], output: list[torch.Tensor]) -> None:
    _, alpha, dh, dw, db = output
    ctx.present = tuple(inputs[-1])
    ctx.save_for_backward(alpha, dh, dw, db)


def _loss_grad(ctx: Any, grads: list[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
    grad = grads[0]
    alpha, dh, dw, db = ctx.saved_tensors
    if grad is None:
        return (None,) * 16
    # the loss is linear in the upstream gradient: scaling the formed gradients is exact, in the
    # order the eager head multiplies (upstream x alpha, then the formed gradient by it)
    factor = grad * alpha
    formed = [g * factor if need else None for g, need in zip((dh, dw, db), ctx.present)]
    return (formed[0], formed[1], formed[2], *([None] * 13))


lm_head_loss.register_autograd(_loss_grad, setup_context=_loss_setup)

#: every operator this library registers
OPS: tuple[Any, ...] = (mlp, mlp_backward, lm_head_loss)
