"""TRL: the tiled LM head serves the fused-LM-head slot of TRL's trainers.

Invariant: on a loss-patched model, no call with `fused_lm_head=True` reaches TRL's chunked
head, and `fused_lm_head` never reaches the decoder.

Note: how it works, its costs and its choices are in
docs/how-it-works/module-notes.md#integrations-trl.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import logging
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.ops.loss.cross_entropy import tiled_token_stats
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.patching.detect import text_config
from tiledmlp.patching.features.tiled_loss import (
    TILED_LOSS,
    decoder_of,
    lifted,
    loss_patched,
    replaced_forward,
    softcap_of,
)

__all__ = ["TESTED", "install", "policy_config", "ready", "reference_config"]

logger = logging.getLogger(__name__)

#: TRL versions the fused-head slot is tested with: [low, high)
TESTED = ("1.16.0", "1.17.0")
_STATS = ("log_sum_sq_probs", "mean_logits", "is_top1")
_ALL_OUTPUTS = ("log_probs", "entropy", *_STATS)
_ORIGINAL: list[Any] = []  # TRL's own add_fused_lm_head, once wrapped


@dataclass(frozen=True)
class HeadSettings:
    """What TRL asked of a model's fused head."""

    temperature: float = 1.0
    outputs: tuple[str, ...] = _ALL_OUTPUTS
    cast_lm_head_to_fp32: bool = False
    logit_scale: float = 1.0


def _trl_version() -> str | None:
    try:
        import trl
    except ImportError:
        return None
    return str(trl.__version__)


def untested_reason() -> str | None:
    """Why the installed TRL cannot be served (outside TESTED), or None."""
    from packaging.version import Version

    version = _trl_version()
    if version is None:
        return None
    low, high = TESTED
    if Version(low) <= Version(version) < Version(high):
        return None
    return (
        f"TRL {version} is outside the range the tiled loss is tested with (>={low},<{high}): "
        "its fused LM head may call or read the model differently, and serving it blindly could "
        f"train on wrong numbers. Install trl>={low},<{high}, or patch without tiled_loss=True "
        "(TRL's own fused head then computes the loss)"
    )


def _refuse_untested() -> None:
    why = untested_reason()
    if why is not None:
        raise RuntimeError(f"tiled loss: {why}")


def _trl_forward_code() -> list[types.CodeType]:
    """The code objects of the forwards TRL's add_fused_lm_head installs."""
    if not _ORIGINAL:
        return []
    return [c for c in _ORIGINAL[0].__code__.co_consts if isinstance(c, types.CodeType)]


def settings_of(model: nn.Module) -> HeadSettings | None:
    """TRL's settings for the fused head of `model` (read from the forward TRL installed below
    the tiled loss), or None when TRL's head is not there."""
    below = replaced_forward(model)
    func: Any = getattr(below, "__func__", None)
    code = getattr(func, "__code__", None)
    if func is None or code is None or code not in _trl_forward_code():
        return None
    cells = dict(zip(code.co_freevars, (c.cell_contents for c in func.__closure__ or ())))
    missing = [n for n in ("temperature", "outputs", "cast_lm_head_to_fp32") if n not in cells]
    if missing:
        raise RuntimeError(
            f"tiled loss: TRL's fused-head forward no longer holds {missing}; this TRL version "
            "is not supported (see tiledmlp.integrations.trl.TESTED)"
        )
    return HeadSettings(
        temperature=float(cells["temperature"]),
        outputs=tuple(cells["outputs"]),
        cast_lm_head_to_fp32=bool(cells["cast_lm_head_to_fp32"]),
        logit_scale=float(cells.get("logit_scale", 1.0)),
    )


def _serve(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], tiles: TilePolicy
) -> Any:
    """model(*args, **kwargs, fused_lm_head=True) on a loss-patched model: TRL's
    FusedCausalLMOutput from the tiled LM head."""
    _refuse_untested()
    from trl.trainer.utils import FusedCausalLMOutput

    settings = settings_of(model) or HeadSettings()
    labels = kwargs.pop("labels", None)
    shifted = kwargs.pop("shift_labels", None)
    num_items = kwargs.pop("num_items_in_batch", None)
    for unused in ("return_dict", "logits_to_keep"):
        kwargs.pop(unused, None)
    if labels is None and shifted is None:
        raise ValueError(
            f"{type(model).__name__}(..., fused_lm_head=True) needs labels (or shift_labels)"
        )
    config: Any = getattr(model, "config", None)
    text = text_config(config)
    if kwargs.get("output_router_logits") or getattr(text, "output_router_logits", False):
        raise NotImplementedError(
            "tiled loss: the fused LM head with MoE router logits (an auxiliary loss) is not "
            "served; set output_router_logits=False or patch without tiled_loss=True"
        )
    kwargs["use_cache"] = False
    hidden = decoder_of(model)(*args, **kwargs)[0]
    head: Any = model.get_output_embeddings()  # type: ignore[operator]
    weight, bias = head.weight, getattr(head, "bias", None)
    tokens = labels if shifted is None else shifted
    tokens = tokens.to(weight.device)
    hidden = hidden.to(weight.device)
    if settings.cast_lm_head_to_fp32:
        hidden, weight = hidden.float(), weight.float()
        bias = None if bias is None else bias.float()
    # cast_lm_head_to_fp32: the head in float32, outside any autocast region (TRL's meaning)
    no_autocast = torch.autocast(hidden.device.type, enabled=False)
    with no_autocast if settings.cast_lm_head_to_fp32 else contextlib.nullcontext():
        out = tiled_token_stats(
            hidden,
            weight,
            tokens,
            bias=bias,
            temperature=settings.temperature,
            softcap=softcap_of(config),
            logit_scale=settings.logit_scale,
            entropy="entropy" in settings.outputs,
            stats=tuple(s for s in _STATS if s in settings.outputs),
            shift=shifted is None,
            num_tiles=tiles,
        )
    # TRL's layout: (batch, seq - 1) scored positions without shift_labels, (batch, seq) with
    fields = out._asdict()
    if shifted is None:
        label_mask = tokens[..., 1:] != -100
        fields = {name: None if t is None else t[..., :-1] for name, t in fields.items()}
    else:
        label_mask = tokens != -100
    denominator = label_mask.sum().clamp(min=1) if num_items is None else num_items
    return FusedCausalLMOutput(
        loss=-fields["log_probs"].sum() / denominator,
        label_mask=label_mask,
        aux_loss=None,
        **fields,
    )


