"""Routing a Hugging Face causal LM's training loss through tiled_cross_entropy.

The model's own forward stays in charge when no labels are given. With labels, the base model
runs as usual and the loss is computed from its last hidden states by tiled_cross_entropy with
the LM head's weight (and bias), the model's logit scale and final-logit soft-capping, causal
shifting (or the caller's shift_labels), the positions `logits_to_keep` keeps and
num_items_in_batch handled like Hugging Face's loss (patching/loss_head.py); the logits are
never materialised (the output's `logits` is None).

A call with `fused_lm_head=True` (the slot through which TRL's trainers ask a model for
per-token log-probabilities instead of logits) is served by the fused-head server an integration
registered (tiledmlp.integrations.trl); `fused_lm_head` never reaches the decoder.

Invariant: a model is only patched after a probe (patching/loss_probe.py) shows that, on random
ids, the patched loss equals the model's own loss; a model whose forward adds anything else to
the loss (an MoE auxiliary loss) fails the probe and is left alone, with the reason reported. A
logits_to_keep form the probe could not match runs the model's own loss, logged once and named
in the report. Unpatching restores the forward this patch replaced; when another forward was
installed over it since, that one is kept and ours stays below it as a pure pass-through.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tiledmlp.ops.loss.cross_entropy import tiled_cross_entropy
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.patching.bound import BoundForward, bind
from tiledmlp.patching.loss_head import (
    ALL,
    HeadTransform,
    keep_form,
    kept_rows,
    scale_candidates,
    softcap_of,
    targets_of,
)
from tiledmlp.patching.loss_probe import probe

__all__ = [
    "decoder_of",
    "install_loss",
    "lifted",
    "loss_refusal",
    "loss_description",
    "loss_patched",
    "patch_loss",
    "register_fused_head",
    "register_on_loss_patch",
    "replaced_forward",
    "softcap_of",
    "unannounced",
    "unpatch_loss",
]

logger = logging.getLogger(__name__)

_STATE = "_tiledmlp_loss_patch"
_TOLD: list[bool] = []  # the evaluation note is logged once per process
#: what loss_refusal found for a model, until install_loss takes it
_FOUND: weakref.WeakKeyDictionary[nn.Module, HeadTransform] = weakref.WeakKeyDictionary()
_TOLD_OWN: set[tuple[str, str]] = set()  # (model class, logits_to_keep form) told to run its own

#: serves model(..., fused_lm_head=True): server(model, args, kwargs, num_tiles) -> output
_FUSED_SERVER: list[Callable[..., Any]] = []
#: called with the causal LM after its loss is patched (an integration readies its slot)
_ON_PATCH: list[Callable[[nn.Module], None]] = []
_UNANNOUNCED: list[bool] = []  # non-empty inside unannounced()


def register_fused_head(server: Callable[..., Any]) -> None:
    """Sets the server of `fused_lm_head=True` calls on loss-patched models (one at a time)."""
    _FUSED_SERVER[:] = [server]


def register_on_loss_patch(hook: Callable[[nn.Module], None]) -> None:
    """Adds a hook called with the causal LM each time its loss is patched."""
    if hook not in _ON_PATCH:
        _ON_PATCH.append(hook)


@dataclass
class _LossState:
    saved: Any  # replaced instance-level forward, or None
    num_tiles: TilePolicy
    head: HeadTransform = field(default_factory=HeadTransform)
    # False once unpatched while another forward sat over ours: ours stays in that forward's
    # chain as a pure pass-through to `saved`
    active: bool = True


def replaced_forward(model: nn.Module) -> Any:
    """The forward the loss patch of `model` sits over (bound): the class's, or the one
    another library installed before (TRL's fused head); the current one when not patched."""
    model = _causal_lm(model)
    if _STATE not in model.__dict__:
        return model.forward
    return _original(model)


def _original(model: nn.Module) -> Any:
    state = model.__dict__.get(_STATE)
    if state is None or state.saved is None:
        return type(model).forward.__get__(model)
    return state.saved


def _loss_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed forward of a loss-patched causal LM (bound to the instance)."""
    state: _LossState = self.__dict__[_STATE]
    if not state.active:
        return _original(self)(*args, **kwargs)
    if kwargs.pop("fused_lm_head", False):
        if not _FUSED_SERVER:
            raise TypeError(
                f"{type(self).__name__}(..., fused_lm_head=True): no fused-head server is "
                "registered; import tiledmlp (it registers TRL's) or call without fused_lm_head"
            )
        return _FUSED_SERVER[0](self, args, kwargs, state.num_tiles)
    orig = _original(self)
    params = _by_name(orig, args, kwargs)
    if params is None:
        return orig(*args, **kwargs)
    labels = params.pop("labels", None)
    if labels is None:
        return orig(*args, **kwargs)  # no loss to tile
    # logits_to_keep is the model's to read only where its forward names it; else it stays in
    # the keyword arguments that reach the decoder, as in the model's own forward
    keep = params.pop("logits_to_keep", None) if _names(orig, "logits_to_keep") else None
    form = keep_form(keep)
    why = "not one of transformers' forms" if form is None else state.head.unserved.get(form)
    if why is not None:
        _tell_own_loss(self, form or _described(keep), why)
        return orig(*args, **kwargs)
    shifted = params.pop("shift_labels", None)
    num_items = params.pop("num_items_in_batch", None)
    return_dict = params.pop("return_dict", None)
    outputs = decoder_of(self)(**params)
    hidden = outputs[0]
    head = self.get_output_embeddings()  # type: ignore[operator]
    config = getattr(self, "config", None)
    # Evaluation (eval mode, no gradient): the argmax of every position's logits comes out of
    # the same tiles, as `predictions` (what compute_metrics gets instead of logits).
    evaluating = not self.training and not torch.is_grad_enabled() and form == ALL
    if form == ALL:
        targets, shift = (labels, True) if shifted is None else (shifted, False)
    else:
        # the kept positions' rows, scored against the labels shifted and flattened as the
        # model's loss does (patching/loss_head.py)
        hidden = kept_rows(hidden, keep)
        targets, shift = targets_of(labels, shifted), False
        if targets.numel() != hidden.shape[0]:
            raise ValueError(
                f"{type(self).__name__}(labels=..., logits_to_keep=...): logits_to_keep keeps "
                f"{hidden.shape[0]} position(s) but the labels hold {targets.numel()}; expected "
                "labels with one entry per kept position (as the model's own loss does)"
            )
    loss = tiled_cross_entropy(
        hidden,
        head.weight,
        targets,
        bias=getattr(head, "bias", None),
        num_tiles=state.num_tiles,
        shift=shift,
        softcap=softcap_of(config),
        logit_scale=state.head.scale,
        reduction="mean" if num_items is None else "sum",
        return_aux=evaluating,
    )
    predictions = None
    if evaluating:
        loss, predictions = loss.loss, loss.predictions
    if num_items is not None:
        loss = loss / num_items
    return _output(outputs, loss, predictions, _wants_dict(config, return_dict))


def _names(fn: Any, name: str) -> bool:
    return name in inspect.signature(fn).parameters


def _described(keep: Any) -> str:
    if isinstance(keep, torch.Tensor):
        return f"a {keep.dim()}-D {keep.dtype} tensor"
    return f"{type(keep).__name__} {keep!r}"


def _tell_own_loss(model: nn.Module, form: str, why: str) -> None:
    """Logs once per model class and form that a call runs the model's own loss, and why."""
    key = (type(model).__name__, form)
    if key in _TOLD_OWN:
        return
    _TOLD_OWN.add(key)
    logger.warning(
        "tiled loss: %s(labels=..., logits_to_keep=%s) runs the model's own loss (its logits "
        "formed whole): %s",
        key[0],
        form,
        why,
    )


def _by_name(orig: Any, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """The forward's arguments by name (**kwargs flattened in), or None when they do not bind
    to the original forward's signature (the model's own forward then reports it)."""
    try:
        bound = inspect.signature(orig).bind(*args, **kwargs)
    except TypeError:
        return None
    params = dict(bound.arguments)
    for name, p in inspect.signature(orig).parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD and name in params:
            params.update(params.pop(name))
    return params


def _output(outputs: Any, loss: torch.Tensor, predictions: Any, as_dict: bool) -> Any:
    """The causal LM's output from the decoder's `outputs` and the tiled loss: its tuple layout
    or a CausalLMOutputWithPast, logits None (with `predictions` when evaluating)."""
    if not as_dict:
        # The model's tuple layout, (loss, logits, *the base model's outputs), with None where
        # the logits would be: they are never materialised, and positions must not shift.
        rest = outputs.to_tuple()[1:] if hasattr(outputs, "to_tuple") else tuple(outputs[1:])
        return (loss, None, *rest)
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # The KV cache's field is `past_key_values` up to transformers 5.23 and `cache` from 5.24.
    fields = CausalLMOutputWithPast.__dataclass_fields__
    cache = "cache" if "cache" in fields else "past_key_values"
    result = CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
        **{cache: getattr(outputs, cache, None)},
    )
    if predictions is not None:
        # an extra key: the Trainer's prediction loop hands every non-loss output to
        # compute_metrics, so EvalPrediction.predictions are these token ids
        result["predictions"] = predictions
        if not _TOLD:
            _TOLD.append(True)
            logger.warning(
                "tiled loss: evaluation outputs carry `predictions` (the argmax token of every "
                "position, labels' shape, int64) instead of logits, which are never formed; "
                "compute_metrics receives those as EvalPrediction.predictions (no argmax "
                "needed, no preprocess_logits_for_metrics)"
            )
    return result


def _wants_dict(config: Any, return_dict: bool | None) -> bool:
    """Whether the model would return a ModelOutput: return_dict if given, else its config's."""
    if return_dict is not None:
        return bool(return_dict)
    if config is None:
        return True
    return bool(getattr(config, "return_dict", True)) and not getattr(config, "torchscript", False)


def decoder_of(model: nn.Module) -> Any:
    """The module producing the last hidden states: base_model, or get_decoder() where
    base_model_prefix does not name an attribute (base_model is then the model itself)."""
    lm: Any = model
    base = getattr(lm, "base_model", None)
    if (base is None or base is model) and hasattr(lm, "get_decoder"):
        base = lm.get_decoder()
    if base is None or base is model:
        raise TypeError(f"{type(model).__name__} has no base model or decoder to run")
    return base


def loss_refusal(model: nn.Module, num_tiles: TilePolicy) -> str | None:
    """The probe of the tiled loss: None when the loss of `model` can be routed through
    tiled_cross_entropy (or already is), else why not. Runs the model on random ids at a
    scaled LM head (patching/loss_probe.py); changes nothing but remembering, for
    install_loss, the logit scale it found and the logits_to_keep forms it serves.

    A PEFT model (PeftModel and kin, which call their base model's forward with the labels) is
    probed through the causal LM it wraps.
    """
    model = _causal_lm(model)
    if _STATE in model.__dict__:
        return None
    # the probe calls the patched forward directly: it reads the state, present for the probe
    # only; the HeadTransform it finds is kept for install_loss
    state = _LossState(model.__dict__.get("forward"), num_tiles)
    model.__dict__[_STATE] = state

    def use(head: HeadTransform) -> None:
        state.head = head

    try:
        why = probe(model, _original(model), functools.partial(_loss_forward, model), use)
    finally:
        del model.__dict__[_STATE]
    if why is None:
        _FOUND[model] = state.head
    return why


def install_loss(model: nn.Module, num_tiles: TilePolicy) -> None:
    """Routes the training loss of `model` through tiled_cross_entropy, with the tile policy
    `num_tiles` (a loss policy: a count, tokens per tile or "auto"; PatchConfig.loss_policy);
    on a loss-patched model, updates the policy. Reads no values (the probe, loss_refusal, is
    the caller's): it installs on a model built under fake tensors as on a real one.
    """
    model = _causal_lm(model)
    state = model.__dict__.get(_STATE)
    if state is not None:
        state.num_tiles = num_tiles
        state.active = True
        return
    head = _FOUND.pop(model, None)
    if head is None:  # not probed (the planner's fake model): the likeliest scale
        head = HeadTransform(scale_candidates(getattr(model, "config", None))[0])
    model.__dict__[_STATE] = _LossState(model.__dict__.get("forward"), num_tiles, head)
    # Bound with its module (picklable, deep-copied with it), advertising the model's own
    # forward signature: the Hugging Face Trainer inspects it to decide which inputs to pass.
    model.forward = bind(_loss_forward, model, _original)  # type: ignore[method-assign]
    for hook in _ON_PATCH if not _UNANNOUNCED else ():
        hook(model)


@contextlib.contextmanager
def unannounced() -> Iterator[None]:
    """Within the block, a loss patch does not call the hooks integrations registered
    (register_on_loss_patch): for a model that is never trained, the planner's fake one, which
    needs no integration readied (TRL's import takes seconds)."""
    _UNANNOUNCED.append(True)
    try:
        yield
    finally:
        _UNANNOUNCED.pop()


def patch_loss(model: nn.Module, num_tiles: TilePolicy) -> str | None:
    """The probe and, when it passes, the install (loss_refusal, install_loss).

    Returns:
        None when patched (or already patched; the tile policy is updated), else the reason it
        was left alone.
    """
    why = loss_refusal(model, num_tiles)
    if why is None:
        install_loss(model, num_tiles)
    return why


def loss_patched(model: nn.Module) -> bool:
    """Whether `model` (or the causal LM a PEFT wrapper holds) has its loss patched."""
    state = _causal_lm(model).__dict__.get(_STATE)
    return state is not None and state.active


def loss_description(model: nn.Module) -> str | None:
    """The report's text for a loss-patched model: "tiled", with the logits_to_keep forms whose
    calls run the model's own loss and why; None when not loss-patched."""
    state = _causal_lm(model).__dict__.get(_STATE)
    if state is None or not state.active:
        return None
    own = state.head.unserved
    if not own:
        return "tiled"
    whys = "; ".join(f"{form}: {why}" for form, why in own.items())
    return f"tiled, except calls with logits_to_keep as {whys} (these run the model's own loss)"


def _ours_on_top(model: nn.Module) -> bool:
    fwd = model.__dict__.get("forward")
    return isinstance(fwd, BoundForward) and fwd.func is _loss_forward and fwd.module is model


@contextlib.contextmanager
def lifted(model: nn.Module) -> Iterator[None]:
    """Takes the patched forward off the loss-patched causal LM for the block and puts it back
    on top of whatever the block installed (another library's wrapper of the original forward
    then sits below the tiled loss, which hands it every call it does not serve).

    Raises:
        RuntimeError: another forward already sits over the patched one.
    """
    model = _causal_lm(model)
    state: _LossState = model.__dict__[_STATE]
    if not _ours_on_top(model):
        raise RuntimeError(_covered(model, "lift the tiled loss"))
    ours = model.__dict__.pop("forward")
    if state.saved is not None:
        model.forward = state.saved  # type: ignore[method-assign]
    try:
        yield
    finally:
        state.saved = model.__dict__.get("forward")
        model.forward = ours  # type: ignore[method-assign]


def _covered(model: nn.Module, what: str) -> str:
    top = model.__dict__.get("forward")
    name = getattr(getattr(top, "__func__", top), "__qualname__", type(top).__name__)
    module = getattr(getattr(top, "__func__", top), "__module__", "?")
    return (
        f"cannot {what} of {type(model).__name__}: another forward ({module}.{name}) was "
        "installed over it, and removing ours would remove it too"
    )


def _causal_lm(model: nn.Module) -> nn.Module:
    """The causal LM whose forward computes the loss: a PEFT wrapper's base model (PEFT's
    get_base_model()), else the model itself."""
    getter = getattr(model, "get_base_model", None)
    base = getter() if callable(getter) else None
    return base if isinstance(base, nn.Module) and base is not model else model


def unpatch_loss(model: nn.Module) -> bool:
    """Restores the forward the patch replaced; True if it was loss-patched.

    When another library installed a forward over the patched one since (Accelerate's
    autocast wrapper, a TRL head added without the tiled loss's knowledge), that forward is
    kept: the patched forward stays in its chain as a pure pass-through to the forward it
    replaced, so the model computes exactly what it computed before patching.
    """
    model = _causal_lm(model)
    state = model.__dict__.get(_STATE)
    if state is None or not state.active:
        return False
    if not _ours_on_top(model):
        state.active = False
        logger.info("%s", _covered(model, "take the tiled loss off").replace("cannot", "did not"))
        return True
    del model.__dict__[_STATE]
    if state.saved is None:
        model.__dict__.pop("forward", None)
    else:
        model.forward = state.saved  # type: ignore[method-assign]
    return True
