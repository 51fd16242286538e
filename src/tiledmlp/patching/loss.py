"""Routing a Hugging Face causal LM's training loss through tiled_cross_entropy.

The model's own forward stays in charge when no labels are given. With labels, the base model
runs as usual and the loss is computed from its last hidden states by tiled_cross_entropy with
the LM head's weight (and bias), the model's final-logit soft-capping, causal shifting (or the
caller's shift_labels) and num_items_in_batch handled like Hugging Face's loss; the logits are
never materialised (the output's `logits` is None).

Invariant: a model is only patched after a probe shows that, on random ids, the patched loss
equals the model's own loss; a model whose forward adds anything else to the loss (an MoE
auxiliary loss, logit scaling) fails the probe and is left alone, with the reason reported.
"""

from __future__ import annotations

import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiledmlp.ops.loss import tiled_cross_entropy
from tiledmlp.patching.detect import probing

__all__ = ["patch_loss", "unpatch_loss"]

_STATE = "_tiledmlp_loss_patch"


@dataclass
class _LossState:
    saved: Any  # replaced instance-level forward, or None
    num_tiles: int | str


def _original(model: nn.Module) -> Any:
    state = model.__dict__.get(_STATE)
    if state is None or state.saved is None:
        return type(model).forward.__get__(model)
    return state.saved


def _loss_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed forward of a loss-patched causal LM (bound to the instance)."""
    orig = _original(self)
    try:
        bound = inspect.signature(orig).bind(*args, **kwargs)
    except TypeError:
        return orig(*args, **kwargs)
    params = dict(bound.arguments)
    for name, p in inspect.signature(orig).parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD and name in params:
            params.update(params.pop(name))
    labels = params.pop("labels", None)
    if labels is None:
        return orig(*args, **kwargs)
    state: _LossState = self.__dict__[_STATE]
    shifted = params.pop("shift_labels", None)
    num_items = params.pop("num_items_in_batch", None)
    params.pop("logits_to_keep", None)
    params.pop("return_dict", None)
    outputs = _decoder(self)(**params)
    hidden = outputs[0]
    head = self.get_output_embeddings()  # type: ignore[operator]
    config = getattr(self, "config", None)
    loss = tiled_cross_entropy(
        hidden,
        head.weight,
        shifted if shifted is not None else labels,
        bias=getattr(head, "bias", None),
        num_tiles=state.num_tiles,
        shift=shifted is None,
        softcap=getattr(config, "final_logit_softcapping", None),
        reduction="mean" if num_items is None else "sum",
    )
    if num_items is not None:
        loss = loss / num_items
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        past_key_values=getattr(outputs, "past_key_values", None),
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
    )


def _decoder(model: nn.Module) -> Any:
    """The module producing the last hidden states: base_model, or get_decoder() where
    base_model_prefix does not name an attribute (base_model is then the model itself)."""
    lm: Any = model
    base = getattr(lm, "base_model", None)
    if (base is None or base is model) and hasattr(lm, "get_decoder"):
        base = lm.get_decoder()
    if base is None or base is model:
        raise TypeError(f"{type(model).__name__} has no base model or decoder to run")
    return base


def _probe(model: nn.Module) -> str | None:
    """None when the patched loss equals the model's own on random ids, else why not."""
    lm: Any = model  # a Hugging Face PreTrainedModel, duck-typed
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is None or getattr(head, "weight", None) is None:
        return "no LM head (get_output_embeddings): not a causal LM"
    if head.weight.device.type == "meta":
        return "weights on the meta device"
    vocab = head.weight.shape[0]
    gen = torch.Generator(device=head.weight.device).manual_seed(0)
    ids = torch.randint(0, vocab, (2, 7), generator=gen, device=head.weight.device)
    try:
        with probing(model):
            own = _original(model)(input_ids=ids, labels=ids).loss
            ours = _loss_forward(model, input_ids=ids, labels=ids).loss
    except Exception as e:  # a forward that the generic reimplementation cannot drive
        return f"the probe failed ({type(e).__name__}: {e})"
    if own is None or not torch.allclose(ours.float(), own.float(), rtol=1e-4, atol=1e-5):
        return (
            f"the model's own loss ({float(own) if own is not None else None}) differs from "
            f"the LM-head cross-entropy ({float(ours)}): its forward adds something (e.g. an "
            "MoE auxiliary loss or logit scaling)"
        )
    return None


def patch_loss(model: nn.Module, num_tiles: int | str = "auto") -> str | None:
    """Routes the training loss of `model` through tiled_cross_entropy.

    Returns:
        None when patched (or already patched; the tile policy is updated), else the reason it
        was left alone.
    """
    state = model.__dict__.get(_STATE)
    if state is not None:
        state.num_tiles = num_tiles
        return None
    model.__dict__[_STATE] = _LossState(model.__dict__.get("forward"), num_tiles)
    why = _probe(model)
    if why is not None:
        del model.__dict__[_STATE]
        return why
    model.forward = types.MethodType(_with_signature_of(model), model)  # type: ignore[method-assign]
    return None


def _with_signature_of(model: nn.Module) -> Any:
    """A copy of _loss_forward that advertises the model's own forward signature: callers such
    as the Hugging Face Trainer inspect it to decide which inputs to pass."""
    fn = types.FunctionType(
        _loss_forward.__code__, _loss_forward.__globals__, "forward", None, None
    )
    fn.__doc__ = _loss_forward.__doc__
    own = _original(model)
    params = list(inspect.signature(own).parameters.values())
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    fn.__signature__ = inspect.Signature([self_param, *params])  # type: ignore[attr-defined]
    return fn


def unpatch_loss(model: nn.Module) -> bool:
    """Restores the model's own forward; True if it was loss-patched."""
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return False
    if state.saved is None:
        model.__dict__.pop("forward", None)
    else:
        model.forward = state.saved  # type: ignore[method-assign]
    return True