def _add_fused_lm_head(model: Any, *args: Any, **kwargs: Any) -> None:
    """TRL's add_fused_lm_head, with TRL's head put below the tiled loss of a loss-patched
    model (where the tiled loss then serves it)."""
    original = _ORIGINAL[0]
    if not isinstance(model, nn.Module) or not loss_patched(model):
        return original(model, *args, **kwargs)  # type: ignore[no-any-return]
    _refuse_untested()
    getter = getattr(model, "get_base_model", None)
    if callable(getter) and getter() is not model:
        raise RuntimeError(
            "tiled loss: TRL's fused LM head was asked on a PEFT wrapper; TRL adds it to the "
            "wrapped causal LM (get_base_model()). Add it there"
        )
    with lifted(model):
        original(model, *args, **kwargs)
    logger.info("tiled loss serves TRL's fused LM head of %s", type(model).__name__)
    return None


def ready() -> bool:
    """Wraps TRL's add_fused_lm_head where it is used (idempotent); False when TRL is not
    installed or has no fused LM head (nothing to serve)."""
    if _ORIGINAL:
        _rewire(_ORIGINAL[0])
        return True
    if importlib.util.find_spec("trl") is None:
        return False
    try:
        utils = importlib.import_module("trl.trainer.utils")
    except Exception as e:  # a TRL that cannot import cannot build a trainer either
        logger.debug("TRL is installed but does not import (%s): no fused LM head to serve", e)
        return False
    original = getattr(utils, "add_fused_lm_head", None)
    if original is None:
        return False
    _ORIGINAL.append(original)
    _rewire(original)
    return True


def _rewire(original: Any) -> None:
    """Points every loaded module's `add_fused_lm_head` (TRL's trainers import it by name)
    at the wrapper; trl.trainer.utils itself too, for trainers imported later."""
    wrapper = _wrapper()
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get("add_fused_lm_head") is original:
            namespace["add_fused_lm_head"] = wrapper


@functools.cache
def _wrapper() -> Any:
    wrapper = functools.wraps(_ORIGINAL[0])(_add_fused_lm_head)
    return wrapper


def _on_loss_patch(model: nn.Module) -> None:
    ready()


def install(trainer: Any, config: PatchConfig | None = None, **patch_kwargs: Any) -> Any:
    """Makes a built TRL trainer compute its loss (and its reference model's log-probabilities)
    with the tiled LM head, and its MLPs tiled: patch_model(trainer.model, config) with the
    tiled loss on, and trainer.ref_model's loss tiled when there is one, with the policy
    model's tile policies (reference_config).

    Args:
        trainer: a TRL trainer (SFTTrainer, DPOTrainer, GRPOTrainer, KTOTrainer, RLOOTrainer).
        config: a PatchConfig, instead of the keyword options.
        patch_kwargs: patch_model's options (num_tiles, tile_tokens, loss_num_tiles, ...).

    Returns:
        The policy model's PatchReport.

    Raises:
        RuntimeError: the installed TRL is outside TESTED.
        TypeError, ValueError: bad options (see tiledmlp.PatchConfig).
    """
    from tiledmlp.patching.patch import patch_model

    if config is None:
        patch_kwargs = {"tiled_loss": True, **patch_kwargs}
    given = PatchConfig.given(config, patch_kwargs, "tiledmlp.integrations.trl.install")
    policy = policy_config(given)
    _refuse_untested()
    ready()
    report = patch_model(trainer.model, policy)
    if not (report.loss or "").startswith("tiled"):
        logger.warning("tiled loss not installed on the trainer's model: %s", report.loss)
    ref = getattr(trainer, "ref_model", None)
    if isinstance(ref, nn.Module) and ref is not trainer.model and not loss_patched(ref):
        patch_model(ref, reference_config(policy))
    return report


def policy_config(config: PatchConfig) -> PatchConfig:
    """The policy model's config: `config` with the tiled loss on."""
    return config if config.tiled_loss else dataclasses.replace(config, tiled_loss=True)


def reference_config(config: PatchConfig) -> PatchConfig:
    """The reference model's config, derived from the policy model's: only the loss tiled
    (the reference model runs without gradients, so its MLPs gain nothing from tiling), with
    the same tile policies (the loss's own, tile_tokens included) and kernels."""
    return PatchConfig(
        tiles=config.tiles,
        tiled_mlp=False,
        tiled_loss=True,
        loss_tiles=config.loss_policy,
        kernels=config.kernels,
    )


TILED_LOSS.register_fused_head(_serve)
TILED_LOSS.register_on_patch(_on_loss_patch)
