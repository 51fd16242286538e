"""GEMMs into an `out=` buffer answered without dispatch (plan/sim/written_out.py): the same tensor
the op returns, only where the op writes into it as it is; a planned step is the same with or
without the shortcut."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tiledmlp.config.plan import StepSpec
from tiledmlp.config.stacks import stack_patch
from tiledmlp.plan.estimate import estimate_step
from tiledmlp.plan.layer import load_config
from tiledmlp.plan.sim import fake_memory
from tiledmlp.plan.sim.written_out import written_out

aten = torch.ops.aten
BF16, F32 = torch.bfloat16, torch.float32


def _calls() -> list[tuple[Any, tuple[Any, ...], dict[str, Any], bool]]:
    """(op, args, kwargs, whether it writes into `out` as it is), on fake tensors."""
    a, b = torch.empty(6, 4, dtype=BF16), torch.empty(4, 5, dtype=BF16)
    out, acc = torch.empty(6, 5, dtype=BF16), torch.empty(6, 5, dtype=F32)
    rows = torch.empty(10, 5, dtype=BF16)[2:8]  # a block of a buffer's rows, as GradPart's
    calls = [
        (aten.mm.out, (a, b), {"out": out}, True),
        (aten.addmm.out, (out, a, b), {"out": out}, True),
        (aten.addmm.out, (rows, a, b), {"out": rows}, True),
        (aten.mm.out, (a, b), {"out": torch.empty(3, 5, dtype=BF16)}, False),  # resized
        (aten.mm.out, (a, b), {"out": torch.empty(0, dtype=BF16)}, False),
        (aten.addmm.out, (torch.empty(5, dtype=BF16), a, b), {"out": out}, False),  # broadcast
        (aten.mm.out, (b, a), {"out": out}, False),  # inner sizes differ: the op raises
    ]
    if "dtype_out" in aten.addmm.overloads():
        calls += [
            (aten.addmm.dtype_out, (acc, a, b, F32), {"out": acc}, True),
            (aten.addmm.dtype_out, (acc, a, b, F32), {"out": out}, False),
        ]
    return calls


def test_the_answer_is_the_op_s_own_result() -> None:
    with FakeTensorMode():
        for op, args, kwargs, writes in _calls():
            got = written_out(op, args, kwargs)
            if not writes:
                assert got is None, op
                continue
            assert got is kwargs["out"], op
            assert op(*args, **kwargs) is kwargs["out"]


def test_other_ops_are_dispatched() -> None:
    with FakeTensorMode():
        a = torch.empty(3, 3)
        assert written_out(aten.mm.default, (a, a), {}) is None
        assert written_out(aten.add.out, (a, a), {"out": a}) is None


@pytest.mark.parametrize("stack", ["tiled_mlp_loss", "tiled_layer"])
def test_a_planned_step_is_the_same_without_the_shortcut(
    monkeypatch: pytest.MonkeyPatch, stack: str
) -> None:
    config = load_config("tiny")
    step = StepSpec(seq_len=2048, checkpointing=True, optimizer="adamw")
    patch = stack_patch(stack, 4)
    fast = estimate_step(config, step, patch)
    monkeypatch.setattr(fake_memory, "written_out", lambda *_: None)
    assert estimate_step(config, step, patch) == fast
