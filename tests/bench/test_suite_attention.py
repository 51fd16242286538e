"""The suite's attention part (benchmarks/suite/steps.py: attention): the by-heads variant runs the
kernel the attention core selects (as a tiled layer does), in that kernel's groups, and each
record names the kernel its variant ran."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import budget
from benchmarks.suite import steps as suite_steps
from benchmarks.suite.parts import Context
from benchmarks.suite.sizes import smoke_sizes
from tiledmlp.ops.attention import select as attention_select
from tiledmlp.ops.attention.kernels import FLASH_CPU, FusedKernel


class _Seen(FusedKernel):
    """The CPU flash kernel under another name, counting its calls."""

    name, device_type, sdpa_backend = "seen", "cpu", FLASH_CPU.sdpa_backend

    def __init__(self) -> None:
        self.calls = 0

    def forward(self, q, k, v, scale):  # type: ignore[no-untyped-def]
        self.calls += 1
        return FLASH_CPU.forward(q, k, v, scale)

    def backward(self, dout, q, k, v, out, state, scale):  # type: ignore[no-untyped-def]
        return FLASH_CPU.backward(dout, q, k, v, out, state, scale)


def _ctx(tmp_path: Path) -> Context:
    return Context(smoke_sizes(torch.device("cpu")), torch.device("cpu"), tmp_path, budget.CPU)


def test_each_record_names_the_kernel_its_variant_ran(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    seq = ctx.sizes.attention_seq_lens[0]
    records = suite_steps.attention(ctx, seq)
    assert {r["variant"]: r["kernel"] for r in records} == {
        "sdpa": "flash_cpu",
        "by_heads": "flash_cpu",
    }


def test_the_by_heads_variant_runs_the_selected_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _Seen()
    monkeypatch.setattr(attention_select, "choose_kernel", lambda q, k, v: seen)
    ctx = _ctx(tmp_path)
    records = suite_steps.attention(ctx, ctx.sizes.attention_seq_lens[0])
    (by_heads,) = (r for r in records if r["variant"] == "by_heads")
    assert by_heads["kernel"] == "seen"
    # one call per group per step: the warm-up and the timed repeats
    assert seen.calls == by_heads["groups"] * (1 + ctx.sizes.attention_repeats)
