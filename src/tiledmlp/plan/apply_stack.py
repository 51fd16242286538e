"""The planner's application of a stack to a fake model: which modules are tiled, and how.

This module re-implements what patch_model installs (tiled MLPs, tiled norms, tiled decoder
layers) because patch_model's detection probes modules with real values, which fake tensors
lack. It is meant to shrink to calls into patching's own feature code once each feature's probe
is separate from its application; until then a change to what patch_model installs must be
mirrored here.

Invariant: a stack applied here tiles the same modules, with the same tile policy, as
patch_model with that stack's options.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from tiledmlp.config.stacks import stack_option
from tiledmlp.config.tiled import TiledMLPConfig
from tiledmlp.ops.functional import tiled_mlp
from tiledmlp.patching.detect import norms_of
from tiledmlp.patching.layers import install_layer, layer_parts
from tiledmlp.plan.layer import cut_config, dense_mlp

__all__ = ["apply_stack", "build_model", "decoder_layers_of"]


def build_model(config: Any, dtype: torch.dtype, layers: int) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_config(
        cut_config(config, layers), attn_implementation="sdpa", dtype=dtype, trust_remote_code=False
    ).train()


def apply_stack(model: nn.Module, hidden: int, num_tiles: int | str, stack: str) -> None:
    """Every decoder MLP (and as the stack says, every norm over the hidden size and every
    decoder layer) through tiled_mlp, as patch_model does; patch_model's detection probes
    values, which fake tensors lack (a decoder layer's probe only records, see
    patching/layers.py)."""
    modules = [dense_mlp(layer, hidden) for layer in decoder_layers_of(model)]
    if stack_option(stack, "tiled_norms"):
        modules += [c.module for c in norms_of(model, hidden)]
    if stack_option(stack, "tiled_layers"):
        # A tiled layer runs its MLP and norms untiled inside its own tiles (patch_model's
        # patches on them are bypassed there): only the modules outside the layers are tiled.
        inside = {id(m) for layer in decoder_layers_of(model) for m in layer.modules()}
        modules = [m for m in modules if id(m) not in inside]
    for module in modules:
        original = type(module).forward.__get__(module)
        module.forward = functools.partial(tiled_mlp, module, num_tiles=num_tiles, forward=original)
    if stack_option(stack, "tiled_layers"):
        config = TiledMLPConfig(num_tiles=num_tiles)
        for i, layer in enumerate(decoder_layers_of(model)):
            parts = layer_parts(layer)
            if isinstance(parts, str):
                raise ValueError(
                    f"{type(model).__name__}: decoder layer {i} cannot be tiled ({parts}); "
                    f"the {stack} stack cannot be planned for this model"
                )
            install_layer(layer, parts, config)


def decoder_layers_of(model: Any) -> nn.ModuleList:
    decoder = getattr(model, model.base_model_prefix)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__}: no decoder layers at .{model.base_model_prefix}.layers; "
            "this model cannot be planned as a whole yet"
        )
    return layers
