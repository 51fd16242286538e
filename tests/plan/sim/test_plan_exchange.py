"""plan/sim/exchange.py: under sequence parallelism the planner's attention sees one GPU's whole-
sequence shapes as views of its own storage (no copy), in both layouts transformers passes, and
gives back (batch, tokens, heads, head_dim)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tiledmlp.plan.sim.exchange import exchanged_attention


def _recording() -> tuple[list[tuple[torch.Tensor, ...]], Any]:
    seen: list[tuple[torch.Tensor, ...]] = []

    def attend(module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
               **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        seen.append((q, k, v))
        return q.new_zeros(q.shape[0], q.shape[2], q.shape[1], q.shape[3]), None

    return seen, lambda: attend


@pytest.mark.parametrize("transposed", [True, False])
def test_whole_sequence_views_of_the_same_storage(transposed: bool) -> None:
    seen, attend = _recording()
    fn = exchanged_attention(4, attend)
    b, h, kv, n, d = 2, 8, 4, 6, 5
    if transposed:  # projections viewed as heads: (b, n, h, d) storage
        q = torch.randn(b, n, h, d).transpose(1, 2)
        k = torch.randn(b, n, kv, d).transpose(1, 2)
    else:  # after a rotary embedding: (b, h, n, d) storage
        q, k = torch.randn(b, h, n, d), torch.randn(b, kv, n, d)
    v = torch.randn(b, kv, n, d)
    out, _ = fn(None, q, k, v, None)
    ((sq, sk, sv),) = seen
    assert sq.shape == (b, 2, 24, d) and sk.shape == sv.shape == (b, 1, 24, d)
    for whole, part in ((sq, q), (sk, k), (sv, v)):
        assert whole.untyped_storage().data_ptr() == part.untyped_storage().data_ptr()
    assert out.shape == (b, n, h, d)


def test_fewer_key_value_heads_than_gpus_are_repeated() -> None:
    seen, attend = _recording()
    fn = exchanged_attention(4, attend)
    q, k, v = torch.randn(1, 8, 6, 5), torch.randn(1, 2, 6, 5), torch.randn(1, 2, 6, 5)
    fn(None, q, k, v, None)
    ((sq, sk, _),) = seen
    assert sq.shape == (1, 2, 24, 5) and sk.shape == (1, 1, 24, 5)  # 2 heads x 2 = 4 = P


def test_sliding_window_layers_under_sequence_parallelism_are_refused_in_one_line() -> None:
    """Sequence parallelism masks sliding-window layers with a whole-sequence mask of its own,
    which the simulation does not model: refused where the window is shorter than the whole
    sequence, planned where it is not."""
    import transformers as tr

    from tiledmlp.config.plan import StepSpec
    from tiledmlp.config.stacks import stack_patch
    from tiledmlp.plan.estimate import estimate_step

    config = tr.AutoConfig.for_model(
        "gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
        sliding_window=256, layer_types=["sliding_attention"] * 3 + ["full_attention"],
    )  # fmt: skip
    patch = stack_patch("tiled_mlp", 4)

    def local(tokens: int) -> StepSpec:  # one GPU's share of a sequence over 2 GPUs
        return StepSpec(seq_len=tokens, sequence_parallel_size=2, world=2)

    with pytest.raises(ValueError, match=r"window 256\) cannot be planned under sequence para"):
        estimate_step(config, local(512), patch, exact=True)
    assert estimate_step(config, local(128), patch, exact=True).peak > 0  # 256: the window
