"""The custom operators (ops/library.py) and the ops under torch.compile: one graph, the same
results as the eager ops. The ops compile traces instead of calling an operator (a norm on the
generic path, the attention core by heads) are held here too: one graph, exact, and nothing
saved or computed whole that the eager op keeps to a tile or a group of heads.

Compiled with the aot_eager backend (dynamo + AOTAutograd, the fake implementations and the
autograd formulas; no inductor codegen): a few seconds each on 2 cores. Inductor runs in
tests/patching/test_compile.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend

from tiledmlp import tiled_mlp
from tiledmlp.ops import library
from tiledmlp.ops.attention.heads import causal_attention_by_heads
from tiledmlp.ops.attention.kernels import FLASH_CPU
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


class _ForwardAndBackward:
    """An aot_eager-like backend that keeps the forward and backward graphs it compiles."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.backend = aot_autograd(fw_compiler=self._keep, bw_compiler=self._keep)

    def _keep(self, gm: torch.fx.GraphModule, inputs: Any) -> Any:
        self.graphs.append(gm)
        return make_boxed_func(gm.forward)

    def calls(self, graph: int, op: Any) -> list[torch.fx.Node]:
        return [n for n in self.graphs[graph].graph.nodes if n.target is op]


@pytest.mark.parametrize("groups", [2, 4], ids=["whole_kv_heads", "inside_a_kv_head"])
def test_compiled_attention_by_heads_is_traced_group_by_group(groups: int) -> None:
    # Decision: not an operator. Dynamo traces CausalAttentionByHeads (its autograd Function)
    # into one graph that calls the fused kernel once per group, forward and backward, on that
    # group's heads: the same calls, buffers and results as eager.
    torch.manual_seed(0)
    q = torch.randn(2, 4, 9, 8, requires_grad=True)
    k = torch.randn(2, 2, 9, 8, requires_grad=True)
    v = torch.randn(2, 2, 9, 8, requires_grad=True)
    dout = torch.randn(2, 9, 4, 8)

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention_by_heads(q, k, v, 8**-0.5, groups, FLASH_CPU)

    ref = run(q, k, v)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch._dynamo.reset()
    kept = _ForwardAndBackward()
    got = torch.compile(run, backend=kept.backend, fullgraph=True)(q, k, v)
    got_grads = torch.autograd.grad(got, (q, k, v), dout)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)
    assert len(kept.graphs) == 2  # one forward graph, one backward graph
    aten = torch.ops.aten
    forward = kept.calls(0, aten._scaled_dot_product_flash_attention_for_cpu.default)
    backward = kept.calls(1, aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    assert len(forward) == len(backward) == groups
    queries = [n.args[0] for n in forward] + [n.args[1] for n in backward]
    assert all(q.meta["val"].shape[1] == 4 // groups for q in queries)  # the group's heads


def test_compiled_tiled_norm_is_one_graph_and_saves_no_new_tensor() -> None:
    # Decision: not an operator. A norm takes the generic path, traced as per-tile checkpoints
    # (ops/mlp/traced.py): exact, and what the compiled step saves for its backward is the
    # norm's input and weight, nothing of the norm's own (its float32 intermediates never
    # exist whole), as the eager tiled norm.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(16)
    with torch.no_grad():
        norm.weight.uniform_()
    x = torch.randn(2, 9, 16, requires_grad=True)
    up = torch.randn(2, 9, 16)

    def run(t: torch.Tensor) -> torch.Tensor:
        return tiled_mlp(norm, t, num_tiles=2, forward=norm.forward)

    ref = grads_of(run, norm, x, [up])
    norm.weight.grad = None
    compiled, graphs = _compiled(run)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = compiled(x)
    out.backward(up)
    assert_same_grads(([out.detach()], x.grad, [norm.weight.grad]), ref)
    assert graphs.counter.frame_count == 1
    existing = {x.untyped_storage().data_ptr(), norm.weight.untyped_storage().data_ptr()}
    assert saved and {t.untyped_storage().data_ptr() for t in saved} <= existing
