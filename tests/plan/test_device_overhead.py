"""plan/device_overhead.py's attention term: flash attention's backward buffers for the heads the
kernel sees (grouped-query expansion included), under sequence parallelism, and one head
group's with tiled decoder layers."""

from __future__ import annotations

import pytest

from tiledmlp.plan.device_overhead import device_overhead
from tiledmlp.plan.layer import load_config

GiB = 2**30
M = 1 << 20


def test_an_8b_layer_at_1m_tokens_whole_and_by_heads() -> None:
    cfg = load_config("llama3-8b")  # 32 query heads, 8 key/value heads of 128
    whole = device_overhead(cfg, "cuda").terms(peak=0, tokens=M)["attention_backward"]
    # dq accumulator and row sums (float32) + dk and dv expanded to 32 heads (bf16)
    assert whole == M * 32 * 129 * 4 + 2 * M * 32 * 128 * 2
    grouped = device_overhead(cfg, "cuda", by_heads=True).terms(0, M)["attention_backward"]
    assert grouped == M * 129 * 4  # one query head per call: its dq accumulator, no expansion
    # float32 models expand in float32
    wide = device_overhead(cfg, "cuda", itemsize=4).terms(0, M)["attention_backward"]
    assert wide == M * 32 * 129 * 4 + 2 * M * 32 * 128 * 4


@pytest.mark.parametrize("p,expanded", [(8, True), (32, False)])
def test_sequence_parallel_kernels_see_the_whole_sequence_with_heads_over_p(
    p: int, expanded: bool
) -> None:
    cfg = load_config("llama3-8b")
    local = M // p
    got = device_overhead(cfg, "cuda", sequence_parallel_size=p).terms(0, local)
    heads = 32 // p  # key/value heads: 8 // p, or 1 repeated when P > 8 (no expansion at 1:1)
    want = M * heads * 129 * 4 + (2 * M * heads * 128 * 2 if expanded else 0)
    assert got["attention_backward"] == want
    # by heads, one query head per call at 1M tokens under either P
    grouped = device_overhead(cfg, "cuda", sequence_parallel_size=p, by_heads=True)
    assert grouped.terms(0, local)["attention_backward"] == M * 129 * 4


def test_short_sequences_are_one_call_even_by_heads() -> None:
    cfg = load_config("llama3-8b")
    for tokens in (1024, 4096):
        a = device_overhead(cfg, "cuda", by_heads=True).terms(0, tokens)
        b = device_overhead(cfg, "cuda").terms(0, tokens)
        assert a == b
    assert device_overhead(cfg, "cpu", by_heads=True).total(10 * GiB, M) == 0
