"""The tiled op with the fused elementwise kernels (ops/mlp/glu/kernels.py) selected: exact in
float32 against the untiled module and within the 2x rule in bf16, for every gated kind.

On the CPU the kernels run under Triton's interpreter, in one subprocess (TRITON_INTERPRET=1
makes kernels_available true for CPU tensors there); on a GPU the same cases run compiled.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tiledmlp import tiled_mlp
from tiledmlp.ops.mlp.glu import kernels as glu_kernels

from conftest import assert_same_grads, grads_of, make_mlp, run_interpreted

KINDS = ["swiglu", "swiglu_bias", "geglu", "fused", "fused_bias"]


def _counting() -> dict[str, int]:
    """Wraps the kernels' entry points to count calls (what the op actually selected)."""
    calls = {"glu_forward": 0, "glu_backward": 0}
    for name in calls:
        original = getattr(glu_kernels, name)

        def counted(*args, _name=name, _original=original, **kwargs):  # type: ignore[no-untyped-def]
            calls[_name] += 1
            return _original(*args, **kwargs)

        setattr(glu_kernels, name, counted)
    return calls


def op_cases(device: str = "cpu") -> dict[str, int]:
    """Every case; raises on the first mismatch. Returns the kernel call counts."""
    from test_lowprec import check_rule

    calls = _counting()
    for kind in KINDS:
        mlp = make_mlp(kind, 16, 40).to(device)
        act = getattr(mlp, "act_fn", None) or mlp.activation_fn
        assert glu_kernels.activation_kind(act) is not None, kind
        x = torch.randn(2, 13, 16, device=device, requires_grad=True)
        dy = torch.randn(2, 13, 16, device=device)
        ref = grads_of(mlp, mlp, x, [dy])
        before = dict(calls)
        got = grads_of(lambda t, m=mlp: tiled_mlp(m, t, num_tiles=3), mlp, x, [dy])
        assert_same_grads(got, ref)
        assert calls["glu_forward"] > before["glu_forward"], (kind, calls)
        assert calls["glu_backward"] == before["glu_backward"] + 3, (kind, calls)
        # Only the down projection trains: the backward skips dg/du (forward kernel only).
        frozen = copy.deepcopy(mlp)
        for name, p in frozen.named_parameters():
            p.requires_grad_(name.startswith("down_proj"))
        xf = x.detach()
        out = tiled_mlp(frozen, xf, num_tiles=3)
        out.backward(dy)
        ref_mlp = copy.deepcopy(frozen)
        ref_mlp(xf).backward(dy)
        for (name, p), q in zip(frozen.named_parameters(), ref_mlp.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)
    if device == "cpu":
        for kind in ("swiglu", "fused_bias", "geglu"):
            check_rule(kind, torch.bfloat16, 24, 3, autocast=False)
            check_rule(kind, torch.bfloat16, 24, 3, autocast=True)
    return calls


def test_kernels_are_not_selected_on_the_cpu() -> None:
    calls = {"n": 0}
    original = glu_kernels.glu_backward
    try:
        glu_kernels.glu_backward = lambda *a, **k: calls.__setitem__("n", 1)  # type: ignore[assignment]
        mlp = make_mlp("swiglu")
        x = torch.randn(9, 16, requires_grad=True)
        tiled_mlp(mlp, x, num_tiles=2).sum().backward()
    finally:
        glu_kernels.glu_backward = original  # type: ignore[assignment]
    assert calls["n"] == 0  # the CPU keeps PyTorch's path (no interpreter in this process)


@pytest.mark.slow  # the whole op interpreted in a fresh process (the kernels' parity stays quick)
def test_op_with_kernels_under_triton_interpreter() -> None:
    assert run_interpreted("test_fused_elementwise", "op_cases")["glu_backward"] > 0


@pytest.mark.gpu
def test_op_with_kernels_on_cuda() -> None:
    calls = op_cases("cuda")
    assert calls["glu_backward"] > 0
