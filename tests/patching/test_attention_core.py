"""patching/attention_core.py: a tiled decoder layer's attention core runs by groups of
key/value heads where the call allows it and trains exactly like the untiled model (with
checkpointing, offloading, the bf16 2x rule); calls it cannot take (a padding mask, short
sequences) run transformers' sdpa unchanged."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from hf_models import BASE, VOCAB
from tiledmlp import patch_model
from tiledmlp.ops.attention import heads as attention_heads
from tiledmlp.patching import attention_core
from tiledmlp.patching.attention_core import by_heads, sdpa_by_heads
from tiledmlp.patching.features.activation_offloading import enable_checkpointing
from tiledmlp.patching.hf_attention import HF_ATTENTION

from conftest import (
    assert_close_rel,
    assert_same_sgd_steps,
    assert_tiled_layers_bf16_within_twice_untiled,
)


def _model(family: str = "llama") -> torch.nn.Module:
    """2 layers, 4 query heads and 2 key/value heads of 8 (sdpa), fp32, seeded."""
    import transformers as tr

    torch.manual_seed(0)
    kw: dict[str, Any] = {**BASE, "num_attention_heads": 4, "num_key_value_heads": 2}
    if family == "qwen3":
        return tr.Qwen3ForCausalLM(tr.Qwen3Config(**kw, head_dim=8))
    return tr.LlamaForCausalLM(tr.LlamaConfig(**kw))


def _ids(batch: int = 2, seq: int = 19) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(3, VOCAB, (batch, seq), generator=g)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Group counts of the calls that ran by heads."""
    seen: list[int] = []
    real = attention_core.causal_attention_by_heads

    def counted(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, groups: int, *rest
    ):  # type: ignore[no-untyped-def]
        seen.append(groups)
        return real(q, k, v, scale, groups, *rest)

    monkeypatch.setattr(attention_core, "causal_attention_by_heads", counted)
    return seen


@pytest.fixture
def small_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny sequences split like long ones: no minimum of waves per call, no memory bound (a
    query head per call)."""
    monkeypatch.setattr(attention_heads, "MIN_WAVES", 0)
    monkeypatch.setattr(attention_heads, "BUFFER_FLOOR", 0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("offload", [False, True])
def test_layers_by_heads_train_exactly_like_untiled(
    family: str, offload: bool, calls: list[int], small_groups: None
) -> None:
    model = _model(family)
    ref = copy.deepcopy(model)
    for m in (model, ref):
        enable_checkpointing(m)
    patch_model(
        model, num_tiles=3, tiled_loss=True, tiled_norms=True, tiled_layers=True,
        activation_offloading=offload,
    )  # fmt: skip
    calls.clear()  # patch_model's own checks of the model call the attention too
    assert_same_sgd_steps(model, ref, _ids())
    # 2 steps x 2 layers x (forward + the checkpoint's recompute), each a query head per call
    # (4 groups, 2 per key/value head)
    assert calls == [4] * 8


def test_short_sequences_and_padding_masks_run_transformers_sdpa(
    calls: list[int], small_groups: None
) -> None:
    model = _model()
    ref = copy.deepcopy(model)
    patch_model(model, num_tiles=2, tiled_layers=True)
    calls.clear()
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: a mask reaches the attention
    for m in (model, ref):
        m(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
    assert calls == []
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close_rel(p.grad, q.grad, f"{name}.grad")


def test_without_the_small_group_rule_tiny_sequences_are_one_call(calls: list[int]) -> None:
    model = _model()
    patch_model(model, num_tiles=2, tiled_layers=True)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls == []  # 19 tokens x 4 heads are far below MIN_WAVES waves of blocks


def test_bf16_error_at_most_twice_the_untiled_error(small_groups: None) -> None:
    assert_tiled_layers_bf16_within_twice_untiled(_model(), _ids())


def test_sdpa_by_heads_returns_what_transformers_sdpa_returns(small_groups: None) -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    attn = _model().model.layers[0].self_attn
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 11, 4, 8, generator=g).transpose(1, 2)
    k, v = torch.randn(2, 2, 11, 8, generator=g), torch.randn(2, 2, 11, 8, generator=g)
    got, none = sdpa_by_heads(attn, q, k, v, None, dropout=0.0, scaling=0.3)
    want, _ = sdpa_attention_forward(attn, q, k, v, None, dropout=0.0, scaling=0.3)
    assert none is None and got.shape == want.shape == (2, 11, 4, 8)
    assert_close_rel(got, want, "output")


def test_the_attention_backend_resolves_sdpa_by_heads_inside_a_tiled_layer_only() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert HF_ATTENTION.function("sdpa") is ALL_ATTENTION_FUNCTIONS["sdpa"]
    with by_heads():
        assert HF_ATTENTION.function("sdpa") is sdpa_by_heads
        assert HF_ATTENTION.function("flex_attention") is ALL_ATTENTION_FUNCTIONS["flex_attention"]
    assert HF_ATTENTION.function("sdpa") is ALL_ATTENTION_FUNCTIONS["sdpa"]


def test_compiled_tiled_layer_runs_its_attention_as_one_sdpa_call(
    calls: list[int], small_groups: None
) -> None:
    # Note [The attention plan under torch.compile]: the plan cannot be traced, so a compiled
    # layer calls SDPA whole where eager splits the heads; one graph, exact.
    model = _model()
    del model.model.layers[1:]
    model.config.num_hidden_layers = 1
    patch_model(model, num_tiles=2, tiled_layers=True)
    compiled_model = copy.deepcopy(model)
    ids = _ids()
    calls.clear()
    ref = model(input_ids=ids, labels=ids, use_cache=False).loss
    ref.backward()
    assert calls == [4]  # eager: by heads
    calls.clear()
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert calls == []
    assert_close_rel(loss, ref, "loss")
    for (name, p), q in zip(compiled_model.named_parameters(), model.parameters()):
        assert_close_rel(p.grad, q.grad, name)
