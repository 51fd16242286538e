"""Each attention kernel's buffers against sizes computed by hand, and the attention-kernel
option's choice by those bytes (ops/attention/buffers.py)."""

from __future__ import annotations

import pytest

from tiledmlp.ops.attention.buffers import (
    AttentionShape,
    backward_buffer_bytes,
    forward_state_bytes,
    kernel_for,
    unusable,
    usable_kernels,
)

LLAMA = AttentionShape(batch=1, heads=32, kv_heads=8, tokens=32768, head_dim=128)


def test_cudnn_workspace_is_the_traced_one() -> None:
    # the H100 allocator trace: 1,077,936,384 bytes per call at 32K tokens
    assert backward_buffer_bytes("cudnn", LLAMA) == 1_077_936_384
    assert backward_buffer_bytes("cudnn", AttentionShape(1, 32, 8, 131072, 128)) == 4_311_744_768


def test_flash_buffers_by_mechanism() -> None:
    # 1,000 rows -> 1,024: softmax_d 32 x 1024 x 4; dq_accum 1024 x 32 x 128 x 4; dk and dv
    # expanded to 32 heads in bf16: 2 x 1000 x 32 x 128 x 2
    shape = AttentionShape(1, 32, 8, 1000, 128)
    assert backward_buffer_bytes("flash", shape) == 131_072 + 16_777_216 + 16_384_000
    # no grouped heads: no expanded dk, dv; head size 72 -> 96 in dq_accum, 100 rows -> 128
    assert backward_buffer_bytes("flash", AttentionShape(1, 4, 4, 100, 72)) == 2048 + 196_608
    # above 128 the head size rounds to 64: 160 -> 192
    assert backward_buffer_bytes("flash", AttentionShape(2, 1, 1, 128, 160)) == (
        2 * 128 * 4 + 2 * 128 * 192 * 4
    )


def test_flash_with_grouped_heads_holds_as_much_as_cudnn() -> None:
    # Llama-3-8B's 32 query and 8 key/value heads: the expanded dk and dv make up for the
    # float32 value cuDNN keeps beyond flash's accumulator (within cuDNN's 256 bytes)
    assert backward_buffer_bytes("cudnn", LLAMA) - backward_buffer_bytes("flash", LLAMA) == 256
    # one key/value head per query head: flash's about half of cuDNN's
    mha = AttentionShape(1, 32, 32, 32768, 128)
    assert backward_buffer_bytes("flash", mha) == 32 * 32768 * 4 + 32768 * 32 * 128 * 4


def test_efficient_and_math_buffers() -> None:
    shape = AttentionShape(1, 4, 4, 100, 64)
    assert backward_buffer_bytes("efficient", shape) == 1600 + 102_400
    assert backward_buffer_bytes("efficient", AttentionShape(1, 4, 4, 100, 64, 4)) == 1600
    assert backward_buffer_bytes("math", AttentionShape(1, 2, 2, 10, 8)) == 2 * 2 * 100 * 4


def test_forward_state() -> None:
    shape = AttentionShape(1, 4, 4, 100, 64)
    assert forward_state_bytes("cudnn", shape) == forward_state_bytes("flash", shape) == 1600
    assert forward_state_bytes("efficient", shape) == 4 * 128 * 4
    assert forward_state_bytes("math", shape) == 4 * 100 * 100 * 4
    with pytest.raises(ValueError, match="unknown attention kernel"):
        forward_state_bytes("fast", shape)


def test_by_heads_buffers_are_one_groups_cudnn_workspace() -> None:
    # 32 query and 8 key/value heads of 128, bf16: one call up to 8K tokens, 4 groups at 32K,
    # 32 (a query head per call) from 128K (Note [Head groups]); per group cuDNN's
    # (heads / groups) x tokens x 257 float32 values and 256 bytes
    assert backward_buffer_bytes("by_heads", AttentionShape(1, 32, 8, 8192, 128)) == (
        backward_buffer_bytes("cudnn", AttentionShape(1, 32, 8, 8192, 128))
    )
    assert backward_buffer_bytes("by_heads", LLAMA) == 32768 * 8 * 257 * 4 + 256
    at_512k = AttentionShape(1, 32, 8, 524288, 128)
    assert backward_buffer_bytes("by_heads", at_512k) == 524288 * 1 * 257 * 4 + 256
    assert backward_buffer_bytes("cudnn", at_512k) == 524288 * 32 * 257 * 4 + 256
    assert forward_state_bytes("by_heads", LLAMA) == forward_state_bytes("cudnn", LLAMA)


