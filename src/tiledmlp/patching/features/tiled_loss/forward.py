"""The tiled loss's forward: a Hugging Face causal LM's training loss through tiled_cross_entropy.

Invariant: a model is only patched after a probe (probe.py) shows that, on random
ids, the patched loss equals the model's own loss; a model whose forward adds anything else to
the loss (an MoE auxiliary loss computed otherwise than transformers' load_balancing_loss_func)
fails the probe and is left alone, with the reason reported. A
logits_to_keep form the probe could not match runs the model's own loss, logged once and named
in the report. Unpatching restores the forward this patch replaced; when another forward was
installed over it since, that one is kept and ours stays below it as a pure pass-through.

Note: how it works, its costs and its choices are in
docs/how-it-works/module-notes.md#patching-features-tiled-loss-forward.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tiledmlp.ops.loss.cross_entropy import tiled_cross_entropy
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.patching.bound import BoundForward, bind
from tiledmlp.patching.detect import text_config
from tiledmlp.patching.features.tiled_loss.head import (
    ALL,
    OWN_FAILS,
    PASSED_FORMS,
    HeadTransform,
    keep_form,
    keeps_positions,
    kept_rows,
    router_aux_loss,
    scale_candidates,
    softcap_of,
    targets_of,
)
from tiledmlp.patching.features.tiled_loss.probe import probe
from tiledmlp.patching.native import liger_loss

__all__ = [
    "LossProbe",
    "decoder_of",
    "install_loss",
    "lifted",
    "loss_description",
    "loss_patched",
    "probe_loss",
    "replaced_forward",
    "softcap_of",
    "unpatch_loss",
]

logger = logging.getLogger(__name__)

_STATE = "_tiledmlp_loss_patch"
_PREDICTIONS = "predictions"  # the key of the evaluation note in _LossState.told

#: What the tiled loss's probe found (probe_loss): the HeadTransform the patched loss uses, why
#: the loss cannot be tiled (a str), or None where no probe ran (the model is already patched,
#: or a caller declares the result instead, the planner's fake model).
LossProbe = HeadTransform | str | None


@dataclass
class _LossState:
    saved: Any  # replaced instance-level forward, or None
    tiles: TilePolicy
    head: HeadTransform = field(default_factory=HeadTransform)
    #: serves model(..., fused_lm_head=True): server(model, args, kwargs, tiles) -> output
    fused_head: Callable[..., Any] | None = None
    #: the notes logged for this patch (each once): the kinds of call told to run the model's
    #: own loss, and the evaluation note (_PREDICTIONS)
    told: set[str] = field(default_factory=set)
    # False once unpatched while another forward sat over ours: ours stays in that forward's
    # chain as a pure pass-through to `saved`
    active: bool = True

    def tell_once(self, key: str) -> bool:
        """Whether the note `key` is still to be logged for this patch (it is marked told)."""
        if key in self.told:
            return False
        self.told.add(key)
        return True


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
    if kwargs.get("fused_lm_head", False) and _router_on(self, kwargs):
        # TRL's fused head with an MoE auxiliary loss: the head below ours serves it
        _tell_own_loss(
            self,
            state,
            "fused_lm_head=True",
            "the fused LM head with MoE router logits (an auxiliary loss) is served by the "
            "head the trainer installed; set output_router_logits=False to tile it",
        )
        return _original(self)(*args, **kwargs)
    if kwargs.pop("fused_lm_head", False):
        if state.fused_head is None:
            raise TypeError(
                f"{type(self).__name__}(..., fused_lm_head=True): no fused-head server is "
                "registered; import tiledmlp (it registers TRL's) or call without fused_lm_head"
            )
        return state.fused_head(self, args, kwargs, state.tiles)
    orig = _original(self)
    params = _by_name(orig, args, kwargs)
    if params is None:
        return orig(*args, **kwargs)
    labels = params.pop("labels", None)
    if labels is None:
        return orig(*args, **kwargs)  # no loss to tile
    # logits_to_keep is the model's to read only where its class's forward names it (a wrapper
    # installed below ours, TRL's, takes **kwargs); else it stays in the keyword arguments that
    # reach the decoder, as in the model's own forward
    keep = params.pop("logits_to_keep", None) if keeps_positions(self) else None
    form = keep_form(keep)
    why = "not one of transformers' forms" if form is None else state.head.unserved.get(form)
    if why is not None:
        _tell_own_loss(self, state, f"logits_to_keep={form or _described(keep)}", why)
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
        # model's loss does (head.py)
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
        num_tiles=state.tiles,
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
    aux = router_aux_loss(self, outputs, params.get("attention_mask"))
    if aux is not None:  # added after the division, as the model's own forward does
        loss = loss + aux[1] * aux[0].to(loss.device)
    aux_loss = None if aux is None else aux[0]
    as_dict = _wants_dict(config, return_dict)
    return _output(outputs, loss, predictions, aux_loss, as_dict, state)


def _described(keep: Any) -> str:
    if isinstance(keep, torch.Tensor):
        return f"a {keep.dim()}-D {keep.dtype} tensor"
    return f"{type(keep).__name__} {keep!r}"


def _tell_own_loss(model: nn.Module, state: _LossState, call: str, why: str) -> None:
    """Logs once per patch and kind of call that it runs the model's own loss, and why
    (`call`: the arguments that make it, as "logits_to_keep=<form>")."""
    if not state.tell_once(call):
        return
    logger.warning(
        "tiled loss: %s(labels=..., %s) runs the model's own loss (its logits formed whole): %s",
        type(model).__name__,
        call,
        why,
    )


def _router_on(model: nn.Module, kwargs: dict[str, Any]) -> bool:
    """Whether the call returns MoE router logits (and the model's loss adds their auxiliary
    loss): output_router_logits if passed, else the config's."""
    flag = kwargs.get("output_router_logits")
    if flag is None:
        config = getattr(model, "config", None)
        flag = any(
            getattr(cfg, "output_router_logits", False)
            for cfg in (config, text_config(config) if config is not None else None)
        )
    return bool(flag)


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


