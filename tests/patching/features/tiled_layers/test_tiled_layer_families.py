"""patch_model(tiled_layers=True) beyond the Llama shape: mixture-of-experts layers (router
logits and auxiliary loss the model's own), Gemma 2/3 (four norms, soft-capping, sliding
windows), OLMo 2/3 (norms on the outputs, q/k norms over the whole projection), Phi-3 (fused
q/k/v), Cohere (attention and MLP side by side) and hybrid stacks (Qwen3-Next, Qwen3.5: the
full-attention layers tiled, the linear-attention layers left to the MLP and norm patches).
Each tiny model built from its config, fp32, CPU: loss, router logits and every parameter
gradient equal the unpatched model's, with and without the model's gradient checkpointing."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from hf_models import VOCAB
from tiledmlp import patch_model
from tiledmlp.patching.patch import tile_counts

from conftest import assert_close_rel

BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MOE = {"num_experts_per_tok": 2, "output_router_logits": True, "router_aux_loss_coef": 0.1}


def _build(family: str) -> nn.Module:
    import transformers as tr

    if family == "qwen3_moe":
        cfg: Any = tr.Qwen3MoeConfig(**BASE, **MOE, moe_intermediate_size=16, num_experts=4)
        return tr.Qwen3MoeForCausalLM(cfg)
    if family == "mixtral":
        return tr.MixtralForCausalLM(tr.MixtralConfig(**BASE, **MOE, num_local_experts=4))
    if family == "gpt_oss":
        # Attention sinks and biases; sliding-window and full layers alternate.
        cfg = tr.GptOssConfig(**BASE, **MOE, num_local_experts=4, sliding_window=4)
        return tr.GptOssForCausalLM(cfg)
    if family == "gemma2":
        # Soft-capped attention logits, query_pre_attn_scalar, alternating sliding windows.
        cfg = tr.Gemma2Config(**BASE, sliding_window=4, query_pre_attn_scalar=8)
        return tr.Gemma2ForCausalLM(cfg)
    if family == "gemma3":
        cfg = tr.Gemma3TextConfig(**BASE, sliding_window=4, query_pre_attn_scalar=8)
        cfg.layer_types = ["sliding_attention", "full_attention"]
        return tr.Gemma3ForCausalLM(cfg)
    if family == "olmo2":
        return tr.Olmo2ForCausalLM(tr.Olmo2Config(**BASE))
    if family == "olmo3":
        return tr.Olmo3ForCausalLM(tr.Olmo3Config(**BASE, sliding_window=4))
    if family == "phi3":
        return tr.Phi3ForCausalLM(tr.Phi3Config(**BASE))
    if family == "cohere":
        return tr.CohereForCausalLM(tr.CohereConfig(**BASE, use_qk_norm=True))
    if family == "deepseek_v3":
        # Multi-head latent attention (compressed q and kv, interleaved rotary, values of
        # their own head size); layer 0 dense, layer 1 routed experts beside shared ones.
        cfg = tr.DeepseekV3Config(
            **{k: v for k, v in BASE.items() if k not in ("head_dim", "num_key_value_heads")},
            **MOE,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_routed_experts=4,
            n_group=1,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=12,
            num_key_value_heads=2,
        )
        return tr.DeepseekV3ForCausalLM(cfg)
    if family in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        # Linear-attention layers 0 and 2, gated full-attention layers 1 and 3.
        hybrid = dict(BASE, num_hidden_layers=4)
        hybrid.update(
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            linear_conv_kernel_dim=2,
        )
        if family == "qwen3_5":
            return tr.Qwen3_5ForCausalLM(tr.Qwen3_5TextConfig(**hybrid))
        moe = dict(MOE, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16)
        if family == "qwen3_5_moe":
            return tr.Qwen3_5MoeForCausalLM(tr.Qwen3_5MoeTextConfig(**hybrid, **moe))
        return tr.Qwen3NextForCausalLM(tr.Qwen3NextConfig(**hybrid, **moe))
    raise ValueError(family)


# family -> (layers expected tiled, attn_implementation)
TILED: dict[str, tuple[list[int], str]] = {
    "qwen3_moe": ([0, 1], "sdpa"),
    "mixtral": ([0, 1], "sdpa"),
    "gpt_oss": ([0, 1], "eager"),  # attention sinks: the family's eager attention
    "gemma2": ([0, 1], "eager"),  # soft-capping: the family's eager attention
    "gemma3": ([0, 1], "sdpa"),
    "olmo2": ([0, 1], "sdpa"),
    "olmo3": ([0, 1], "sdpa"),
    "phi3": ([0, 1], "sdpa"),
    "cohere": ([0, 1], "sdpa"),
    "deepseek_v3": ([0, 1], "sdpa"),
    "qwen3_next": ([1, 3], "sdpa"),  # gated attention, MoE with a shared expert
    "qwen3_5": ([1, 3], "sdpa"),
    "qwen3_5_moe": ([1, 3], "sdpa"),
}


def _model(family: str, implementation: str) -> nn.Module:
    torch.manual_seed(0)
    model = _build(family)
    model.config._attn_implementation = implementation
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    with torch.no_grad():  # norms and biases away from their initial values: every path counts
        for name, p in model.named_parameters():
            if p.dim() < 2 or "sinks" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model.float().train()


def _run(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, Any]:
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), getattr(out, "router_logits", None)


# The linear attention's reference kernels (no flash-linear-attention on CPU) are slow: one
# hybrid in the default tier, the MoE hybrids in the slow one.
SLOW = ("qwen3_next", "qwen3_5_moe")
FAMILIES = [pytest.param(f, marks=[pytest.mark.slow] if f in SLOW else []) for f in sorted(TILED)]


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_family_layers_are_tiled_exactly(family: str, checkpointing: bool) -> None:
    layers, implementation = TILED[family]
    model = _model(family, implementation)
    ref = copy.deepcopy(model)
    if checkpointing:
        for m in (model, ref):
            m.gradient_checkpointing_enable({"use_reentrant": False})
    report = patch_model(model, num_tiles=3, tiled_layers=True, tiled_norms=True)
    tiled = [n for n in report.patched if report.paths[n] == "generic: decoder layer"]
    assert tiled == [f"model.layers.{i}" for i in layers]
    kept = [n for n, why in report.skipped if "linear-attention layer" in why]
    all_layers = range(model.config.num_hidden_layers)
    assert kept == [f"model.layers.{i}" for i in all_layers if i not in layers]
    ids = torch.randint(3, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    loss, routed = _run(model, ids)
    experts = {n: c for n, c in tile_counts(model).items() if n.endswith("mlp.experts")}
    moe = family in ("qwen3_moe", "mixtral", "gpt_oss", "qwen3_next", "qwen3_5_moe", "deepseek_v3")
    if moe:  # the experts' block runs inside the tiled layer with its experts tiled
        dense = 1 if family == "deepseek_v3" else 0  # its first layers' MLPs are dense
        assert sorted(experts) == [f"model.layers.{i}.mlp.experts" for i in all_layers[dense:]]
        assert all(c.calls >= 1 and c.tiles == 3 * c.calls for c in experts.values()), experts
    ref_loss, ref_routed = _run(ref, ids)
    assert_close_rel(loss, ref_loss, "loss")
    if ref_routed is not None:  # the auxiliary loss reads these: the model's own, once per layer
        assert len(routed) == len(ref_routed)
        for i, (a, b) in enumerate(zip(routed, ref_routed)):
            assert_close_rel(a, b, f"router logits {i}")
    # float32 parity, with the atol of a gradient far below the others (a linear attention's
    # dt_bias: ~1e-7) taken at 1e-3 of the model's largest gradient (summation order differs).
    floor = 1e-3 * max(q.grad.abs().max().item() for q in ref.parameters() if q.grad is not None)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            scale = max(q.grad.abs().max().item(), floor)
            diff = (p.grad - q.grad).abs()
            ok = torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-5 * scale)
            assert ok, (
                f"{name}.grad: max diff {diff.max():.3e}, mean {diff.mean():.3e}, scale {scale:.3e}"
            )


def test_a_layer_computing_something_else_is_refused() -> None:
    # A real OLMo 2 layer given a norm its forward never uses, under the name of Gemma's norm
    # before the MLP: the names promise it, the probe sees the layer without it and refuses
    # (recognition never trusts names alone).
    model = _model("olmo2", "sdpa")
    layer: Any = model.model.layers[1]
    layer.pre_feedforward_layernorm = copy.deepcopy(layer.post_feedforward_layernorm)
    with pytest.raises(ValueError, match=r"layers\.1 .*computes something other") as err:
        patch_model(model, tiled_layers=True)
    assert "\n" not in str(err.value) and "drop tiled_layers" in str(err.value)
    assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("family", ["gemma3", "deepseek_v3", "qwen3_5"])
def test_generation_with_a_cache_gives_the_same_tokens(family: str) -> None:
    # Sliding-window caches (Gemma 3: more tokens than its window), latent caches
    # (the layer's own forward), a hybrid's linear-attention state beside tiled layers.
    model = _model(family, "sdpa").eval()
    ref = copy.deepcopy(model)
    patch_model(model, num_tiles=2, tiled_layers=True)
    prompt = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(prompt, **kwargs), ref.generate(prompt, **kwargs))