def test_usable_kernels_by_device_dtype_and_heads() -> None:
    assert usable_kernels(LLAMA, "cuda", "bfloat16") == ("cudnn", "by_heads", "flash", "math")
    mha = AttentionShape(1, 4, 4, 64, 64)
    assert usable_kernels(mha, "cuda", "bfloat16") == (
        "cudnn", "by_heads", "flash", "efficient", "math",
    )  # fmt: skip
    assert usable_kernels(mha, "cuda", "float32") == ("efficient", "math")
    # the CPU: the CPU's flash kernel by head groups, or SDPA's own
    assert usable_kernels(mha, "cpu", "bfloat16") == ("by_heads", "math")
    assert unusable("cudnn", mha, "cpu", "bfloat16") == (
        "the cudnn attention kernel runs on CUDA GPUs, not on cpu"
    )
    why = unusable("flash", mha, "cuda", "float32")
    assert why is not None and "bfloat16 or float16, not float32" in why
    why = unusable("efficient", LLAMA, "cuda", "bfloat16")
    assert why is not None and "no grouped-query attention" in why
    assert unusable("flash", AttentionShape(1, 4, 4, 64, 60), "cuda", "bfloat16") is not None


def test_auto_switches_kernels_where_cudnn_would_not_fit() -> None:
    usable = ("cudnn", "flash", "efficient", "math")  # by_heads left out: the next is flash
    budget = 3 * 2**30  # bytes the attention backward's buffers may take

    def at(tokens: int) -> str | None:
        return kernel_for("auto", AttentionShape(1, 32, 32, tokens, 128), usable, budget)

    # 64K tokens: cuDNN's 2.0 GiB fit, SDPA's own choice stays (None: nothing forced)
    assert at(65536) is None
    # 128K: cuDNN's 4.0 GiB do not fit 3 GiB, flash's 2.0 do
    assert backward_buffer_bytes("cudnn", AttentionShape(1, 32, 32, 131072, 128)) > budget
    assert at(131072) == "flash"
    # nothing fits: the smallest buffers (flash and efficient tie; the faster is taken)
    assert at(1 << 20) == "flash"
    # no budget: SDPA's choice; a named kernel is that kernel
    assert kernel_for("auto", LLAMA, usable, None) is None
    assert kernel_for("efficient", LLAMA, usable, budget) == "efficient"
    with pytest.raises(ValueError, match="auto or one of"):
        kernel_for("fastest", LLAMA, usable, budget)


def test_auto_takes_by_heads_where_cudnn_would_not_fit() -> None:
    """Llama-3-8B's heads on a bound of 3 GiB: cuDNN's workspace fits at 64K tokens (2.0 GiB),
    not at 128K (4.0 GiB), where by_heads (one query head per call, 0.13 GiB) comes before flash
    (as much as cuDNN with grouped heads); by_heads is never SDPA's own choice."""
    usable = usable_kernels(LLAMA, "cuda", "bfloat16")
    budget = 3 * 2**30

    def at(tokens: int) -> str | None:
        return kernel_for("auto", AttentionShape(1, 32, 8, tokens, 128), usable, budget)

    assert at(65536) is None
    assert at(131072) == "by_heads"
    assert backward_buffer_bytes("by_heads", AttentionShape(1, 32, 8, 131072, 128)) == (
        131072 * 257 * 4 + 256
    )
    # on the CPU SDPA's own choice (math here) decides, not by_heads, which comes first there
    cpu = usable_kernels(LLAMA, "cpu", "bfloat16")
    assert kernel_for("auto", AttentionShape(1, 32, 8, 64, 128), cpu, budget) is None
    assert kernel_for("by_heads", LLAMA, usable, None) == "by_heads"