def _output(
    outputs: Any,
    loss: torch.Tensor,
    predictions: Any,
    aux_loss: Any,
    as_dict: bool,
    state: _LossState,
) -> Any:
    """The causal LM's output from the decoder's `outputs` and the tiled loss: its tuple layout
    or a CausalLMOutputWithPast (MoeCausalLMOutputWithPast with an auxiliary loss), logits None
    (with `predictions` when evaluating)."""
    if not as_dict:
        # The model's tuple layout, (loss, [aux_loss,] logits, *the base model's outputs), with
        # None where the logits would be: they are never materialised, and positions must not
        # shift.
        rest = outputs.to_tuple()[1:] if hasattr(outputs, "to_tuple") else tuple(outputs[1:])
        return (loss, None, *rest) if aux_loss is None else (loss, aux_loss, None, *rest)
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    kind = CausalLMOutputWithPast if aux_loss is None else MoeCausalLMOutputWithPast
    # The KV cache's field is `past_key_values` up to transformers 5.23 and `cache` from 5.24.
    fields = kind.__dataclass_fields__
    cache = "cache" if "cache" in fields else "past_key_values"
    moe = {} if aux_loss is None else {"aux_loss": aux_loss, "router_logits": outputs.router_logits}
    result = kind(
        loss=loss,
        logits=None,
        hidden_states=getattr(outputs, "hidden_states", None),
        attentions=getattr(outputs, "attentions", None),
        **{cache: getattr(outputs, cache, None)},
        **moe,
    )
    if predictions is not None:
        # an extra key: the Trainer's prediction loop hands every non-loss output to
        # compute_metrics, so EvalPrediction.predictions are these token ids
        result["predictions"] = predictions
        if state.tell_once(_PREDICTIONS):
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


