"""ops/attention/heads.py: causal attention by groups of key/value heads gives
scaled_dot_product_attention's output and gradients (float64 gradcheck, float32 parity, the bf16
2x rule), picks its groups by the documented launch and memory bounds, sizes the kernel buffers it avoids, and
refuses what it cannot take in one line."""

from __future__ import annotations

import pytest
import torch

from tiledmlp.ops.attention.heads import (
    BUFFER_FLOOR,
    DEFAULT_MULTIPROCESSORS,
    MIN_WAVES,
    attention_buffer_bytes,
    causal_attention_by_heads,
    head_groups,
)
from tiledmlp.ops.attention.kernels import FLASH_CPU

from conftest import assert_close_rel

GiB = 2**30


def _inputs(
    batch: int, heads: int, kv: int, tokens: int, dim: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q in the layout transformers passes it ((batch, tokens, heads, dim) memory seen as
    (batch, heads, tokens, dim)), k, v and an upstream gradient, in float64."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads, dim, generator=g, dtype=torch.float64).transpose(1, 2)
    k = torch.randn(batch, kv, tokens, dim, generator=g, dtype=torch.float64)
    v = torch.randn(batch, kv, tokens, dim, generator=g, dtype=torch.float64)
    dout = torch.randn(batch, tokens, heads, dim, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype), dout.to(dtype)


def _run(fn, q, k, v, dout):  # type: ignore[no-untyped-def]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves], leaves


def _sdpa(scale: float):  # type: ignore[no-untyped-def]
    def run(q, k, v):  # type: ignore[no-untyped-def]
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=True
        )
        return out.transpose(1, 2)

    return run


@pytest.mark.parametrize(
    "batch,heads,kv,groups",
    [
        (2, 8, 2, 2),
        (1, 8, 2, 1),
        (2, 4, 4, 4),
        (1, 6, 3, 3),
        (2, 8, 4, 2),
        # inside one key/value head: dk and dv of the groups sharing it summed
        (2, 8, 2, 4),
        (1, 8, 2, 8),
        (2, 4, 1, 2),
        (1, 4, 1, 4),
        (1, 6, 3, 6),
    ],
)
def test_float32_output_and_gradients_match_sdpa(
    batch: int, heads: int, kv: int, groups: int
) -> None:
    q, k, v, dout = _inputs(batch, heads, kv, 37, 16, torch.float32)
    got, leaves = _run(
        lambda *t: causal_attention_by_heads(*t, 0.3, groups, FLASH_CPU), q, k, v, dout
    )
    want, _ = _run(_sdpa(0.3), q, k, v, dout)
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, want):
        assert_close_rel(a, b, name)
    # the gradients come back in the inputs' layouts
    assert [t.grad.stride() for t in leaves] == [t.stride() for t in leaves]


@pytest.mark.parametrize("groups", [2, 4])
def test_float64_gradcheck(groups: int) -> None:
    q, k, v, _ = _inputs(1, 4, 2, 6, 8, torch.float64)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    assert torch.autograd.gradcheck(
        lambda *t: causal_attention_by_heads(*t, 0.5, groups, FLASH_CPU), (q, k, v)
    )


@pytest.mark.parametrize("groups", [2, 8])
def test_bf16_error_at_most_twice_sdpa_error(groups: int) -> None:
    q, k, v, dout = _inputs(2, 8, 2, 64, 16, torch.float64, seed=1)
    ref, _ = _run(_sdpa(0.25), q, k, v, dout)
    low = [t.to(torch.bfloat16) for t in (q, k, v, dout)]
    untiled, _ = _run(_sdpa(0.25), *low)
    grouped, _ = _run(lambda *t: causal_attention_by_heads(*t, 0.25, groups, FLASH_CPU), *low)
    for name, r, u, g in zip(("output", "dq", "dk", "dv"), ref, untiled, grouped):
        eu = (u.double() - r).abs().max().item()
        eg = (g.double() - r).abs().max().item()
        assert eg <= 2 * eu + 1e-6, f"{name}: grouped error {eg:.3e} > 2 x SDPA error {eu:.3e}"


