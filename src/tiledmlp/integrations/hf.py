"""Hugging Face transformers: one switch for any stack, and a Trainer callback.

`enable(**patch_kwargs)` makes every causal LM that transformers builds afterwards
(`from_pretrained` or `from_config`, through any Auto class, by any trainer: the HF Trainer,
TRL, axolotl) come back patched with `patch_model(model, config)`, `config` the PatchConfig
of `patch_kwargs`, parsed once when enable() is called; `disable()` undoes it.
`TiledMLPCallback(**patch_kwargs)` patches the model a Trainer was given, when the Trainer is
built (before it wraps the model for DDP, FSDP or DeepSpeed).

Why these two entry points. transformers 5.23 offers two official ways to change what it
builds: `transformers.monkey_patching.register_patch_mapping` (module classes replaced while
the model is constructed) and Hub kernels (`use_kernels=True`, layers decorated for the
`kernels` package). Both act while the model is constructed, when from_pretrained still has
its weights on the meta device and the causal LM's loss is not yet reachable, and both work by
class: the replacement class would be shared by every model built while it is registered.
patch_model works on instances, needs materialised weights (the loss probe runs the model) and
patches the loss of the causal LM as a whole. So `enable` wraps the two public constructors
every loader goes through, PreTrainedModel.from_pretrained and PreTrainedModel._from_config
(from_config's worker), and patches the finished instance they return; nested calls (a
composite model loading its parts) patch only the outermost model.

Invariant: after disable() the constructors are exactly what they were; a model that cannot
be patched still loads (the reason is logged), since a switch for any stack must not break
loading a model it does not understand.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.patching.features.tiled_loss import loss_patched
from tiledmlp.patching.state import STATE

__all__ = ["TiledMLPCallback", "disable", "enable", "enabled", "is_patched"]

logger = logging.getLogger(__name__)

_ENABLED: dict[str, Any] = {}  # "config": the PatchConfig; "check": check before patching;
# "saved": the replaced constructors
_DEPTH = threading.local()


def is_patched(model: nn.Module) -> bool:
    """Whether patch_model has run on `model` (its MLPs, norms or loss)."""
    if loss_patched(model):
        return True
    return any(STATE in m.__dict__ for m in model.modules())


def _causal_lm(model: Any) -> bool:
    getter = getattr(model, "get_output_embeddings", None)
    return isinstance(model, nn.Module) and callable(getter) and getter() is not None


def _patch_loaded(model: Any) -> None:
    from tiledmlp.patching.patch import patch_model

    config = _ENABLED.get("config")
    if config is None or not _causal_lm(model) or is_patched(model):
        return
    if _ENABLED.get("check"):  # a failing check stops the load: training never starts
        from tiledmlp.integrations.check_loaded import check_loaded

        verdict = check_loaded(model, config, "tiledmlp.enable(check=True)")
        logger.info("tiledmlp.enable: %s", verdict.text())
    try:
        patch_model(model, config)  # logs its report: once per patch in every log
    except ValueError as e:  # a model the switch does not understand still loads
        logger.warning("tiledmlp.enable: %s left unpatched: %s", type(model).__name__, e)


def _wrap(original: Any) -> Any:
    func = original.__func__

    @functools.wraps(func)
    def construct(cls: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_DEPTH, "value", 0)
        _DEPTH.value = depth + 1
        try:
            result = func(cls, *args, **kwargs)
        finally:
            _DEPTH.value = depth
        if depth == 0:
            model = result[0] if isinstance(result, tuple) else result
            _patch_loaded(model)
        return result

    return classmethod(construct)


def enable(config: PatchConfig | None = None, *, check: bool = False, **patch_kwargs: Any) -> None:
    """Patches every causal LM transformers builds from now on.

    Call it once, before the model is loaded (by you, a Trainer, TRL, axolotl...):

        import tiledmlp
        tiledmlp.enable(tiled_loss=True)
        model = AutoModelForCausalLM.from_pretrained(...)   # comes back patched

    Calling it again replaces the options. Models already built are left as they are.

    Args:
        config: a PatchConfig, instead of the keyword options.
        check: run tiledmlp.check on each model before patching it (one step unpatched and
            patched, every gradient compared; integrations/check_loaded.py); a failing check
            raises ValueError from the load, so training never starts.
        patch_kwargs: patch_model's options (num_tiles, tile_tokens, tiled_loss, ...); parsed
            now into one PatchConfig, so a typo fails here and not at load.

    Raises:
        TypeError: an option patch_model does not take (with the closest one it does).
        ValueError: a bad option value (see tiledmlp.PatchConfig).
    """
    from transformers import PreTrainedModel

    checked = PatchConfig.given(config, patch_kwargs, "tiledmlp.enable")
    _ENABLED["config"] = checked
    _ENABLED["check"] = check
    if "saved" not in _ENABLED:
        saved = {
            name: PreTrainedModel.__dict__[name] for name in ("from_pretrained", "_from_config")
        }
        _ENABLED["saved"] = saved
        for name, original in saved.items():
            setattr(PreTrainedModel, name, _wrap(original))
    if checked.tiled_loss:
        from tiledmlp.integrations.trl import ready

        ready()


def disable() -> None:
    """Undoes enable(): transformers' constructors are restored; models already patched stay
    patched (unpatch_model undoes those)."""
    saved = _ENABLED.pop("saved", None)
    _ENABLED.pop("config", None)
    if saved is None:
        return
    from transformers import PreTrainedModel

    for name, original in saved.items():
        setattr(PreTrainedModel, name, original)


def enabled() -> PatchConfig | None:
    """The PatchConfig enable() is patching with, or None."""
    config: PatchConfig | None = _ENABLED.get("config")
    return config


def _callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


class TiledMLPCallback(_callback_base()):  # type: ignore[misc]
    """Patches a Trainer's model when the Trainer is built: pass it in `callbacks`.

        trainer = Trainer(model=model, args=args, train_dataset=ds,
                          callbacks=[TiledMLPCallback(tiled_loss=True)])

    The model is patched at the end of the Trainer's construction (before the Trainer wraps
    it for DDP, FSDP or DeepSpeed, and before TRL's trainers add their fused LM head, which the
    tiled loss then serves); at the start of training a model that is not patched (replaced
    since, or built by model_init) is patched then. With `use_liger_kernel=True` it is
    patched at the start of training only, after the Trainer applied Liger's kernels (which
    bind Liger's forwards on the model's modules): the tiled MLPs then tile over Liger's, and
    each job's owner is in the report. `report` holds the latest PatchReport.

    Args:
        config: a PatchConfig, instead of the keyword options.
        patch_kwargs: patch_model's options, parsed now into `config`.
    """

    def __init__(self, config: PatchConfig | None = None, **patch_kwargs: Any) -> None:
        self.config = PatchConfig.given(config, patch_kwargs, "TiledMLPCallback")
        self.report: Any = None

    def _patch(self, model: Any) -> None:
        from tiledmlp.patching.patch import patch_model

        if model is None or is_patched(model):
            return
        self.report = patch_model(model, self.config)  # logs its report

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if getattr(args, "use_liger_kernel", False):
            # the Trainer applies Liger's kernels when training starts, binding Liger's forwards
            # over the MLPs' (and the loss's): patched now, the tiled MLPs would be replaced
            # unseen; patched then (on_train_begin), they tile over Liger's
            return
        self._patch(kwargs.get("model"))

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._patch(kwargs.get("model"))
