"""ops/attention/select.py and ops/attention/kernels.py: the attention core calls the kernel
scaled_dot_product_attention would select (with the capability probes injected, CUDA's order is
checked on the CPU), a kernel whose self-check disagrees or raises is skipped with exactly one
warning and the next one is used, each kernel's op signature holds in this torch (meta tensors:
the cuDNN, flash and memory-efficient kernels have no CPU implementation), and the CPU flash
kernel matches SDPA."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from tiledmlp.ops.attention import select as attention_select
from tiledmlp.ops.attention.heads import CausalAttentionByHeads, causal_attention_by_heads
from tiledmlp.ops.attention.kernels import (
    CUDNN,
    EFFICIENT,
    FLASH,
    FLASH_CPU,
    FusedKernel,
    KernelState,
)
from tiledmlp.ops.attention.select import (
    TORCH_PROBES,
    Probes,
    choose_kernel,
    kernel_agrees,
    kernel_order,
)

from conftest import assert_close_rel


def _qkv(
    device: str = "cpu", dtype: torch.dtype = torch.bfloat16, heads: int = 4, kv: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    make = (lambda *s: torch.empty(*s, dtype=dtype, device="meta")) if device == "meta" else (
        lambda *s: torch.randn(*s, generator=g).to(dtype)
    )  # fmt: skip
    return make(1, heads, 48, 64), make(1, kv, 48, 64), make(1, kv, 48, 64)


def _cuda(choice: int | None, usable: set[str]) -> Probes:
    """Probes of a CUDA device on which SDPA picks `choice` and PyTorch can run `usable`."""
    return Probes(
        sdpa_choice=lambda q, k, v: choice,
        can_use=lambda kern, q, k, v: kern.name in usable,
        device_type=lambda q: "cuda",
    )


@pytest.mark.parametrize(
    "choice,usable,want",
    [
        # Hopper: SDPA prefers cuDNN, all three run
        (3, {"cudnn", "flash", "efficient"}, ["cudnn", "flash", "efficient"]),
        # Ampere: SDPA picks flash; cuDNN not usable there
        (1, {"flash", "efficient"}, ["flash", "efficient"]),
        # SDPA's choice goes first even where our fixed order would put it later
        (2, {"cudnn", "flash", "efficient"}, ["efficient", "cudnn", "flash"]),
        # head size or arch rules out the fused kernels but one
        (2, {"efficient"}, ["efficient"]),
        # SDPA would run its math path: the fused kernels PyTorch can run, in our order
        (0, {"flash"}, ["flash"]),
        (None, {"cudnn", "flash"}, ["cudnn", "flash"]),
        (3, set(), []),
    ],
)
def test_cuda_order_follows_sdpa_and_the_eligibility_probes(
    choice: int | None, usable: set[str], want: list[str]
) -> None:
    q, k, v = _qkv()
    assert [kern.name for kern in kernel_order(q, k, v, _cuda(choice, usable))] == want


def test_dtype_and_head_size_rule_kernels_out_before_the_probes_are_asked() -> None:
    asked: list[str] = []
    probes = replace(
        _cuda(3, {"cudnn", "flash", "efficient"}),
        can_use=lambda kern, q, k, v: asked.append(kern.name) is None,
    )
    q, k, v = _qkv(dtype=torch.float32)  # the CUDA fused kernels here take fp16 / bf16
    assert kernel_order(q, k, v, probes) == [] and asked == []
    q, k, v = (t[..., :60] for t in _qkv())  # head size 60: not a multiple of 8
    assert kernel_order(q, k, v, probes) == []


def test_the_cpu_runs_its_flash_kernel() -> None:
    q, k, v = _qkv(dtype=torch.float32)
    assert kernel_order(q, k, v) == [FLASH_CPU]
    assert choose_kernel(q, k, v) is FLASH_CPU
    assert kernel_order(q.to(torch.int64), k, v) == []


class _Broken(FusedKernel):
    """A CPU kernel that either raises or gives a wrong output (SDPA's choice on the CPU)."""

    device_type = "cpu"
    sdpa_backend = FLASH_CPU.sdpa_backend

    def __init__(self, name: str, raises: bool) -> None:
        self.name, self.raises = name, raises

    def forward(self, q, k, v, scale):  # type: ignore[no-untyped-def]
        if self.raises:
            raise RuntimeError("no kernel image is available\nfor execution on the device")
        out, state = FLASH_CPU.forward(q, k, v, scale)
        return out * 1.5, state

    def backward(self, dout, q, k, v, out, state, scale):  # type: ignore[no-untyped-def]
        return FLASH_CPU.backward(dout, q, k, v, out, state, scale)


@pytest.mark.parametrize("raises", [True, False])
def test_a_failing_kernel_is_skipped_with_one_warning_and_the_next_is_used(
    raises: bool, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention_select, "_CHECKED", {})
    broken = _Broken(f"broken_{raises}", raises)
    probes = replace(TORCH_PROBES, candidates=lambda device: (broken, FLASH_CPU))
    q, k, v = _qkv(dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="tiledmlp.ops.attention.select"):
        for _ in range(3):  # every layer of every step asks again
            assert choose_kernel(q, k, v, probes) is FLASH_CPU
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned
    assert f"the broken_{raises} kernel is off on cpu" in warned[0]
    assert ("RuntimeError: no kernel image" if raises else "disagrees") in warned[0]
    assert "\n" not in warned[0]


def test_no_kernel_left_means_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_select, "_CHECKED", {})
    probes = replace(TORCH_PROBES, candidates=lambda device: (_Broken("only", True),))
    q, k, v = _qkv(dtype=torch.float32)
    assert choose_kernel(q, k, v, probes) is None


