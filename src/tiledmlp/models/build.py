"""Random-init causal LMs built where they run: the parameters are created on the target device
(under `torch.device(...)`), never on the CPU first and then moved.

A model built on the CPU and moved spends most of its time in the CPU's weight initialisation
(a few layers of an 8B shape take minutes there); under a device context the same constructor
creates and initialises every parameter on the device in a fraction of that.

Invariant: the same seed gives the same model for the same device type: on the CPU, exactly the
weights `cls(config)` gives after `torch.manual_seed(seed)` (the initialisation code is
transformers' own, unchanged); on an accelerator, that device's generator draws them. Nothing
the size of a weight is allocated on any device but the target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["build_causal_lm", "buildable", "config_from_dir", "has_weights", "llama_config"]

# What transformers' from_pretrained loads weights from (a folder with none of these holds a
# configuration only).
_WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.ckpt", "*.msgpack", "*.h5")


def llama_config(**fields: Any) -> Any:
    """A transformers.LlamaConfig from keyword fields (use_cache off: training)."""
    import transformers

    return transformers.LlamaConfig(**{**fields, "use_cache": False})


def buildable(config: Any) -> str | None:
    """Why a model of `config` cannot be built, in one line, or None: a field the model's layers
    would refuse deep inside the build (the padding token past the vocabulary: torch's
    embedding asserts "Padding_idx must be within num_embeddings"; -1 counts from the end)."""
    text = config.get_text_config()
    pad, vocab = getattr(text, "pad_token_id", None), getattr(text, "vocab_size", None)
    if isinstance(pad, int) and isinstance(vocab, int) and not -vocab <= pad < vocab:
        return (
            f"pad_token_id {pad} is not a token of the vocabulary (vocab_size {vocab}); set "
            "pad_token_id below vocab_size, or null"
        )
    return None


def build_causal_lm(
    config: Any,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    attn_implementation: str | None = None,
) -> Any:
    """A random-init causal LM of `config`, its parameters created on `device` in `dtype`.

    Args:
        config: a transformers PretrainedConfig (LlamaConfig, Qwen2Config, ...).
        device: where the parameters are created ("cuda", "cuda:1", "cpu", "meta").
        dtype: the parameters' dtype (default: torch's default dtype, float32).
        seed: seeds every device's generator (torch.manual_seed) before the build.
        attn_implementation: "sdpa", "eager", ... (default: transformers' choice).

    Returns:
        The model in training mode.
    """
    import transformers

    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
    return model.train()


def has_weights(path: str | Path) -> bool:
    """Whether the model folder holds weights (else it is a configuration to build from)."""
    folder = Path(path)
    return any(next(folder.glob(pattern), None) is not None for pattern in _WEIGHT_FILES)


def config_from_dir(path: str | Path) -> Any:
    """The transformers configuration in `path`/config.json.

    Raises:
        ValueError: no readable config.json there.
    """
    import transformers

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{folder} has no config.json; expected a Hugging Face model folder (config.json, "
            "with or without weights)"
        )
    try:
        return transformers.AutoConfig.from_pretrained(str(folder))
    except (ValueError, OSError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{folder}/config.json could not be read: {first}") from None