def test_groups_keep_every_call_at_the_minimum_of_waves() -> None:
    # The launch bound alone (buffer_floor=0): Llama-3-8B (32 query heads, 8 key/value heads) on
    # 132 multiprocessors: one call at 4K tokens, a key/value head per call at 32K, a query head
    # per call at 1M; under 8-way sequence parallelism (4 query heads, 1 key/value head per
    # GPU) a query head per call at 5M.
    def launch(*shape: int) -> int:
        return head_groups(*shape, buffer_floor=0)

    assert launch(1, 32, 8, 4096) == 1
    assert launch(1, 32, 8, 8192) == 2
    assert launch(1, 32, 8, 32768) == 8
    assert launch(1, 32, 8, 1 << 17) == 32
    assert launch(1, 32, 8, 1 << 20) == 32
    assert launch(1, 4, 1, 5 << 20) == 4
    minimum = MIN_WAVES * DEFAULT_MULTIPROCESSORS
    allowed = [1, 2, 4, 8, 16, 32]  # divisors of 8, or multiples of 8 dividing 32
    for tokens in (128, 4096, 32768, 100_000, 1 << 20, 5 << 20):
        groups = launch(1, 32, 8, tokens)
        assert groups in allowed
        blocks = -(-tokens // 128) * (32 // groups)
        assert groups == 1 or blocks >= minimum
        finer = [g for g in allowed if g > groups]
        if finer:  # the next split would go below the minimum
            assert -(-tokens // 128) * (32 // finer[0]) < minimum
        # the memory bound only ever lowers the count
        assert head_groups(1, 32, 8, tokens) <= groups
    # more sequences per call count as more blocks
    assert launch(8, 32, 8, 4096) > launch(1, 32, 8, 4096)
    assert launch(1, 6, 3, 1 << 20) == 6  # 3 key/value heads: groups 1, 3, 6


def _held(tokens: int, heads: int, kv: int, groups: int, dim: int = 128, itemsize: int = 2) -> int:
    """What a grouping holds beyond the op's tensors: one call's float32 dq accumulator and row
    sums, its dq, dk and dv before they are copied, a split key/value head's float32 dk, dv."""
    h, h_kv = heads // groups, max(1, kv // groups)
    split = 2 * tokens * dim * 4 if groups > kv else 0
    return tokens * h * (dim + 1) * 4 + tokens * (h + 2 * h_kv) * dim * itemsize + split


@pytest.mark.parametrize(
    "heads,kv,dim,itemsize",
    [
        (32, 8, 128, 2),
        (32, 32, 128, 2),
        (28, 4, 128, 2),
        (32, 8, 64, 4),
        (64, 8, 128, 2),
        (4, 1, 128, 2),
        (6, 3, 128, 2),
    ],
)
@pytest.mark.parametrize("tokens", [16384, 32768, 1 << 16, 1 << 17, 1 << 20])
def test_groups_are_the_fewest_within_the_launch_bounds_memory_or_the_floor(
    heads: int, kv: int, dim: int, itemsize: int, tokens: int
) -> None:
    kw = {"head_dim": dim, "itemsize": itemsize}
    launch = head_groups(1, heads, kv, tokens, buffer_floor=0, **kw)
    groups = head_groups(1, heads, kv, tokens, **kw)
    allowed = [g for g in range(1, heads + 1) if heads % g == 0 and (kv % g == 0 or g % kv == 0)]
    held = {g: _held(tokens, heads, kv, g, dim, itemsize) for g in allowed}
    budget = max(held[launch], BUFFER_FLOOR)
    assert groups <= launch and held[groups] <= budget
    assert all(held[g] > budget for g in allowed if g < groups)


def test_the_benchmarked_shape_runs_fewer_calls_within_the_floor() -> None:
    # 32 query heads, 8 key/value heads of 128, bf16 (the records' shape): 4 groups at 32K (8
    # kernel calls per step instead of 16), a key/value head per call at 64K; from 128K a query
    # head per call as before: any fewer groups would hold more than it and than the floor.
    lengths = (8192, 16384, 32768, 1 << 16, 1 << 17, 1 << 18)
    got = {n: head_groups(1, 32, 8, n) for n in lengths}
    assert got == {8192: 1, 16384: 2, 32768: 4, 1 << 16: 8, 1 << 17: 32, 1 << 18: 32}
    launch = {n: head_groups(1, 32, 8, n, buffer_floor=0) for n in lengths}
    assert launch == {8192: 2, 16384: 4, 32768: 8, 1 << 16: 16, 1 << 17: 32, 1 << 18: 32}
    # at 32K: 225 MiB held against 112.5 with 8 groups, 450 with 2
    mib = {g: _held(32768, 32, 8, g) / 2**20 for g in (2, 4, 8)}
    assert mib == {2: 450.0, 4: 225.0, 8: 112.5}
    # at 128K one query head per call holds 288.5 MiB, a key/value head per call 450
    assert _held(1 << 17, 32, 8, 32) / 2**20 == 288.5 and _held(1 << 17, 32, 8, 8) / 2**20 == 450
    # cuDNN's workspace of a call holds two float32 values per query element (H100 traces)
    cudnn = attention_buffer_bytes(1, 32, 8, 32768, 128, 2, 4, "cudnn")
    assert cudnn == 32768 * 8 * 257 * 4 + 256
    # few heads per GPU (8-way sequence parallelism): a query head per call, as before
    assert head_groups(1, 4, 1, 5 << 20) == 4
    # 2 query heads per key/value head: a key/value head per call holds less than a query head
    # per call with its float32 dk and dv sums (2056 against 2308 bytes per token)
    assert head_groups(1, 6, 3, 1 << 20) == 3
    assert _held(1, 6, 3, 3) == 2056 and _held(1, 6, 3, 6) == 2308
    # a call that holds less than the floor is not split, whatever the launch allows
    assert head_groups(1, 32, 8, 8192, sms=1) == 1
    assert head_groups(1, 32, 8, 8192, sms=1, buffer_floor=0) == 32


def test_groups_follow_the_device_and_the_kernel() -> None:
    def launch(*shape: int, **kw: object) -> int:
        return head_groups(*shape, buffer_floor=0, **kw)  # type: ignore[arg-type]

    # a device with fewer multiprocessors fills with smaller calls
    assert launch(1, 32, 8, 32768, sms=16) == 32
    assert launch(1, 32, 8, 32768, sms=264) == 4
    # 64-row blocks (the memory-efficient kernel) make twice the blocks per head
    assert launch(1, 32, 8, 32768, rows_per_block=64) == 16
    # a kernel that takes one key/value head per call never groups whole key/value heads
    # (1 when a key/value head per call would go below the minimum: the call runs unchunked)
    assert launch(1, 32, 8, 16384, rows_per_block=64, shares_kv=False) == 8
    assert launch(1, 32, 8, 16384, rows_per_block=64) == 8
    assert launch(1, 32, 8, 8192, rows_per_block=64, shares_kv=False) == 1
    assert launch(1, 32, 8, 8192, rows_per_block=64) == 4
    assert launch(1, 8, 8, 32768, shares_kv=False) == 2  # no grouped-query attention
    # with the memory bound: the fewest groups within the floor, whatever the launch allowed
    assert head_groups(1, 32, 8, 32768, sms=16) == 4
    assert head_groups(1, 32, 8, 32768, sms=264) == 4
    assert head_groups(1, 32, 8, 1 << 16, rows_per_block=64, shares_kv=False) == 8
    assert head_groups(1, 32, 8, 1 << 17, rows_per_block=64, shares_kv=False) == 32


def test_kernel_buffers_of_one_group() -> None:
    # 8B at 1M tokens, bf16: dq accumulator 16 GiB + row sums 128 MiB + dk/dv expanded 16 GiB
    whole = attention_buffer_bytes(1, 32, 8, 1 << 20, 128, 2, 1)
    assert whole == (1 << 20) * 32 * 129 * 4 + 2 * (1 << 20) * 32 * 128 * 2
    assert whole / GiB == pytest.approx(32.125)
    assert attention_buffer_bytes(1, 32, 8, 1 << 20, 128, 2, 8) * 8 == whole
    # one query head per call: no expansion, the dq accumulator of one head
    assert attention_buffer_bytes(1, 32, 8, 1 << 20, 128, 2, 32) == (1 << 20) * 129 * 4
    # no expansion without grouped-query attention at the kernel
    assert attention_buffer_bytes(1, 4, 4, 1000, 64, 2, 1) == 1000 * 4 * 65 * 4


@pytest.mark.parametrize(
    "shapes,groups,match",
    [
        (((1, 4, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8)), 3, "groups must divide"),
        (((1, 4, 8, 8), (1, 2, 8, 8), (1, 2, 8, 8)), 8, "groups must divide"),
        (((1, 4, 8, 8), (1, 3, 8, 8), (1, 3, 8, 8)), 1, "not a multiple"),
        (((1, 4, 8, 8), (1, 2, 9, 8), (1, 2, 9, 8)), 1, "lengths"),
        (((1, 4, 8, 8), (1, 2, 8, 8), (1, 2, 8, 4)), 1, "k and v alike"),
    ],
)
def test_refusals_are_one_line(
    shapes: tuple[tuple[int, ...], ...], groups: int, match: str
) -> None:
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=match) as err:
        causal_attention_by_heads(q, k, v, 1.0, groups, FLASH_CPU)
    assert "\n" not in str(err.value)
