"""What the attention core by heads does per group, counted at the dispatcher (deterministic, no
timing): the kernel SDPA selects is the one planned, and it is called once per group in each
direction, with views of q, k and v (no copy, no repeat of key/value heads); the only other work
is one copy of each group's output and gradients into the whole buffers, and a float32 sum only
where groups split a key/value head. The CUDA kernels run on meta tensors
(their shape functions), the CPU flash kernel on real ones."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tiledmlp.ops.attention import select as attention_select
from tiledmlp.ops.attention.heads import CausalAttentionByHeads
from tiledmlp.ops.attention.kernels import CUDNN, EFFICIENT, FLASH, FLASH_CPU, FusedKernel
from tiledmlp.ops.attention.select import (
    TORCH_PROBES,
    Probes,
    by_heads_plan,
    sdpa_kernel_name,
)

_KERNEL_OPS = {
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
}


class _Ops(TorchDispatchMode):
    """Every aten op run: its name, and for ops that are not views or kernels the bytes of
    what they return (for in-place ops: the destination), by dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.written: Counter[tuple[str, torch.dtype]] = Counter()
        self.kernel_args: list[tuple[str, list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.calls[name] += 1
        if name in _KERNEL_OPS:
            self.kernel_args.append((name, [a for a in args if isinstance(a, torch.Tensor)]))
        elif not func.is_view:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.written[(name, t.dtype)] += t.numel() * t.element_size()
        return out


def _layout(batch: int, heads: int, kv: int, tokens: int, dim: int, device: str, dtype: Any):  # type: ignore[no-untyped-def]
    """q, k, v as a transformers layer hands them over ((batch, tokens, heads, dim) memory
    seen as (batch, heads, tokens, dim)), requiring grad, and an upstream gradient."""
    g = torch.Generator().manual_seed(0)

    def make(h: int) -> torch.Tensor:
        if device == "meta":
            t = torch.empty(batch, tokens, h, dim, dtype=dtype, device="meta")
        else:
            t = torch.randn(batch, tokens, h, dim, generator=g).to(dtype)
        return t.transpose(1, 2)

    q, k, v = (make(h).requires_grad_() for h in (heads, kv, kv))
    dout = make(heads).transpose(1, 2).contiguous().detach()
    return q, k, v, dout


def _count(kernel: FusedKernel, groups: int, device: str, dtype: Any, shape=(2, 8, 2, 48, 16)):  # type: ignore[no-untyped-def]
    q, k, v, dout = _layout(*shape, device=device, dtype=dtype)
    with _Ops() as ops:
        out = CausalAttentionByHeads.apply(q, k, v, 0.25, groups, kernel)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    return ops, (q, k, v), out, grads


def _bytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


@pytest.mark.parametrize(
    "kernel,device,dtype",
    [
        (CUDNN, "meta", torch.bfloat16),
        (FLASH, "meta", torch.bfloat16),
        (FLASH_CPU, "cpu", torch.float32),
        (FLASH_CPU, "cpu", torch.bfloat16),
    ],
    ids=["cudnn", "flash", "flash_cpu-fp32", "flash_cpu-bf16"],
)
@pytest.mark.parametrize("groups", [1, 2])
def test_a_group_is_one_kernel_call_each_way_on_views_plus_one_copy_per_result(
    kernel: FusedKernel, device: str, dtype: torch.dtype, groups: int
) -> None:
    ops, (q, k, v), out, grads = _count(kernel, groups, device, dtype)
    kernels = Counter(name for name, _ in ops.kernel_args)
    assert sorted(kernels.values()) == [groups, groups] and len(kernels) == 2, kernels
    # every tensor a kernel is given is a view of q, k, v, the output or the upstream gradient:
    # nothing was copied or repeated for it
    if device != "meta":
        bases = {t.untyped_storage().data_ptr() for t in (q, k, v, out)}
        for name, tensors in ops.kernel_args:
            if not name.endswith("backward"):
                assert all(t.untyped_storage().data_ptr() in bases for t in tensors[:3]), name
    # beyond the kernels: the whole output and the three gradients, each written once (the
    # empty buffers and the copies into them), in the model's dtype; no float32 sums
    written = {key: n for key, n in ops.written.items() if key[0] not in ("empty", "new_empty")}
    assert sum(n for (name, _), n in written.items() if name == "copy_") == _bytes(out, *grads)
    assert {dt for _, dt in written} <= {dtype}, written
    assert not {name for name, _ in written} - {"copy_", "empty_like"}, written
    assert "repeat_interleave" not in ops.calls and "repeat" not in ops.calls


@pytest.mark.parametrize("kernel,device", [(CUDNN, "meta"), (FLASH_CPU, "cpu")])
def test_groups_inside_a_key_value_head_add_only_its_float32_sum(
    kernel: FusedKernel, device: str
) -> None:
    # 8 query heads on 2 key/value heads in 4 groups: each key/value head's dk and dv of its two
    # groups are summed in float32 (one head's worth per tensor), then rounded once
    ops, _, out, (dq, dk, dv) = _count(kernel, 4, device, torch.bfloat16)
    kernels = Counter(name for name, _ in ops.kernel_args)
    assert sorted(kernels.values()) == [4, 4]
    head = dk[:, :1].numel() * 4  # one key/value head, float32
    fp32 = {name: n for (name, dt), n in ops.written.items() if dt == torch.float32}
    assert fp32 == {"_to_copy": 2 * 2 * head, "add_": 2 * 2 * head}, fp32
    copies = sum(n for (name, dt), n in ops.written.items() if name == "copy_")
    assert copies == _bytes(out, dq, dk, dv)


def test_the_memory_efficient_kernel_sees_its_key_value_head_as_a_stride_0_view() -> None:
    ops = _count(EFFICIENT, 2, "meta", torch.bfloat16)[0]
    for name, tensors in ops.kernel_args:
        k = tensors[2 if name.endswith("backward") else 1]  # after dout in the backward
        assert k.shape[1] == 4 and k.stride(1) == 0, (name, k.shape, k.stride())
    assert "clone" not in ops.calls and "contiguous" not in ops.calls


def _hopper(usable: set[str] = frozenset({"cudnn", "flash", "efficient"})) -> Probes:  # type: ignore[assignment]
    """A Hopper GPU as PyTorch sees it: SDPA selects cuDNN."""
    return Probes(
        sdpa_choice=lambda q, k, v: CUDNN.sdpa_backend,
        can_use=lambda kern, q, k, v: kern.name in usable,
        device_type=lambda q: "cuda",
    )


def _agree(kern: FusedKernel, device: torch.device, dtype: torch.dtype, dim: int) -> bool:
    return True


@pytest.mark.parametrize("tokens,groups", [(32768, 4), (1 << 17, 32), (1 << 18, 32)])
def test_the_benchmarked_shape_runs_cudnn(tokens: int, groups: int) -> None:
    # The records' shape on a Hopper GPU: the kernel SDPA runs (cuDNN), in 4 groups at 32K and
    # a query head per call from 128K, where the suite ran the flash kernel in 8 / 32 / 32 groups
    q, k, v, _ = _layout(1, 32, 8, tokens, 128, "meta", torch.bfloat16)
    assert by_heads_plan(q, k, v, _hopper(), _agree) == (groups, CUDNN)
    assert sdpa_kernel_name(q, k, v, _hopper()) == "cudnn"
    # where cuDNN fails its self-check, the next kernel of SDPA's order
    no_cudnn = by_heads_plan(q, k, v, _hopper(), lambda kern, *a: kern is not CUDNN)
    assert no_cudnn == (groups, FLASH)
    # short sequences stay one call, with nothing checked
    short, _, _, _ = _layout(1, 32, 8, 4096, 128, "meta", torch.bfloat16)
    checked: list[str] = []

    def check(kern: FusedKernel, *rest: object) -> bool:
        checked.append(kern.name)
        return True

    assert by_heads_plan(short, k[:, :, :4096], v[:, :, :4096], _hopper(), check) == (1, None)
    assert checked == []


def test_sdpa_kernel_names() -> None:
    q, k, v, _ = _layout(1, 4, 2, 48, 16, "cpu", torch.float32)
    assert sdpa_kernel_name(q, k, v) == "flash_cpu"
    ampere = replace(_hopper(), sdpa_choice=lambda q, k, v: FLASH.sdpa_backend)
    assert sdpa_kernel_name(q, k, v, ampere) == "flash"
    assert sdpa_kernel_name(q, k, v, replace(_hopper(), sdpa_choice=lambda *a: 0)) == "math"
    assert sdpa_kernel_name(q, k, v, replace(_hopper(), sdpa_choice=lambda *a: None)) == "unknown"


def test_the_real_selection_on_the_cpu_is_its_flash_kernel() -> None:
    q, k, v, _ = _layout(1, 4, 2, 48, 16, "cpu", torch.float32)
    assert attention_select.choose_kernel(q, k, v, TORCH_PROBES) is FLASH_CPU


@pytest.mark.gpu
def test_on_the_gpu_by_heads_calls_the_op_sdpa_calls_and_matches_it() -> None:
    # The records' shape: the plan names the kernel SDPA runs (aten._fused_sdp_choice, what
    # SDPA's dispatch asks); at 4K tokens (groups forced) that kernel's op is the one called,
    # once per group each way, and the output and gradients agree with SDPA's as the self-check
    # requires.
    from tiledmlp.ops.attention.heads import causal_attention_by_heads

    dev = torch.device("cuda")

    def make(heads: int, tokens: int) -> torch.Tensor:
        t = torch.randn(1, tokens, heads, 128, device=dev, dtype=torch.bfloat16)
        return t.transpose(1, 2).requires_grad_()

    q, k, v = make(32, 32768), make(8, 32768), make(8, 32768)
    groups, kernel = by_heads_plan(q, k, v)
    assert kernel is not None and groups > 1
    assert kernel.name == sdpa_kernel_name(q, k, v)
    q, k, v = make(32, 4096), make(8, 4096), make(8, 4096)
    dout = torch.randn(1, 4096, 32, 128, device=dev, dtype=torch.bfloat16)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=128**-0.5, enable_gqa=True
    ).transpose(1, 2)
    g_want = torch.autograd.grad(want, (q, k, v), dout)
    with _Ops() as ops:
        got = causal_attention_by_heads(q, k, v, 128**-0.5, 8, kernel)
        g_got = torch.autograd.grad(got, (q, k, v), dout)
    op = f"_scaled_dot_product_{kernel.name}_attention"
    assert {n: c for n, c in ops.calls.items() if n in _KERNEL_OPS} == {op: 8, f"{op}_backward": 8}
    for a, b in zip((got, *g_got), (want, *g_want)):
        worst = float((a.float() - b.float()).abs().max())
        assert worst <= 2e-2 * float(b.float().abs().max()), worst
