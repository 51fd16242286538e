"""The forward installed on a tiled decoder layer: its two blocks (blocks.py)
through tiled_mlp's generic path (ops/mlp/generic.py) around the model's attention function.

Neither block keeps anything from its forward but its inputs (saved by a tiny anchor op), so a
checkpointed layer's recompute holds x, q, k, v, the attention output and their gradients, and
stops right after the attention core (the post-attention block is not re-run by it). The
attention core, where the implementation is "sdpa" (also behind a sequence-parallel exchange),
runs by groups of heads (patching/attention_core.py). The cost model (FLOPs per layer against
the untiled layer with checkpointing) is in docs/how-it-works/memory-model.md.

Invariant: a tiled layer computes what its original forward computes, with the same gradients
for its input and every parameter, each delivered once per backward. Calls the blocks cannot
take (attention weights being recorded, no rotary embeddings) run the original forward; a KV
cache is updated with the rotated keys and the values as the attention module does; where the
layer's class checkpoints inside its own forward (transformers 5) this forward does the same.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tiledmlp.ops.mlp.functional import run_tiled_mlp
from tiledmlp.patching.engine_registry import backend_for, run_checks
from tiledmlp.patching.features.tiled_layers.blocks import LayerParts, layer_math
from tiledmlp.patching.state import STATE, PatchState, original_forward

__all__ = ["LAYER", "tiled_layer_forward", "unchecked_forward"]

LAYER = "_tiledmlp_layer"


def _recording_attentions() -> bool:
    """Whether Hugging Face is recording attention weights (output_attentions=True): they come
    from hooks on the attention module, whose forward the tiled layer does not call."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # older transformers: layers return the weights themselves
        return False
    collected = _active_collector.get()
    return collected is not None and "attentions" in collected


def _checkpoints_in_forward(layer: nn.Module) -> bool:
    """Whether the layer's class checkpoints inside its `forward` (transformers 5 wraps each
    GradientCheckpointingLayer subclass's forward; 4.x checkpointed in `__call__`, which an
    instance forward stays inside of)."""
    forward = type(layer).forward
    return (
        hasattr(forward, "__wrapped__")
        and hasattr(layer, "_gradient_checkpointing_func")
        and "__call__" not in vars(_checkpointing_base(layer))
    )


def _checkpointing_base(layer: nn.Module) -> type:
    """The class that defines `gradient_checkpointing` (Hugging Face's GradientCheckpointingLayer)."""
    for cls in type(layer).__mro__:
        if "gradient_checkpointing" in vars(cls):
            return cls
    return type(layer)


def unchecked_forward(layer: nn.Module) -> Callable[..., Any]:
    """The layer's original computation without the checkpointing its class may wrap around it
    (for calls made inside a checkpoint, and for the probe)."""
    if STATE not in layer.__dict__ or layer.__dict__[STATE].saved is None:
        inner = getattr(type(layer).forward, "__wrapped__", None)
        if inner is not None and _checkpoints_in_forward(layer):
            return inner.__get__(layer)  # type: ignore[no-any-return]
    return original_forward(layer)


def tiled_layer_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward installed on tiled decoder layers (bound with patching.bound.bind). Where
    the layer's class checkpoints inside its own forward (transformers 5), this replacement
    does the same around the tiled computation, with the same treatment of the cache
    arguments (a checkpointed layer neither reads nor writes a cache)."""
    checkpointed = getattr(self, "gradient_checkpointing", False) and self.training
    if checkpointed and _checkpoints_in_forward(self):
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if not getattr(self, "_can_checkpoint_with_cache", False):
            kwargs[self.__dict__[LAYER].cache_keyword] = None
        func: Any = self._gradient_checkpointing_func
        return func(functools.partial(_tiled_layer_call, self, **kwargs), *args)
    return _tiled_layer_call(self, *args, **kwargs)


def _tiled_layer_call(
    self: nn.Module,
    hidden_states: Any,
    attention_mask: Any = None,
    position_ids: Any = None,
    past_key_values: Any = None,
    use_cache: Any = False,
    position_embeddings: Any = None,
    **kwargs: Any,
) -> Any:
    """The layer's computation: the tiled blocks, or the original computation for calls they
    cannot take."""
    parts: LayerParts = self.__dict__[LAYER]
    state: PatchState = self.__dict__[STATE]
    if parts.cache_keyword != "past_key_values":  # the cache under the name the layer takes
        past_key_values = kwargs.pop(parts.cache_keyword, past_key_values)
    if (
        (
            past_key_values is not None
            and (parts.latent or not isinstance(getattr(parts.attn, "layer_idx", None), int))
        )
        or not isinstance(position_embeddings, (tuple, list))
        or not isinstance(hidden_states, torch.Tensor)
        or hidden_states.dim() != 3
        or _recording_attentions()
    ):
        # Inside a checkpoint already (or not checkpointed): the class's own computation.
        return unchecked_forward(self)(
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **{parts.cache_keyword: past_key_values},
            **kwargs,
        )
    run_checks(self)

    def run(block: nn.Module, x: torch.Tensor, *extras: torch.Tensor) -> Any:
        return run_tiled_mlp(
            block,
            x,
            *extras,
            policy=state.config.policy,
            backend=backend_for(block),
            plan_tokens=state.step.value,
            count=state.count if block is parts.post else None,
        )

    return layer_math(
        parts, run, hidden_states, attention_mask, position_ids, use_cache,
        tuple(position_embeddings), kwargs, None, past_key_values,
    )  # fmt: skip
