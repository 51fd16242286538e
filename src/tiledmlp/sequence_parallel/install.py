"""Installing Ulysses sequence parallelism on a model, and removing it.

`install` points the decoder's config(s) at a Ulysses attention function (attention.py)
registered under a new name through the attention backend (attention_backend.py: Hugging Face's
AttentionInterface, with a mask function registered with AttentionMaskInterface that makes the
model build no mask): every attention module calls it through its config's attention
implementation, whatever engine (DDP, FSDP, DeepSpeed) wraps the model. Forward hooks check the
inputs before any collective and make the model's loss exact over the whole sequences.

Invariant: nothing on the model's modules or state_dict changes; `remove` restores the original
implementation names and takes off exactly the hooks `install` added.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

from torch import nn

from tiledmlp.sequence_parallel.attention import SUPPORTED_ATTENTION, UlyssesAttention, kv_repeat
from tiledmlp.sequence_parallel.attention_backend import attention_backend
from tiledmlp.sequence_parallel.groups import SequenceParallelGroups
from tiledmlp.sequence_parallel.masks import no_mask, refuse_padding, ulysses_error
from tiledmlp.sequence_parallel.model_loss import exact_output, refuse_unshifted_labels

__all__ = ["UlyssesReport", "install", "installed_groups", "remove", "set_implementation"]

logger = logging.getLogger(__name__)

_NAME = "tiledmlp_ulysses"
_STATE = "_tiledmlp_sequence_parallel"


@dataclass(frozen=True)
class UlyssesReport:
    """What install did.

    Attributes:
        attn_implementation: the registered name the switched configs now carry.
        original: the attention implementation the wrapper calls on whole sequences.
        configs: class names of the configs switched (the decoder's text config and copies of
            it held by sub-models).
        checked: class names of the modules whose inputs are checked on every forward (missing
            position_ids, padding masks).
    """

    attn_implementation: str
    original: str
    configs: tuple[str, ...]
    checked: tuple[str, ...]


@dataclass
class _Installed:
    """Kept on the model (in its __dict__) between install and remove."""

    name: str
    originals: list[tuple[Any, Any]]  # (config, its original _attn_implementation)
    groups: SequenceParallelGroups | None = None


_REGISTERED: dict[str, UlyssesAttention] = {}


def _register(groups: SequenceParallelGroups, original: str) -> str:
    """The name of the attention function for (groups, original), registered on first use."""
    for name, fn in _REGISTERED.items():
        if fn.groups == groups and fn.original == original:
            return name
    name = f"{_NAME}_{original}" + (f"_{len(_REGISTERED)}" if _REGISTERED else "")
    fn = UlyssesAttention(groups, original)
    attention_backend().register(name, fn, no_mask)
    _REGISTERED[name] = fn
    return name


def _base(model: nn.Module) -> nn.Module:
    """A PEFT wrapper's base model (get_base_model()), else the model itself."""
    getter = getattr(model, "get_base_model", None)
    base = getter() if callable(getter) else None
    return base if isinstance(base, nn.Module) else model


