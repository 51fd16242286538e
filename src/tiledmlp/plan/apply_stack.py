"""The planner's application of a stack to a fake model: patch_model's own features.

A stack is a set of patch_model options (config/stacks.py). The model, built under fake
tensors, gets them through the same feature code patch_model runs (patching/features/): each
feature's application is the product's, so a change to what training runs changes the
prediction. Only the probes that need real values are replaced by a declaration from structure:
the MLPs are the decoder layers' dense MLPs, recognised by their projections' shapes
(layer.py's declared_mlps), and the loss is declared tiled (its probe compares values). The other
probes run on the fake model as they are (norms by structure; a decoder layer's probe only
records how it calls its attention on fake parameters). Activation offloading's host buffers go
to the meta device: host memory is not device memory.

Invariant: a stack applied here installs what patch_model installs with that stack's options.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.stacks import STACK_OPTIONS
from tiledmlp.patching.features.activation_offloading import offloader_of
from tiledmlp.patching.patch import PatchReport, apply_features, probe_features
from tiledmlp.plan.layer import cut_config, declared_mlps

__all__ = ["apply_stack", "build_model", "decoder_layers_of"]


def build_model(config: Any, dtype: torch.dtype, layers: int) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_config(
        cut_config(config, layers), attn_implementation="sdpa", dtype=dtype, trust_remote_code=False
    ).train()


def apply_stack(
    model: nn.Module, hidden: int, num_tiles: int | str, stack: str, attention_kernel: str = "cudnn"
) -> PatchReport:
    """Applies `stack`'s patch_model options with `num_tiles` to the fake `model` through
    patch_model's features (module docstring); returns the report patch_model would give.
    `attention_kernel` "by_heads" adds attention_kernel="by_heads" (the model's own attention
    by head groups); another kernel changes only the attention backward's buffers, which the
    simulation adds by kernel (plan/device_overhead.py).

    Raises:
        ValueError: a decoder MLP that is not a dense MLP recognised by shape, a decoder layer
            that cannot be tiled (the tiled_layer stack): the stack cannot be planned.
    """
    options = STACK_OPTIONS[stack]
    if options is None:
        raise ValueError(f"the {stack} stack patches nothing; leave the model as it is")
    kernel = {"attention_kernel": "by_heads"} if attention_kernel == "by_heads" else {}
    config = PatchConfig.from_kwargs(
        {**options, **kernel, "num_tiles": num_tiles, "hidden_size": hidden}
    )
    mlps = declared_mlps(model, decoder_layers_of(model), hidden)
    declared = {"tiled_mlp": mlps, "tiled_loss": None}
    try:
        found = probe_features(model, config, declared)
    except ValueError as e:
        raise ValueError(f"{e}; the {stack} stack cannot be planned for this model") from None
    report = apply_features(model, config, found)  # (the loss declared: no integration readied)
    offloader = offloader_of(model)
    if offloader is not None:
        offloader.pool.device = torch.device("meta")
    return report


def decoder_layers_of(model: Any) -> nn.ModuleList:
    decoder = getattr(model, model.base_model_prefix)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__}: no decoder layers at .{model.base_model_prefix}.layers; "
            "this model cannot be planned as a whole yet"
        )
    return layers
