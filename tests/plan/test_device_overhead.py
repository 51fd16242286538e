"""plan/device_overhead.py: the attention term (cuDNN attention's backward buffers, SDPA on
Hopper, for the heads the kernel sees, under sequence parallelism, and the flash kernel's for one
head group with tiled decoder layers, grouped-query expansion included) and the allocator term
(the step's trace replayed through the caching allocator, with or without expandable
segments)."""

from __future__ import annotations

import pytest

from tiledmlp.plan.device_overhead import device_overhead
from tiledmlp.plan.layer import load_config

GiB = 2**30
M = 1 << 20


def test_an_8b_layer_at_1m_tokens_whole_and_by_heads() -> None:
    cfg = load_config("llama3-8b")  # 32 query heads, 8 key/value heads of 128
    whole = device_overhead(cfg, "cuda").terms(peak=0, tokens=M)["attention_backward"]
    # cuDNN: dq accumulator and row sums (float32) + one output-sized buffer (bf16), no expansion
    assert whole == M * 32 * 129 * 4 + M * 32 * 128 * 2
    grouped = device_overhead(cfg, "cuda", by_heads=True).terms(0, M)["attention_backward"]
    assert grouped == M * 129 * 4  # one query head per call: its dq accumulator, no expansion
    # float32 models: the output-sized buffer in float32
    wide = device_overhead(cfg, "cuda", itemsize=4).terms(0, M)["attention_backward"]
    assert wide == M * 32 * 129 * 4 + M * 32 * 128 * 4


def test_the_cudnn_term_and_the_h100_record_of_sdpa() -> None:
    """The record's SDPA step (32 query, 8 key/value heads of 128, bf16): 53,504 bytes per token
    = output, row statistics, upstream gradient, dq, dk, dv (tensors) + the term."""
    cfg = load_config("llama3-8b")
    term = device_overhead(cfg, "cuda").terms(0, 131072)["attention_backward"]
    tensors = 131072 * (3 * 32 * 128 * 2 + 32 * 4 + 2 * 8 * 128 * 2)
    assert tensors + term == 6688 * 2**20  # attention_by_heads.jsonl, "sdpa" at 131072


@pytest.mark.parametrize("p", [8, 32])
def test_sequence_parallel_kernels_see_the_whole_sequence_with_heads_over_p(p: int) -> None:
    cfg = load_config("llama3-8b")
    local = M // p
    got = device_overhead(cfg, "cuda", sequence_parallel_size=p).terms(0, local)
    heads = 32 // p
    want = M * heads * 129 * 4 + M * heads * 128 * 2
    assert got["attention_backward"] == want
    # by heads, one query head per call at 1M tokens under either P
    grouped = device_overhead(cfg, "cuda", sequence_parallel_size=p, by_heads=True)
    assert grouped.terms(0, local)["attention_backward"] == M * 129 * 4


def test_short_sequences_are_one_call_even_by_heads() -> None:
    cfg = load_config("llama3-8b")
    for tokens in (1024, 4096):
        a = device_overhead(cfg, "cuda", by_heads=True).terms(0, tokens)
        # one flash call over all heads: dk and dv expanded to the 32 query heads
        want = tokens * 32 * 129 * 4 + 2 * tokens * 32 * 128 * 2
        assert a["attention_backward"] == want
    assert device_overhead(cfg, "cpu", by_heads=True).total(10 * GiB, M) == 0


def test_the_allocator_term_is_the_replayed_reserve_in_both_settings() -> None:
    """The term is the step's own trace replayed through the caching allocator
    (plan/caching_allocator.py) under the step's setting; none on the CPU."""
    import torch

    from tiledmlp.plan.estimate import estimate_step
    from tiledmlp.plan.model import plan_model

    cfg = load_config("llama3-8b")
    cfg.num_hidden_layers, cfg.vocab_size = 2, 1024
    fixed = device_overhead(cfg, "cuda", expandable_segments=False)
    assert fixed.terms(0, 4096, reserve=123 * 2**20)["allocator"] == 123 * 2**20
    assert device_overhead(cfg, "cuda").terms(0, 4096, 123 * 2**20)["allocator"] == 123 * 2**20
    assert device_overhead(cfg, "cpu").terms(0, 4096, 123 * 2**20)["allocator"] == 0
    kw = {"seq_len": 4096, "checkpointing": True}
    est = estimate_step(cfg, stack="untiled", dtype=torch.bfloat16, expandable_segments=False, **kw)
    plan = plan_model(cfg, stacks=("untiled",), expandable_segments=False, **kw)["untiled"]
    assert plan["device_overhead_breakdown_mib"]["allocator"] == round(est.reserve / 2**20, 1)
    assert est.reserve > 0
    on = plan_model(cfg, stacks=("untiled",), **kw)["untiled"]
    grown = estimate_step(cfg, stack="untiled", dtype=torch.bfloat16, **kw)
    assert on["device_overhead_breakdown_mib"]["allocator"] == round(grown.reserve / 2**20, 1)
    # the same step's trace fragments less when the segment grows at its end
    assert 0 < grown.reserve < est.reserve
