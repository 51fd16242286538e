"""Routing a Hugging Face causal LM's training loss through tiled_cross_entropy.

The model's own forward stays in charge when no labels are given. With labels, the base model
runs as usual and the loss is computed from its last hidden states by tiled_cross_entropy with
the LM head's weight (and bias), the model's final-logit soft-capping, causal shifting (or the
caller's shift_labels) and num_items_in_batch handled like Hugging Face's loss; the logits are
never materialised (the output's `logits` is None).

A call with `fused_lm_head=True` (the slot through which TRL's trainers ask a model for
per-token log-probabilities instead of logits) is served by the fused-head server an integration
registered (tiledmlp.integrations.trl); `fused_lm_head` never reaches the decoder.

Invariant: a model is only patched after a probe shows that, on random ids, the patched loss
equals the model's own loss; a model whose forward adds anything else to the loss (an MoE
auxiliary loss, logit scaling) fails the probe and is left alone, with the reason reported.
Unpatching restores the forward this patch replaced; when another forward was installed over it
since, that one is kept and ours stays below it as a pure pass-through.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiledmlp.ops.loss.cross_entropy import tiled_cross_entropy
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.ops.tiling.probe import stand_ins
from tiledmlp.patching.bound import BoundForward, bind
from tiledmlp.patching.detect import probing, text_config

__all__ = [
    "decoder_of",
    "install_loss",
    "lifted",
    "loss_refusal",
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
    if labels is None or params.get("logits_to_keep") not in (None, 0):
        # No loss to tile, or a loss over the last logits_to_keep positions only (the model's
        # own forward scores just those): the model's own forward.
        return orig(*args, **kwargs)
    shifted = params.pop("shift_labels", None)
    num_items = params.pop("num_items_in_batch", None)
    params.pop("logits_to_keep", None)
    return_dict = params.pop("return_dict", None)
    outputs = decoder_of(self)(**params)
    hidden = outputs[0]
    head = self.get_output_embeddings()  # type: ignore[operator]
    config = getattr(self, "config", None)
    # Evaluation (eval mode, no gradient): the argmax of every position's logits comes out of
    # the same tiles, as `predictions` (what compute_metrics gets instead of logits).
    evaluating = not self.training and not torch.is_grad_enabled()
    loss = tiled_cross_entropy(
        hidden,
        head.weight,
        shifted if shifted is not None else labels,
        bias=getattr(head, "bias", None),
        num_tiles=state.num_tiles,
        shift=shifted is None,
        softcap=softcap_of(config),
        reduction="mean" if num_items is None else "sum",
        return_aux=evaluating,
    )
    predictions = None
    if evaluating:
        loss, predictions = loss.loss, loss.predictions
    if num_items is not None:
        loss = loss / num_items
    return _output(outputs, loss, predictions, _wants_dict(config, return_dict))


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


def softcap_of(config: Any) -> float | None:
    """The final-logit soft-capping the model applies: its config's, else its text config's
    (multimodal models such as PaliGemma with a Gemma 2 decoder, or Gemma3n, read it there)."""
    for cfg in (config, text_config(config) if config is not None else None):
        value = getattr(cfg, "final_logit_softcapping", None) if cfg is not None else None
        if value:
            return float(value)
    return None


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


def _probe(model: nn.Module) -> str | None:
    """None when the patched loss equals the model's own loss on every probe input, else why
    not.

    The probe inputs exercise what a model's loss may read beyond the LM head's cross-entropy:
    ignored labels (-100), an attention mask with zeros (some models drop masked positions from
    their loss), num_items_in_batch (when the forward takes it), and logits large enough that
    final-logit soft-capping matters (the LM head's weight scaled up for the probe: at random
    init the logits are too small for a cap to show).
    """
    lm: Any = model  # a Hugging Face PreTrainedModel, duck-typed
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is None or getattr(head, "weight", None) is None:
        return "no LM head (get_output_embeddings): not a causal LM"
    if head.weight.device.type == "meta":
        return "weights on the meta device"
    device = head.weight.device
    vocab = head.weight.shape[0]
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, vocab, (2, 7), generator=gen, device=device)
    labels = ids.clone()
    labels[0, :2] = -100
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    cases: list[tuple[str, dict[str, Any]]] = [
        ("labels with ignored positions", {"input_ids": ids, "labels": labels}),
        (
            "an attention mask with zeros",
            {"input_ids": ids, "labels": labels, "attention_mask": mask},
        ),
    ]
    if _accepts(_original(model), "num_items_in_batch"):
        cases.append(
            ("num_items_in_batch", {"input_ids": ids, "labels": labels, "num_items_in_batch": 7})
        )
    # The patched loss runs the same GEMMs on the same rows; low precision leaves room for a
    # different kernel choice, far below what a dropped position or a missing cap changes.
    rtol = 1e-4 if head.weight.dtype in (torch.float32, torch.float64) else 1e-2
    try:
        # In training mode, as the tiled loss is used (an MoE auxiliary loss shows; layers with
        # an inference-only path, such as bitsandbytes' 4-bit layers on the CPU, which repack
        # their weights in place, stay on their training path), each forward from the same
        # random state so that dropout draws the same masks; buffers are clones, so a
        # training-mode forward that updates them changes nothing.
        with probing(model, training=True), stand_ins(model, random_params=False):
            for large in (False, True):
                with _large_logits(model, head, ids) if large else contextlib.nullcontext():
                    for what, inputs in cases:
                        torch.manual_seed(0)
                        own = _original(model)(**inputs).loss
                        torch.manual_seed(0)
                        ours = _loss_forward(model, **inputs).loss
                        if own is None or not torch.allclose(
                            ours.float(), own.float(), rtol=rtol, atol=rtol * 0.1
                        ):
                            where = what + (" and large logits" if large else "")
                            return (
                                f"with {where} the model's own loss "
                                f"({float(own) if own is not None else None}) differs from the "
                                f"LM-head cross-entropy ({float(ours)}): its loss reads or "
                                "adds something the tiled loss does not reproduce (e.g. an MoE "
                                "auxiliary loss, logit scaling, positions dropped by the "
                                "attention mask, a soft-cap it reads elsewhere)"
                            )
    except Exception as e:  # a forward that the generic reimplementation cannot drive
        return f"the probe failed ({type(e).__name__}: {e})"
    return None


def _accepts(fn: Any, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@contextlib.contextmanager
def _large_logits(model: nn.Module, head: nn.Module, ids: torch.Tensor) -> Iterator[None]:
    """The LM head's weight scaled (for the block only, the head alone: a tied embedding keeps
    its own) so that the model's largest probe logit is about 100."""
    weight = head._parameters.get("weight")
    if weight is None:  # not a registered parameter (parametrized, quantised): probe as is
        yield
        return
    torch.manual_seed(0)
    logits = _original(model)(input_ids=ids).logits
    peak = float(logits.float().abs().max()) if logits is not None else 0.0
    scale = 100.0 / peak if peak > 0 else 1.0
    head._parameters["weight"] = nn.Parameter(weight.detach() * scale, weight.requires_grad)
    try:
        yield
    finally:
        head._parameters["weight"] = weight


def loss_refusal(model: nn.Module, num_tiles: TilePolicy) -> str | None:
    """The probe of the tiled loss: None when the loss of `model` can be routed through
    tiled_cross_entropy (or already is), else why not. Runs the model on random ids at a
    scaled LM head (see _probe); changes nothing.

    A PEFT model (PeftModel and kin, which call their base model's forward with the labels) is
    probed through the causal LM it wraps.
    """
    model = _causal_lm(model)
    if _STATE in model.__dict__:
        return None
    # _probe calls the patched forward directly: it reads the state, present for the probe only
    model.__dict__[_STATE] = _LossState(model.__dict__.get("forward"), num_tiles)
    try:
        return _probe(model)
    finally:
        del model.__dict__[_STATE]


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
    model.__dict__[_STATE] = _LossState(model.__dict__.get("forward"), num_tiles)
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
