"""Built-in model presets: tiny random-init causal LMs built from a config (nothing downloaded),
and reference shapes for memory planning.

Invariant: a preset builds the same model for the same seed.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "FINE_TUNE_LR",
    "PRESETS",
    "build_preset",
    "closest_preset",
    "default_learning_rate",
    "preset_fields",
    "trained_fields",
]

BYTE_VOCAB_SIZE = 258  # `tiledmlp train`'s byte tokenizer: 256 bytes, BOS and EOS

# name -> LlamaConfig fields. "tiny" trains in a couple of minutes on a 2-core CPU with an MLP
# large enough (intermediate 4 x hidden) that its intermediates dominate activation memory.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    },
    "small": {
        "hidden_size": 512,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
    "llama3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    },
}


def closest_preset(name: str) -> str | None:
    """The preset a mistyped name most likely means ('tinny' -> 'tiny', 'llama3-8B' ->
    'llama3-8b'), or None when none is close (the commands' "did you mean")."""
    import difflib

    lower = {p.lower(): p for p in PRESETS}
    close = difflib.get_close_matches(name.lower(), sorted(lower), n=1, cutoff=0.6)
    return lower[close[0]] if close else None


# Default learning rates. A preset is a random-init model trained from scratch: 2e-3 at hidden
# 256, scaled by 256 / hidden_size (wider models take smaller steps; tiny 2e-3, small 1e-3,
# llama3-8b 1.25e-4, where 2e-3 diverged). A model directory is taken to be pretrained and
# fine-tuned at 2e-5.
SCRATCH_LR_AT_256 = 2e-3
FINE_TUNE_LR = 2e-5


def default_learning_rate(model: str, hidden_size: int) -> float:
    """The learning rate `tiledmlp train` uses when none is given (rule above)."""
    if model in PRESETS or model.endswith(".json"):  # random init: trained from scratch
        return SCRATCH_LR_AT_256 * 256 / hidden_size
    return FINE_TUNE_LR


def build_preset(
    name: str, vocab_size: int, seq_len: int, seed: int, *, device: Any = "cpu"
) -> Any:
    """A random-init LlamaForCausalLM of the preset's shape, in float32, its parameters created
    on `device` (models/build.py: on the CPU, the same weights as before for the same seed)."""
    from tiledmlp.models.build import build_causal_lm, llama_config

    if name not in PRESETS:
        raise ValueError(
            f"unknown preset {name!r}; expected one of {sorted(PRESETS)} or a model directory"
        )
    return build_causal_lm(
        llama_config(**preset_fields(name, vocab_size, seq_len)), device=device, seed=seed
    )


def preset_fields(name: str, vocab_size: int, seq_len: int) -> dict[str, Any]:
    """The LlamaConfig fields of the model build_preset builds (what the planner plans)."""
    return {
        "vocab_size": vocab_size,
        "max_position_embeddings": max(seq_len, 2048),
        "bos_token_id": 256,
        "eos_token_id": 257,
        "pad_token_id": 257,
        **{k: v for k, v in PRESETS[name].items() if k != "vocab_size"},
    }


def trained_fields(name: str, seq_len: int) -> dict[str, Any]:
    """The LlamaConfig fields of the model `tiledmlp train --model NAME` builds at `seq_len`
    (its byte tokenizer's vocabulary): what `plan` and the pre-flight plan for a preset."""
    return preset_fields(name, BYTE_VOCAB_SIZE, seq_len)