def _decoder_configs(model: nn.Module) -> list[Any]:
    """The text decoder's config and every copy of it a sub-model holds (same class)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise TypeError(
            f"tiledmlp: sequence parallelism needs a Hugging Face model with a config, got "
            f"{type(model).__name__}"
        )
    text = attention_backend().text_config(config)
    found = [text]
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if type(cfg) is type(text) and all(cfg is not c for c in found):
            found.append(cfg)
    return found


def set_implementation(config: Any, name: Any) -> None:
    """Sets one config's attention implementation name, that config's alone: through the
    internal attribute where there is one (the public setter recurses into sub-configs, and a
    vision tower must keep its own attention)."""
    if hasattr(config, "_attn_implementation_internal"):
        config._attn_implementation_internal = name
    else:
        config._attn_implementation = name


def install(model: nn.Module, groups: SequenceParallelGroups) -> UlyssesReport:
    """Makes `model`'s attention sequence-parallel over groups.sp_group (Ulysses).

    Call it on every rank before wrapping the model in an engine (DDP, FSDP, DeepSpeed); the
    wrapper does not care which. Afterwards every forward must get this rank's shard of each
    sequence, with position_ids, e.g. model(**shard_batch(batch, groups)); the model's loss
    (`out.loss`, when shift_labels are given) is then the exact loss over the whole sequences
    (see model_loss.py): use it as it is. Inputs are checked before any collective the forward
    runs (the hooks go first, also before patch_model's per-step token agreement).

    Args:
        model: a Hugging Face causal LM (or a PEFT wrapper of one) whose decoder uses sdpa or
            flash attention.
        groups: from make_groups.

    Returns:
        What was switched and checked.

    Raises:
        ValueError: already installed; an unsupported attention implementation (eager, flex);
            query heads not divisible by P; key/value heads neither divisible by P nor dividing
            P. No collective runs here.
    """
    base = _base(model)
    if _STATE in base.__dict__:
        raise ulysses_error("already installed on this model; call remove(model) first")
    configs = _decoder_configs(base)
    text = configs[0]
    originals = {c._attn_implementation for c in configs}
    if len(originals) != 1:
        raise ulysses_error(
            f"the decoder's configs use different attention implementations {sorted(originals)}; "
            "set one with model.set_attn_implementation('sdpa') first"
        )
    original = originals.pop()
    if original not in SUPPORTED_ATTENTION:
        raise ulysses_error(
            f"attention implementation {original!r} is not supported (expected one of "
            f"{', '.join(SUPPORTED_ATTENTION)}): the wrapper calls the model's own attention on "
            "whole sequences and masks by position ids; load the model with "
            "attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))"
        )
    p = groups.sp_size
    heads = getattr(text, "num_attention_heads", None)
    if isinstance(heads, int):
        kv_repeat(heads, int(getattr(text, "num_key_value_heads", None) or heads), p)
    name = _register(groups, original)
    checked = []
    for m in base.modules():
        cfg = getattr(m, "config", None)
        if any(cfg is c for c in configs) and _takes_position_ids(m):
            m.register_forward_pre_hook(_check_inputs, with_kwargs=True, prepend=True)
            checked.append(type(m).__name__)
    if model is not base:  # a PEFT wrapper: the module the user (and the engine) calls
        model.register_forward_pre_hook(_check_inputs, with_kwargs=True, prepend=True)
        checked.insert(0, type(model).__name__)
    model.register_forward_hook(_exact_loss, with_kwargs=True)
    base.__dict__[_STATE] = _Installed(name, [(c, c._attn_implementation) for c in configs], groups)
    for c in configs:
        set_implementation(c, name)
    logger.info("tiledmlp: Ulysses SP over %d ranks installed (wrapping %s)", p, original)
    return UlyssesReport(name, original, tuple(type(c).__name__ for c in configs), tuple(checked))


def _takes_position_ids(module: nn.Module) -> bool:
    """A model (a module with a config, not one of its layers) whose forward takes
    position_ids: where missing position ids are caught before the first collective."""
    if not hasattr(module, "get_input_embeddings"):
        return False
    try:
        return "position_ids" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _given(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The forward's arguments by name (positional ones named by the forward's signature)."""
    given = dict(zip(inspect.signature(module.forward).parameters, args))
    given.update(kwargs)
    return given


def _check_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook (registered to run before every other pre-hook): refuses missing
    position_ids, padding masks and unshifted labels before any collective."""
    given = _given(module, args, kwargs)
    fn = _REGISTERED.get(getattr(getattr(module, "config", None), "_attn_implementation", ""))
    if fn is not None:
        fn.forget()
    if given.get("position_ids") is None:
        raise ulysses_error(
            f"{type(module).__name__} got no position_ids; without them each rank would number "
            "its tokens from 0. Pass this rank's position ids, e.g. "
            "model(**tiledmlp.sequence_parallel.shard_batch(batch, groups))"
        )
    refuse_padding(given.get("attention_mask"))
    refuse_unshifted_labels(given)


def _exact_loss(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook on the model the user calls: its loss becomes the exact loss over the SP
    group's whole sequences (model_loss.py)."""
    groups = installed_groups(module)
    if groups is None:
        return None
    return exact_output(output, _given(module, args, kwargs), groups)


def installed_groups(model: nn.Module) -> SequenceParallelGroups | None:
    """The groups `model`'s attention is sequence-parallel over, or None when not installed."""
    state: _Installed | None = _base(model).__dict__.get(_STATE)
    return None if state is None else state.groups


def remove(model: nn.Module) -> bool:
    """Restores the attention implementation(s) install replaced; True if it was installed."""
    base = _base(model)
    state: _Installed | None = base.__dict__.pop(_STATE, None)
    if state is None:
        return False
    for config, original in state.originals:
        set_implementation(config, original)
    for m in model.modules():  # a PEFT wrapper's modules include its base model's
        for key, hook in list(m._forward_pre_hooks.items()):
            if hook is _check_inputs:
                del m._forward_pre_hooks[key]
                m._forward_pre_hooks_with_kwargs.pop(key, None)
        for key, hook in list(m._forward_hooks.items()):
            if hook is _exact_loss:
                del m._forward_hooks[key]
                m._forward_hooks_with_kwargs.pop(key, None)
                m._forward_hooks_always_called.pop(key, None)
    return True
