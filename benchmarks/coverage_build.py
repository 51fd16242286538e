"""Tiny causal LMs of every architecture the installed transformers ships, built from each
architecture's own default config with its sizes cut down (for the support matrix,
benchmarks/coverage.py).

A config is shrunk by name: every size it has among SIZES takes the small value, every dropout
and router noise becomes 0, per-layer lists (layer_types, sliding-window patterns, MoE layer
maps) keep the shortest window of layers that holds each of their entries, and the special token
ids stay inside the small vocabulary. Sub-configs (a composite model's text and vision configs)
are shrunk the same way. The parameters are counted on the meta device before any memory is
taken, so an architecture whose parts stay large at these sizes is reported, not built.

Invariant: nothing here depends on one architecture's name; an architecture that cannot be
built tiny gets a one-line reason (NotBuildable), never a traceback.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "MAX_PARAMS",
    "NotBuildable",
    "TinyModel",
    "build_tiny",
    "causal_lm_types",
    "tiny_config",
]

#: the sizes a config is cut to, by attribute name (only names the config has are set)
SIZES: dict[str, int] = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "emb_dim", "dim", "hidden_dim"), 64),
    **dict.fromkeys(
        (
            "intermediate_size",
            "intermediate_size_mlp",
            "n_inner",
            "ffn_dim",
            "ffn_hidden_size",
            "d_ff",
            "inner_hidden_size",
        ),
        128,
    ),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "kv_heads"), 2),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim"), 16),
    **dict.fromkeys(("vocab_size", "n_words"), 256),
    **dict.fromkeys(
        (
            "moe_intermediate_size",
            "expert_intermediate_size",
            "shared_expert_intermediate_size",
            "moe_ffn_hidden_size",
            "expert_dim",
        ),
        32,
    ),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "num_experts_per_token", "moe_k"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("n_group", "topk_group"), 1),
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "sliding_window": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}
#: the names of a config's layer count, in the order they are looked for
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
#: layers kept when the per-layer lists ask for fewer
MIN_LAYERS = 2
#: a per-layer list with more distinct entries than this is not a pattern of kinds of layer
MAX_KINDS = 4
#: an architecture with more parameters than this at the small sizes is not built
MAX_PARAMS = 20_000_000
_NOISE = ("router_jitter_noise", "jitter_noise", "layerdrop", "router_z_loss_coef")


class NotBuildable(Exception):
    """The architecture cannot be built or run at tiny size; the message says why in one line."""


def causal_lm_types() -> dict[str, str]:
    """model_type -> causal LM class name, for every causal LM of the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {k: v for k, v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items() if isinstance(v, str)}


def _window(lists: list[list[Any]]) -> int:
    """The shortest prefix length of layers in which every per-layer list shows each of its
    entries (at least MIN_LAYERS)."""
    need = MIN_LAYERS
    for values in lists:
        seen: set[str] = set()
        every = {repr(v) for v in values}
        if len(every) > MAX_KINDS:  # layer indices or sizes, not a pattern of kinds of layer
            continue
        for i, v in enumerate(values):
            seen.add(repr(v))
            if seen == every:
                need = max(need, i + 1)
                break
    return need


def _shrunk(d: dict[str, Any]) -> dict[str, Any]:
    """The overrides that make the config dict `d` tiny (sub-config dicts shrunk in full)."""
    out: dict[str, Any] = {}
    for key, value in d.items():
        if isinstance(value, dict) and "model_type" in value:  # a sub-config
            out[key] = {**value, **_shrunk(value)}
        elif key in SIZES and isinstance(value, int) and not isinstance(value, bool):
            out[key] = SIZES[key]
        elif isinstance(value, float) and ("dropout" in key or "pdrop" in key or key in _NOISE):
            out[key] = 0.0
    if "qk_rope_head_dim" in d and "head_dim" in d:  # MLA: rotary part as wide as head_dim
        out["head_dim"] = SIZES["qk_rope_head_dim"]
    experts = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    if d.get("num_experts_per_tok", 0) is None and any(isinstance(d.get(k), int) for k in experts):
        out["num_experts_per_tok"] = SIZES["num_experts_per_tok"]  # a config that leaves it unset
    if "kv_lora_rank" in d and "num_key_value_heads" in d:  # MLA: one key per query head
        out["num_key_value_heads"] = SIZES["num_attention_heads"]
    layer_key = next((k for k in LAYER_KEYS if isinstance(d.get(k), int)), None)
    if layer_key is not None:
        count = d[layer_key]
        per_layer = [k for k, v in d.items() if isinstance(v, list) and len(v) == count > 1]
        layers = min(count, _window([d[k] for k in per_layer]))
        out[layer_key] = layers
        out.update({k: d[k][:layers] for k in per_layer})
    vocab = out.get("vocab_size", d.get("vocab_size"))
    if isinstance(vocab, int):
        for key, value in d.items():
            if key.endswith("_token_id") and isinstance(value, int) and value >= vocab:
                out[key] = vocab - 1
            elif key.endswith("_token_id") and isinstance(value, list):
                out[key] = [v if not isinstance(v, int) or v < vocab else vocab - 1 for v in value]
    return out


def tiny_config(model_type: str) -> Any:
    """The default config of `model_type`, shrunk (see the module docstring)."""
    from transformers import AutoConfig

    try:
        default = AutoConfig.for_model(model_type)
        config = AutoConfig.for_model(model_type, **_shrunk(default.to_dict()))
    except Exception as e:  # any failure of a foreign config is a reason
        raise NotBuildable(f"the config cannot be made tiny ({_one_line(e)})") from None
    for sub in [config, *(getattr(config, k, None) for k in getattr(config, "sub_configs", {}))]:
        if sub is not None and hasattr(sub, "use_cache"):
            sub.use_cache = False
    return config


@dataclass
class TinyModel:
    """A tiny model of one architecture, in float32 on the CPU, with its parameter count."""

    model_type: str
    class_name: str
    model: nn.Module
    params: int


def build_tiny(model_type: str, seed: int = 0) -> TinyModel:
    """The tiny float32 CPU model of `model_type` (random weights from `seed`), in train mode.

    Raises:
        NotBuildable: the config cannot be shrunk, the model is too large at these sizes, or
            its class fails to build.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    try:
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
    except Exception as e:
        raise NotBuildable(f"the model cannot be built from its config ({_one_line(e)})") from None
    params = sum(p.numel() for p in meta.parameters())
    if params > MAX_PARAMS:
        raise NotBuildable(f"{_millions(params)} parameters at tiny sizes ({_largest(meta)})")
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except Exception as e:
        raise NotBuildable(f"the model cannot be built from its config ({_one_line(e)})") from None
    model.train()
    return TinyModel(model_type, type(model).__name__, model, params)


def clone(tiny: TinyModel) -> nn.Module:
    """A copy of the tiny model with the same weights and no gradients."""
    model = copy.deepcopy(tiny.model)
    model.zero_grad(set_to_none=True)
    return model


def _largest(model: nn.Module) -> str:
    """The child holding most parameters, as 'name: N M'."""
    sizes = {
        name: sum(p.numel() for p in child.parameters())
        for name, child in model.named_modules()
        if name and name.count(".") <= 1
    }
    name = max(sizes, key=lambda k: sizes[k])
    return f"{name} holds {_millions(sizes[name])}"


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f}M"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(e).__name__}: {first[:160]}" if first else type(e).__name__
