"""Tiny random Hugging Face causal LMs built from configs (nothing downloaded)."""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 97
BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

FAMILIES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "qwen3_moe",
    "gpt_neox",
    "gpt2",
]

# What patch_model is expected to find in each family: (path, kind) per MLP.
EXPECTED_KIND = {
    "llama": "fast: gated",
    "mistral": "fast: gated",
    "qwen2": "fast: gated",
    "qwen3": "fast: gated",
    "gemma": "fast: gated",
    "gemma2": "fast: gated",
    "gemma3": "fast: gated",
    "phi3": "fast: fused_gated",
    "qwen3_moe": "generic: moe-experts",
    "gpt_neox": "fast: plain",
    "gpt2": "generic: MLP with non-Linear projections",  # Conv1D (dropout set to 0 here)
}


def tiny_causal_lm(family: str, seed: int = 0) -> nn.Module:
    """A 2-layer model of `family` with hidden 32 and random weights, in train mode, dropout 0."""
    import transformers as tr

    torch.manual_seed(seed)
    if family == "llama":
        model = tr.LlamaForCausalLM(tr.LlamaConfig(**BASE))
    elif family == "mistral":
        model = tr.MistralForCausalLM(tr.MistralConfig(**BASE))
    elif family == "qwen2":
        model = tr.Qwen2ForCausalLM(tr.Qwen2Config(**BASE))
    elif family == "qwen3":
        model = tr.Qwen3ForCausalLM(tr.Qwen3Config(**BASE, head_dim=16))
    elif family == "gemma":
        model = tr.GemmaForCausalLM(tr.GemmaConfig(**BASE, head_dim=16))
    elif family == "gemma2":
        model = tr.Gemma2ForCausalLM(tr.Gemma2Config(**BASE, head_dim=16))
    elif family == "gemma3":
        model = tr.Gemma3ForCausalLM(tr.Gemma3TextConfig(**BASE, head_dim=16))
    elif family == "phi3":
        model = tr.Phi3ForCausalLM(tr.Phi3Config(**BASE))
    elif family == "qwen3_moe":
        cfg = tr.Qwen3MoeConfig(
            **BASE,
            head_dim=16,
            moe_intermediate_size=16,
            num_experts=4,
            num_experts_per_tok=2,
            output_router_logits=True,  # the auxiliary loss is part of the training loss
            router_aux_loss_coef=0.1,
        )
        model = tr.Qwen3MoeForCausalLM(cfg)
    elif family == "gpt_neox":
        model = tr.GPTNeoXForCausalLM(tr.GPTNeoXConfig(**BASE))
    elif family == "gpt2":
        cfg = tr.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, bos_token_id=1, eos_token_id=2
        )
        model = tr.GPT2LMHeadModel(cfg)
    else:
        raise ValueError(family)
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0  # exact comparison against the untiled model
    return model.float().train()