def probe_loss(model: nn.Module, tiles: TilePolicy) -> LossProbe:
    """The probe of the tiled loss: the HeadTransform with which the loss of `model` equals
    the model's own (it can be routed through tiled_cross_entropy), else why not; None when it
    already is. Runs the model on random ids at a scaled LM head (probe.py); changes nothing.

    A PEFT model (PeftModel and kin, which call their base model's forward with the labels) is
    probed through the causal LM it wraps.
    """
    model = _causal_lm(model)
    if _STATE in model.__dict__:
        return None
    # the probe calls the patched forward directly: it reads the state, present for the probe
    # only; the HeadTransform it settles on is the result
    state = _LossState(model.__dict__.get("forward"), tiles)
    model.__dict__[_STATE] = state

    def use(head: HeadTransform) -> None:
        state.head = head

    own = _original(model)
    if liger_loss(own) is not None:
        # Liger's fused linear cross-entropy (patching/native.py) reads labels of some
        # logits_to_keep forms out of bounds. Set on the instance, it fuses the class's own
        # loss, which the tiled loss is probed against instead; set on the class, the probe
        # keeps it away from those forms (their calls then run Liger's forward, named in the
        # report)
        if liger_loss(type(model).forward) is None:
            own = type(model).forward.__get__(model)
        else:
            own = functools.partial(_no_kept_positions, own)
    try:
        why = probe(model, own, functools.partial(_loss_forward, model), use)
    finally:
        del model.__dict__[_STATE]
    return state.head if why is None else why


def _no_kept_positions(forward: Any, *args: Any, **kwargs: Any) -> Any:
    """Liger's loss forward, refusing the probe's logits_to_keep forms (probe_loss)."""
    keep = kwargs.get("logits_to_keep")
    if keep is not None and not (isinstance(keep, int) and keep == 0):
        raise ValueError("not probed on Liger's fused linear cross-entropy")
    return forward(*args, **kwargs)


def install_loss(
    model: nn.Module,
    tiles: TilePolicy,
    head: HeadTransform | None = None,
    fused_head: Callable[..., Any] | None = None,
) -> bool:
    """Routes the training loss of `model` through tiled_cross_entropy, with the tile policy
    `tiles` (a loss policy: a count, tokens per tile or "auto"; PatchConfig.loss_policy);
    on a loss-patched model, updates the policy and the server. Reads no values (the probe,
    probe_loss, is the caller's): it installs on a model built under fake tensors as on a real
    one.

    Args:
        model: the causal LM (or a PEFT wrapper of one).
        tiles: the loss's tile policy.
        head: what probe_loss found; None where no probe ran (the planner's fake model): the
            likeliest logit scale of the config.
        fused_head: the server of `fused_lm_head=True` calls (an integration's), or None.

    Returns:
        Whether the patch is new (False: an existing one was updated).
    """
    model = _causal_lm(model)
    state = model.__dict__.get(_STATE)
    if state is not None:
        state.tiles = tiles
        state.fused_head = fused_head
        state.active = True
        return False
    if head is None:  # not probed (the planner's fake model): the likeliest scale
        head = HeadTransform(scale_candidates(getattr(model, "config", None))[0])
    model.__dict__[_STATE] = _LossState(model.__dict__.get("forward"), tiles, head, fused_head)
    # Bound with its module (picklable, deep-copied with it), advertising the model's own
    # forward signature: the Hugging Face Trainer inspects it to decide which inputs to pass.
    model.forward = bind(_loss_forward, model, _original)  # type: ignore[method-assign]
    return True


def loss_patched(model: nn.Module) -> bool:
    """Whether `model` (or the causal LM a PEFT wrapper holds) has its loss patched."""
    state = _causal_lm(model).__dict__.get(_STATE)
    return state is not None and state.active


def loss_description(model: nn.Module) -> str | None:
    """The report's text for a loss-patched model: "tiled", with the logits_to_keep forms that
    frameworks pass (PASSED_FORMS) whose calls run the model's own loss, and why; None when not
    loss-patched. Other forms, and forms the model's own forward fails with, are in the debug
    log (probe.py) and said when a call brings one."""
    state = _causal_lm(model).__dict__.get(_STATE)
    if state is None or not state.active:
        return None
    own = {
        form: why
        for form, why in state.head.unserved.items()
        if form in PASSED_FORMS and why != OWN_FAILS
    }
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
