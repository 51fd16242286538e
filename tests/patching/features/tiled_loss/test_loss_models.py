"""The tiled loss on the causal LMs whose logits are transformed before the cross-entropy,
whose attention is multi-head latent (MLA) or linear, or whose loss adds an MoE auxiliary loss:
built tiny from each architecture's own config (fp32, 2 layers), patched with tiled_loss=True,
the loss and every gradient equal the unpatched model's, and the logits are never formed; a
model whose auxiliary loss is its own is refused in one line."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_models import VOCAB
from tiledmlp import patch_model

from conftest import assert_close_rel

pytest.importorskip("transformers")

BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,  # MLA has no grouped keys: as many as the query heads
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# MLA: the rotary part as wide as head_dim (which the rotary embedding reads)
MLA = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8}
MLA |= {"v_head_dim": 8, "head_dim": 8}
MOE = {"moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2}
MOE |= {"n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
KDA = {"kda_layers": [1], "full_attn_layers": [2], "num_heads": 2, "head_dim": 8}
KDA |= {"short_conv_kernel_size": 4}
# the router's auxiliary loss on, weighted enough to show
AUX = {"output_router_logits": True, "router_aux_loss_coef": 0.1, "num_experts_per_tok": 2}

#: model_type -> the config's overrides beside BASE (what makes the case: the scale, the cap)
ARCHITECTURES = {
    "deepseek_v2": MLA | MOE,
    "deepseek_v3": MLA | MOE,
    "glm4_moe_lite": MLA | MOE,
    "sarvam_mla": MLA | MOE,
    "kimi_linear": MLA | MOE | {"linear_attn_config": KDA},
    # hidden states divided by logits_scaling = hidden_size / dim_model_base = 4
    "minicpm3": MLA | {"dim_model_base": 8, "scale_emb": 1},
    "cohere": {"logit_scale": 0.25},  # logits multiplied
    "cohere2": {"logit_scale": 0.25, "head_dim": 16},
    "granite": {"logits_scaling": 4.0},  # logits divided
    "hyperclovax": {"logits_scaling": 4.0, "head_dim": 16},  # logits multiplied
    # a cap small enough that it bends the logits of random weights
    "gemma2": {"head_dim": 16, "final_logit_softcapping": 2.0},
    "gemma3_text": {"head_dim": 16, "final_logit_softcapping": 2.0},
    # the loss plus router_aux_loss_coef * load_balancing_loss_func(router logits, ...)
    "qwen3_moe": AUX | {"head_dim": 16, "moe_intermediate_size": 16, "num_experts": 4},
    "mixtral": AUX | {"num_local_experts": 4},
    "gpt_oss": AUX | {"num_local_experts": 4, "head_dim": 16},
}


def _tiny(model_type: str, **overrides: object) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        model_type, **(BASE | ARCHITECTURES.get(model_type, {}) | overrides)
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def _step(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_loss_and_every_gradient_equal_the_models_own(model_type: str) -> None:
    ref = _tiny(model_type)
    model = copy.deepcopy(ref)
    report = patch_model(model, tiled_mlp=False, tiled_loss=True, num_tiles=3)
    assert report.loss == "tiled", report.loss
    torch.manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 11))
    labels = ids.clone()
    labels[0, :3] = -100
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    for keep in (0, 5):  # every position; the last five (the labels cut to match)
        kept = labels if keep == 0 else labels[:, -keep:]
        kw = {"input_ids": ids, "attention_mask": mask, "labels": kept, "logits_to_keep": keep}
        out, grads = _step(model, **kw)
        ref_out, ref_grads = _step(ref, **kw)
        assert out.logits is None
        assert_close_rel(out.loss.detach(), ref_out.loss.detach(), f"{model_type}: loss")
        if "output_router_logits" in ARCHITECTURES[model_type]:
            assert ref_out.aux_loss is not None
            assert_close_rel(out.aux_loss.detach(), ref_out.aux_loss.detach(), "aux_loss")
        assert grads.keys() == ref_grads.keys()
        for name in grads:
            assert_close_rel(grads[name], ref_grads[name], f"{model_type}: {name}")


def test_an_auxiliary_loss_of_the_models_own_making_is_refused_in_one_line() -> None:
    """JetMoE computes its router's auxiliary loss in its own way: refused with the way out;
    with output_router_logits=False its loss is tiled."""
    jetmoe = AUX | {"num_local_experts": 4, "kv_channels": 16}
    with pytest.raises(ValueError, match=r"cannot be tiled: its loss adds an MoE auxiliary"):
        patch_model(_tiny("jetmoe", **jetmoe), tiled_mlp=False, tiled_loss=True)
    model = _tiny("jetmoe", **(jetmoe | {"output_router_logits": False}))
    assert patch_model(model, tiled_mlp=False, tiled_loss=True).loss == "tiled"
