"""The custom operators (ops/library.py) and the ops under torch.compile: one graph, the same
results as the eager ops.

Compiled with the aot_eager backend (dynamo + AOTAutograd, the fake implementations and the
autograd formulas; no inductor codegen): a few seconds each on 2 cores. Inductor runs in
tests/patching/test_compile.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from tiledmlp import tiled_mlp
from tiledmlp.ops import library
from tiledmlp.ops.loss.cross_entropy import tiled_cross_entropy
from tiledmlp.ops.mlp.structure import recognise

from conftest import FAST_KINDS, assert_same_grads, grads_of, make_mlp
from generic_modules import NormedMLP, lora_wrapped


class _Graphs:
    """A backend that counts graphs and keeps the custom operators each one calls."""

    def __init__(self) -> None:
        self.counter = CompileCounterWithBackend("aot_eager")
        self.targets: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, inputs: Any) -> Any:
        self.targets += [
            str(n.target) for n in gm.graph.nodes if str(n.target).startswith("tiledmlp.")
        ]
        return self.counter(gm, inputs)


def _compiled(fn: Callable[..., Any]) -> tuple[Callable[..., Any], _Graphs]:
    torch._dynamo.reset()
    graphs = _Graphs()
    return torch.compile(fn, backend=graphs, fullgraph=True), graphs


def test_the_operators_are_declared_in_one_module() -> None:
    names = {f"{op._namespace}::{op._name}" for op in library.OPS}
    assert names == {"tiledmlp::mlp", "tiledmlp::mlp_backward", "tiledmlp::lm_head_loss"}
    for name in names:
        assert hasattr(torch.ops.tiledmlp, name.split("::")[1])


_SLOW = pytest.mark.slow  # per-tile checkpoints: a longer trace


@pytest.mark.parametrize(
    "kind",
    [
        *(pytest.param(k, marks=_SLOW) if k == "relu_inplace" else k for k in FAST_KINDS),
        pytest.param("normed", marks=_SLOW),
        pytest.param("lora", marks=_SLOW),
    ],
)
def test_compiled_tiled_mlp_is_one_graph_and_exact(kind: str) -> None:
    mlp = (
        NormedMLP(16, 24)
        if kind == "normed"
        else lora_wrapped(16, 24)
        if kind == "lora"
        else make_mlp(kind)
    )
    structure = recognise(mlp)  # the eager probe, as patch_model runs it
    x = torch.randn(2, 9, 16)
    up = torch.randn(2, 9, mlp(x).shape[-1])

    def run(t: torch.Tensor) -> torch.Tensor:
        return tiled_mlp(mlp, t, num_tiles=4)

    ref = grads_of(run, mlp, x, [up])
    compiled, graphs = _compiled(run)
    got = grads_of(compiled, mlp, x, [up])
    assert_same_grads(got, ref)
    assert graphs.counter.frame_count == 1
    by_operator = structure is not None and kind != "relu_inplace"  # ReLU: no operator name
    assert ("tiledmlp.mlp.default" in graphs.targets) == by_operator, graphs.targets


def test_opcheck_mlp_operator() -> None:
    mlp = make_mlp("swiglu_bias")
    x = torch.randn(9, 16, requires_grad=True)
    args = (
        x, mlp.gate_proj.weight, mlp.gate_proj.bias, mlp.up_proj.weight, mlp.up_proj.bias,
        mlp.down_proj.weight, mlp.down_proj.bias, "gated", "silu", True, [3, 3, 3], None, False,
    )  # fmt: skip
    torch.library.opcheck(library.mlp, args)


def _loss_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    hidden = torch.randn(2, 11, 16, requires_grad=True)
    weight = torch.randn(37, 16, requires_grad=True)
    labels = torch.randint(0, 37, (2, 11))
    labels[0, 3] = -100
    return hidden, weight, labels


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"reduction": "sum", "shift": True},
        {"softcap": 5.0, "label_smoothing": 0.1, "z_loss": 1e-3},
        {"logit_scale": 0.5, "bias": True, "mask": True},
    ],
    ids=["mean", "sum_shift", "softcap_smooth_z", "scale_bias_mask"],
)
def test_compiled_loss_is_one_graph_and_exact(options: dict[str, Any]) -> None:
    hidden, weight, labels = _loss_inputs()
    kw = dict(options)
    bias = torch.randn(37, requires_grad=True) if kw.pop("bias", False) else None
    mask = torch.rand(2, 11) > 0.3 if kw.pop("mask", False) else None
    leaves = [t for t in (hidden, weight, bias) if t is not None]

    def run(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return tiled_cross_entropy(h, w, labels, bias=bias, mask=mask, num_tiles=3, **kw)

    ref = run(hidden, weight)
    ref_grads = torch.autograd.grad(ref, leaves)
    compiled, graphs = _compiled(run)
    got = compiled(hidden, weight)
    got_grads = torch.autograd.grad(got, leaves)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    assert graphs.counter.frame_count == 1
    assert "tiledmlp.lm_head_loss.default" in graphs.targets


def test_compiled_loss_checks_label_values() -> None:
    hidden, weight, labels = _loss_inputs()
    labels[1, 2] = 37  # out of range: only the operator's body sees values
    compiled, _ = _compiled(lambda h, w: tiled_cross_entropy(h, w, labels, num_tiles=2))
    with pytest.raises(ValueError, match="labels must be in"):
        compiled(hidden, weight)


def test_compiled_per_token_loss_is_a_clean_graph_break() -> None:
    hidden, weight, labels = _loss_inputs()

    def run(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return tiled_cross_entropy(h, w, labels, num_tiles=3, reduction="none").sum()

    ref = run(hidden, weight)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    got = torch.compile(run, backend=counter)(hidden, weight)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=0)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch._dynamo.reset()
        torch.compile(run, backend="aot_eager", fullgraph=True)(hidden, weight)