def test_the_check_is_injectable_and_runs_in_order() -> None:
    checked: list[str] = []

    def check(kern: FusedKernel, device: torch.device, dtype: torch.dtype, dim: int) -> bool:
        checked.append(kern.name)
        return kern.name == "efficient"

    q, k, v = _qkv()
    got = choose_kernel(q, k, v, _cuda(3, {"cudnn", "flash", "efficient"}), check)
    assert got is EFFICIENT and checked == ["cudnn", "flash", "efficient"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_flash_kernel_passes_its_self_check(dtype: torch.dtype) -> None:
    assert kernel_agrees(FLASH_CPU, torch.device("cpu"), dtype, 16)


@pytest.mark.parametrize("kernel", [CUDNN, FLASH, EFFICIENT], ids=lambda k: k.name)
@pytest.mark.parametrize("heads,kv", [(4, 2), (4, 4), (4, 1)])
def test_each_cuda_kernel_is_called_as_this_torch_declares_it(
    kernel: FusedKernel, heads: int, kv: int
) -> None:
    # Meta tensors run the ops' shape functions: argument count, order and types against the
    # installed torch's schema, and the shapes of what comes back.
    q, k, v = _qkv("meta", heads=heads, kv=kv)
    if not kernel.shares_kv and kv not in (1, heads):
        pytest.skip("the kernel takes one key/value head per call")
    out, state = kernel.forward(q, k, v, 0.125)
    assert isinstance(state, KernelState) and out.shape == q.shape
    dq, dk, dv = kernel.backward(torch.empty_like(out), q, k, v, out, state, 0.125)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize("kernel", [CUDNN, FLASH, EFFICIENT], ids=lambda k: k.name)
@pytest.mark.parametrize("groups", [2, 4])
def test_the_op_carries_each_kernels_state_through_autograd(
    kernel: FusedKernel, groups: int
) -> None:
    q, k, v = (t.requires_grad_() for t in _qkv("meta"))
    if groups == 2 and not kernel.shares_kv:
        pytest.skip("the kernel takes one key/value head per call")
    out = CausalAttentionByHeads.apply(q, k, v, 0.125, groups, kernel)
    assert out.shape == (1, 48, 4, 64)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dk.dtype == k.dtype


@pytest.mark.parametrize(
    "kernel,match",
    [
        (EFFICIENT, "the efficient kernel runs on cuda, not cpu"),
        (FLASH_CPU, r"flash_cpu kernel: \[1, 2, 4\]\), got 3"),
    ],
)
def test_refusals_name_the_kernel_in_one_line(kernel: FusedKernel, match: str) -> None:
    q, k, v = _qkv(dtype=torch.float32)
    with pytest.raises(ValueError, match=match) as err:
        causal_attention_by_heads(q, k, v, 0.125, 1 if kernel is EFFICIENT else 3, kernel)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_the_cpu_flash_kernel_matches_sdpa(groups: int) -> None:
    q, k, v = (t.requires_grad_() for t in _qkv(dtype=torch.float32))
    got = causal_attention_by_heads(q, k, v, 0.125, groups, FLASH_CPU)
    dout = torch.randn_like(got)
    g_got = torch.autograd.grad(got, (q, k, v), dout)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=0.125, enable_gqa=True
    ).transpose(1, 2)
    g_want = torch.autograd.grad(want, (q, k, v), dout)
    for name, a, b in zip(("output", "dq", "dk", "dv"), (got, *g_got), (want, *g_want)):
        assert_close_rel(a, b, name)
