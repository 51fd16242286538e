"""Failover of the fused GLU kernels (ops/mlp/glu/kernels.py) and the switch that turns them off.

A kernel that fails on a device is forced by installing a real Triton kernel that does not
compile (it calls a function triton.language does not have) in place of the built ones, under
Triton's interpreter in a fresh process (conftest.run_interpreted): the first call logs one
warning naming the error, computes the reference's result, and that device keeps PyTorch's
path from then on; a failure inside the tiled op's backward still gives the untiled module's
gradients. kernels=False (tiled_mlp, TiledMLPConfig, TiledMLP, patch_model) never launches one.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from tiledmlp import TiledMLP, TiledMLPConfig, patch_model, tiled_mlp
from tiledmlp.ops.mlp.glu import kernels as glu_kernels
from tiledmlp.ops.mlp.glu import triton_kernels as glu_triton

from conftest import assert_same_grads, grads_of, make_mlp, run_interpreted

tl: Any = None  # triton.language, bound in the interpreted process before the kernel is built
_REAL: Any = None  # the genuine kernels, kept while broken ones are installed


def _broken_kernel(  # type: ignore[no-untyped-def]
    g_ptr,
    u_ptr,
    h_ptr,
    n_cols,
    g_rs,
    u_rs,
    h_rs,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
):
    """Does not compile: triton.language has no such function."""
    tl.no_such_function(g_ptr)


def _broken_backward(  # type: ignore[no-untyped-def]
    g_ptr,
    u_ptr,
    dh_ptr,
    h_ptr,
    n_cols,
    g_rs,
    u_rs,
    dh_rs,
    h_rs,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    WRITE_H: tl.constexpr,
):
    tl.no_such_function(g_ptr)


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _break(forward: bool, backward: bool) -> None:
    """Replaces the built kernels with ones that fail to compile, and forgets past failures."""
    global tl, _REAL
    import triton
    import triton.language

    tl = triton.language
    if _REAL is None:
        _REAL = glu_triton.compiled_kernels()
    real = _REAL
    glu_triton._BUILT = glu_triton._Kernels(
        forward=triton.jit(_broken_kernel) if forward else real.forward,
        backward=triton.jit(_broken_backward) if backward else real.backward,
        interpret=real.interpret,
    )
    glu_kernels._FAILED.clear()


def failover_cases() -> dict[str, int]:
    """Run under TRITON_INTERPRET=1. Returns how many warnings each case logged."""
    logs = _Warnings()
    logging.getLogger("tiledmlp").addHandler(logs)
    counts: dict[str, int] = {}
    launches = {"n": 0}
    launch = glu_triton.launch

    def counted(*args: Any, **kwargs: Any) -> None:
        launches["n"] += 1
        launch(*args, **kwargs)

    glu_triton.launch = counted  # type: ignore[assignment]

    # 1. The elementwise entry points: one warning, the reference's exact result, then the
    # reference for good on that device.
    _break(forward=True, backward=True)
    assert glu_kernels.kernels_available("cpu")
    gen = torch.Generator().manual_seed(0)
    g, u, dh = (torch.randn(5, 40, generator=gen) for _ in range(3))
    h = glu_kernels.glu_forward(g, u, "silu")
    assert torch.equal(h, glu_kernels.glu_forward_reference(g, u, "silu"))
    assert len(logs.messages) == 1, logs.messages
    message = logs.messages[0]
    assert "cpu" in message and "no_such_function" in message, message
    assert "kernels=False" in message, message
    assert not glu_kernels.kernels_available("cpu")
    failure = glu_kernels.kernel_failure("cpu")
    assert failure is not None and "no_such_function" in failure
    before = launches["n"]
    gk, uk, dhk = g.clone(), u.clone(), dh.clone()
    glu_kernels.glu_backward(gk, uk, dhk, "gelu", h_out=dhk)
    ref = [g.clone(), u.clone(), dh.clone()]
    glu_kernels.glu_backward_reference(ref[0], ref[1], ref[2], "gelu", h_out=ref[2])
    assert all(torch.equal(a, b) for a, b in zip((gk, uk, dhk), ref))
    assert launches["n"] == before, "a kernel was launched after the failover"
    assert len(logs.messages) == 1, logs.messages
    counts["entry points"] = len(logs.messages)

    # 2. Inside the tiled op: the forward's kernel works, the backward's fails on its first
    # tile (its operands untouched); every tile then takes PyTorch's path: exact gradients.
    logs.messages.clear()
    _break(forward=False, backward=True)
    for kind in ("swiglu", "fused_bias"):
        glu_kernels._FAILED.clear()
        mlp = make_mlp(kind, 16, 40)
        x = torch.randn(2, 13, 16, requires_grad=True)
        dy = torch.randn(2, 13, 16)
        ref_grads = grads_of(mlp, mlp, x, [dy])
        launches["n"] = 0
        got = grads_of(lambda t, m=mlp: tiled_mlp(m, t, num_tiles=3), mlp, x, [dy])
        assert launches["n"] == 3 + 1, (kind, launches)  # 3 forward tiles, then the failed backward
        assert_same_grads(got, ref_grads)
    counts["tiled op"] = len(logs.messages)
    assert counts["tiled op"] == 2, logs.messages  # once per fresh failure

    # 3. kernels=False: no launch at all, same gradients.
    glu_triton._BUILT = _REAL
    glu_kernels._FAILED.clear()
    mlp = make_mlp("geglu", 16, 40)
    x = torch.randn(2, 13, 16, requires_grad=True)
    dy = torch.randn(2, 13, 16)
    ref_grads = grads_of(mlp, mlp, x, [dy])
    launches["n"] = 0
    got = grads_of(lambda t: tiled_mlp(mlp, t, num_tiles=3, kernels=False), mlp, x, [dy])
    assert launches["n"] == 0
    assert_same_grads(got, ref_grads)
    wrapped = TiledMLP(mlp, TiledMLPConfig(num_tiles=3, kernels=False))
    assert_same_grads(grads_of(wrapped, mlp, x, [dy]), ref_grads)
    assert launches["n"] == 0
    got = grads_of(lambda t: tiled_mlp(mlp, t, num_tiles=3), mlp, x, [dy])
    assert launches["n"] > 0, "the kernels should run by default under the interpreter"
    assert_same_grads(got, ref_grads)
    counts["kernels off"] = len(logs.messages) - counts["tiled op"]
    return counts


def test_kernel_failure_falls_back_with_one_warning() -> None:
    counts = run_interpreted("test_kernel_failover", "failover_cases")
    assert counts == {"entry points": 1, "tiled op": 2, "kernels off": 0}


def test_kernels_switch_in_config_and_patch_model() -> None:
    assert TiledMLPConfig().kernels is True
    with pytest.raises(ValueError, match="kernels must be True or False"):
        TiledMLPConfig(kernels="no")  # type: ignore[arg-type]
    model = torch.nn.Sequential(make_mlp("swiglu"))
    report = patch_model(model, num_tiles=2, hidden_size=16, kernels=False)
    assert report.config.kernels is False
    x = torch.randn(9, 16, requires_grad=True)
    assert torch.allclose(model(x), model[0].__class__.forward(model[0], x), atol=1e-6)
    assert "kernels=False" in repr(TiledMLP(make_mlp("swiglu"), TiledMLPConfig(kernels=False)))
