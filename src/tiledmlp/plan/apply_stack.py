"""The planner's application of a stack to a fake model: patch_model's own features.

A stack is a PatchConfig (config/stacks.py names the planner's). The model, built under fake
tensors, gets them through the same feature code patch_model runs (patching/features/): each
feature's application is the product's, so a change to what training runs changes the
prediction. Only the probes that need real values are replaced by a declaration from structure:
the MLPs are the decoder layers' dense MLPs, recognised by their projections' shapes
(layer.py's declared_mlps), and the loss is declared tiled (its probe compares values). The other
probes run on the fake model as they are (norms by structure; a decoder layer's probe only
records how it calls its attention on fake parameters). Activation offloading's host buffers go
to the meta device: host memory is not device memory.

Invariant: a PatchConfig applied here installs what patch_model installs with it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.stacks import stack_of
from tiledmlp.patching.features.activation_offloading import offloader_of
from tiledmlp.patching.patch import PatchReport, apply_features, probe_features
from tiledmlp.plan.layer import cut_config, declared_mlps

__all__ = ["apply_stack", "build_model", "decoder_layers_of"]


def build_model(config: Any, dtype: torch.dtype, layers: int) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_config(
        cut_config(config, layers), attn_implementation="sdpa", dtype=dtype, trust_remote_code=False
    ).train()


def apply_stack(model: nn.Module, hidden: int, patch: PatchConfig) -> PatchReport:
    """Applies `patch`'s features to the fake `model` through patch_model's features (module
    docstring); returns the report patch_model would give.

    Raises:
        ValueError: a decoder MLP that is not a dense MLP recognised by shape, a decoder layer
            that cannot be tiled (the tiled_layer stack): the features cannot be planned.
    """
    config = dataclasses.replace(patch, hidden_size=hidden)
    mlps = declared_mlps(model, decoder_layers_of(model), hidden)
    declared = {"tiled_mlp": mlps, "tiled_loss": None}
    try:
        found = probe_features(model, config, declared)
    except ValueError as e:
        raise ValueError(f"{e}; {_called(patch)} cannot be planned for this model") from None
    report = apply_features(model, config, found)  # (the loss declared: no integration readied)
    offloader = offloader_of(model)
    if offloader is not None:
        offloader.pool.device = torch.device("meta")
    return report


def _called(patch: PatchConfig) -> str:
    """What to call `patch` in a message: its stack's name where it is a named stack's."""
    name = stack_of(patch)
    return "this patch configuration" if name is None else f"the {name} stack"


def decoder_of(model: Any) -> nn.Module:
    """The decoder of a causal LM (the module holding its .layers): at .<base_model_prefix>,
    else at .model (a text model whose prefix names its multimodal parent's part, as Llama
    4's)."""
    for name in dict.fromkeys((model.base_model_prefix, "model")):
        decoder = getattr(model, name, None)
        if isinstance(decoder, nn.Module) and isinstance(
            getattr(decoder, "layers", None), nn.ModuleList
        ):
            return decoder
    raise ValueError(
        f"{type(model).__name__}: no decoder layers at .{model.base_model_prefix}.layers; "
        "this model cannot be planned as a whole yet"
    )


def decoder_layers_of(model: Any) -> nn.ModuleList:
    """The decoder layers of a causal LM (decoder_of's .layers)."""
    layers = decoder_of(model).layers
    assert isinstance(layers, nn.ModuleList)  # decoder_of checked it
    return layers
