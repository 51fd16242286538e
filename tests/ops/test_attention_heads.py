"""ops/attention/heads.py: causal attention by groups of key/value heads gives
scaled_dot_product_attention's output and gradients (float64 gradcheck, float32 parity, the bf16
2x rule), picks its groups by the documented memory and launch bounds, sizes the kernel buffers it avoids, and
refuses what it cannot take in one line."""

from __future__ import annotations

import pytest
import torch

from tiledmlp.ops.attention.heads import (
    BUFFER_FLOOR,
    BUFFER_SHARE,
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
    # The launch bound alone (buffer_share=0): Llama-3-8B (32 query heads, 8 key/value heads) on
    # 132 multiprocessors: one call at 4K tokens, a key/value head per call at 32K, a query head
    # per call at 1M; under 8-way sequence parallelism (4 query heads, 1 key/value head per
    # GPU) a query head per call at 5M.
    def launch(*shape: int) -> int:
        return head_groups(*shape, buffer_share=0)

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


def _held(heads: int, kv: int, dim: int, itemsize: int) -> int:
    """Bytes per token of q, k, v, the output, the upstream gradient, dq, dk and dv."""
    return 4 * dim * itemsize * (heads + kv)


@pytest.mark.parametrize(
    "heads,kv,dim,itemsize",
    [(32, 8, 128, 2), (32, 32, 128, 2), (28, 4, 128, 2), (32, 8, 64, 4), (64, 8, 128, 2)],
)
def test_groups_are_the_fewest_whose_buffers_fit(
    heads: int, kv: int, dim: int, itemsize: int
) -> None:
    # Long enough for the launch bound to allow one query head per call: the memory bound
    # decides, the same at every such length.
    per_length = {
        head_groups(1, heads, kv, n, head_dim=dim, itemsize=itemsize)
        for n in (1 << 20, 1 << 21, 1 << 22)
    }
    assert len(per_length) == 1
    groups = per_length.pop()
    allowed = [g for g in range(1, heads + 1) if heads % g == 0 and (kv % g == 0 or g % kv == 0)]
    tokens = 1 << 20
    budget = BUFFER_SHARE * tokens * _held(heads, kv, dim, itemsize)
    assert budget > BUFFER_FLOOR

    def buffers(g: int) -> int:  # one call's float32 dq accumulator and row sums
        return tokens * 4 * (heads // g) * (dim + 1)

    assert buffers(groups) <= budget
    fewer = [g for g in allowed if g < groups]
    assert not fewer or buffers(fewer[-1]) > budget


def test_the_benchmarked_shape_runs_a_key_value_head_per_call() -> None:
    # 32 query heads, 8 key/value heads of 128, bf16 (the records' shape): 8 groups from 64K on,
    # where the launch bound alone took 32 from 128K on: 16 kernel calls per step instead of 64,
    # none inside a key/value head (no float32 dk, dv sums); up to 32K one call's buffers stay
    # under the floor in fewer groups (1, 2 and 4 at 8K, 16K and 32K, where the launch bound
    # alone took 2, 4 and 8).
    got = {n: head_groups(1, 32, 8, n) for n in (8192, 16384, 32768, 1 << 16, 1 << 17, 1 << 18)}
    assert got == {8192: 1, 16384: 2, 32768: 4, 1 << 16: 8, 1 << 17: 8, 1 << 18: 8}
    # one call's cuDNN buffers: within a sixteenth of what the attention holds, or the floor
    for n, groups in got.items():
        call = attention_buffer_bytes(1, 32, 8, n, 128, 2, groups, "cudnn")
        assert call <= max(BUFFER_SHARE * n * _held(32, 8, 128, 2), BUFFER_FLOOR)
    assert attention_buffer_bytes(1, 32, 8, 1 << 17, 128, 2, 8, "cudnn") == (1 << 17) * 4 * 129 * 4
    # too few heads per GPU for the memory bound (8-way sequence parallelism): the launch bound
    assert head_groups(1, 4, 1, 5 << 20) == 4
    assert head_groups(1, 6, 3, 1 << 20) == 6
    # tiny problems fit the floor whole: one call
    assert head_groups(1, 32, 8, 1 << 17, sms=1) == 8
    assert head_groups(1, 4, 2, 4096, sms=1) == 1


def test_groups_follow_the_device_and_the_kernel() -> None:
    def launch(*shape: int, **kw: object) -> int:
        return head_groups(*shape, buffer_share=0, **kw)  # type: ignore[arg-type]

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
    # with the memory bound: the fewest groups that fit, within what the launch allows
    assert head_groups(1, 32, 8, 32768, sms=16) == 4
    assert head_groups(1, 32, 8, 32768, sms=264) == 4
    assert head_groups(1, 32, 8, 1 << 17, rows_per_block=64, shares_kv=False) == 8


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
