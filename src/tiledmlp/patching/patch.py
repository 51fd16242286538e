"""patch_model / unpatch_model / patch_report: the features of patching/features/, in order.

Patching sets instance attributes (a `forward` on each tiled module, hooks on the root) and
records what it replaced; unpatching deletes or restores exactly that. Parameters, buffers and
submodules are never touched, so state_dict keys and values, save_pretrained and from_pretrained
are unaffected. Each feature probes the model first (all of them before any is applied, so a
refusal changes nothing), then is applied from its probe's result (probe_features,
apply_features: the planner applies the same features to a model on fake tensors with results
it declares by structure). On a GPU the segments the probes made the caching allocator take
are given back once they are done (probe_cache.py).

Invariant: a patched module computes what its original forward computes, with the same
gradients; calling patch_model again is idempotent (same arguments) or updates the tile policy.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.ops.mlp.structure import forget
from tiledmlp.patching.features import FEATURES, Found
from tiledmlp.patching.features.tiled_modules import reset_tile_counts, tile_counts, tiled_forward
from tiledmlp.patching.loss_owner import loss_owner
from tiledmlp.patching.probe_cache import probes_released
from tiledmlp.patching.report import PatchReport, ReportParts
from tiledmlp.patching.state import original_forward

__all__ = [
    "PatchReport",
    "apply_features",
    "original_forward",
    "patch_model",
    "patch_report",
    "probe_features",
    "tile_counts",
    "tiled_forward",
    "unpatch_model",
]

logger = logging.getLogger(__name__)

#: patch_model's keywords beyond PatchConfig's fields: the tile policies' spellings
#: (PatchConfig.from_kwargs turns them into `tiles` and `loss_tiles`), with their defaults
SPELLED: dict[str, Any] = {"num_tiles": "auto", "tile_tokens": None, "loss_num_tiles": None}


def patch_model(model: nn.Module, config: PatchConfig | None = None, **options: Any) -> PatchReport:
    """Makes every MLP of `model` tiled, in place (and, as asked, its norms, decoder layers and
    loss; activation offloading; sequence parallelism).

    MLPs are found by structure (see tiledmlp.patching.detect): gated, fused gated and plain
    MLPs take the minimal-recompute fast path; LoRA-wrapped, Conv1D and dropout MLPs and MoE
    experts take the generic path (MoE routers stay untiled, so router logits keep their
    gradients). Activation offloading needs the model's own non-reentrant gradient
    checkpointing, checked at each training forward (it may be turned on after this call). With
    sequence parallelism, call this on every rank before an engine wraps the model; every
    forward then takes this rank's shard of each sequence with its position_ids
    (tiledmlp.sequence_parallel.shard_batch), and the model's loss (given the shard's
    shift_labels) is the exact token-weighted loss over the whole sequences.

    Args:
        model: a Hugging Face causal LM or any nn.Module containing MLPs.
        config: what to do, as a PatchConfig (tiledmlp.PatchConfig); or instead
        **options: its fields by keyword, each documented there (e.g. `tiled_loss=True`,
            `sequence_parallel_size=2`), with the tile policies also spelled as they are in
            tiled_mlp: `num_tiles` (a positive int, "auto", "arctic", "target:<GB>" or a
            TilePolicy) or `tile_tokens` (tokens per tile) for `tiles`, and `loss_num_tiles`
            (an int or "auto") for `loss_tiles`.

    Returns:
        A PatchReport.

    Raises:
        TypeError: an unknown keyword argument, or both a config and keyword arguments.
        ValueError: no MLP was found, a module looks like an MLP but is not understood (and
            generic is False), the hidden size cannot be determined, or a bad option value;
            with sequence parallelism, sizes or heads that do not divide, no process group,
            an attention implementation other than sdpa / flash attention (before any
            collective runs).
    """
    config = _config(config, options)
    with probes_released(model) as released:  # the probes' cached segments (probe_cache.py)
        found = probe_features(model, config)
    if released:
        logger.debug(
            "released the cache patch_model's probes grew on %s", sorted(map(str, released))
        )
    report = apply_features(model, config, found)
    logger.info("%s", report)
    return report


def probe_features(model: nn.Module, config: PatchConfig, declared: Found | None = None) -> Found:
    """Each wanted feature's probe of `model`, in order (features/base.py); a feature whose
    result is `declared` (by name) is not probed. Changes nothing on the model.

    Raises:
        ValueError: what a feature refuses (see patch_model).
    """
    found = dict(declared or {})
    for feature in FEATURES:
        if feature.wanted(config) and feature.name not in found:
            found[feature.name] = feature.probe(model, config, found)
    return found


def apply_features(model: nn.Module, config: PatchConfig, found: Found) -> PatchReport:
    """Applies each wanted feature to `model` from its probe's result in `found` (from
    probe_features, or declared); reads no values of the model. Returns the report."""
    parts = ReportParts(config=config.mlp_config)
    for feature in FEATURES:
        if feature.wanted(config):
            feature.apply(model, config, found.get(feature.name), parts)
    reset_tile_counts(model)
    _own_loss(model, parts)
    return parts.report()


def _own_loss(model: nn.Module, parts: ReportParts) -> None:
    """Names the loss's owner where another library's loss forward is on the model."""
    owner = loss_owner(model)
    if owner is not None:
        parts.native.append(owner)


def patch_report(model: nn.Module) -> PatchReport | None:
    """The PatchReport of `model` as it is now (None when nothing is patched): each tiled
    module's path re-derived from its current children (PEFT adapters injected after patching
    show as the generic path they now take), the loss, offloading and sequence parallelism as
    installed now."""
    parts = ReportParts()
    for feature in FEATURES:
        feature.describe(model, parts)
    if parts.empty():
        return None
    _own_loss(model, parts)
    return parts.report()


def unpatch_model(model: nn.Module) -> list[str]:
    """Restores every patched module of `model` to its original forward (and the model's own
    loss when it was loss-patched).

    Only what patching installed is removed: a forward another library installed over a patched
    one is never taken off with it. Over the loss, such a wrapper (Accelerate's autocast
    wrapper, say) is kept and the tiled loss below it becomes a pure pass-through; over an MLP,
    unpatching refuses.

    Returns:
        Qualified names of the modules restored ("<loss>" for the loss, "<activation
        offloading>" for offloading, "<sequence parallelism>" for the attention).

    Raises:
        RuntimeError: another library installed a forward over a patched MLP; nothing is
            changed (remove that forward first).
    """
    blocked = [why for feature in FEATURES for why in feature.blocked(model)]
    if blocked:
        raise RuntimeError(f"unpatch_model: {blocked[0]}")
    restored = [name for feature in reversed(FEATURES) for name in feature.remove(model)]
    for module in model.modules():
        forget(module)  # what recognising the MLPs kept on them
    return restored


def _config(config: PatchConfig | None, options: dict[str, Any]) -> PatchConfig:
    """patch_model's PatchConfig: the one given, or the keyword arguments'."""
    if config is None:
        return PatchConfig.from_kwargs(options)
    if not isinstance(config, PatchConfig):
        raise TypeError(
            f"patch_model: config must be a PatchConfig, got {type(config).__name__}; pass "
            "options by keyword (patch_model(model, num_tiles=4))"
        )
    defaults = _defaults()
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        PatchConfig.from_kwargs({unknown[0]: options[unknown[0]]})  # raises, naming the closest
    given = sorted(k for k, v in options.items() if v is not defaults[k] and v != defaults[k])
    if given:
        raise TypeError(
            f"patch_model: give a PatchConfig or keyword arguments, not both (got "
            f"{', '.join(given)} beside config)"
        )
    return config


def _defaults() -> dict[str, Any]:
    """Every keyword patch_model takes, with its default (a keyword at its default may stand
    beside a config)."""
    defaults: dict[str, Any] = dict(SPELLED)
    for f in dataclasses.fields(PatchConfig):
        factory = f.default_factory
        defaults[f.name] = factory() if factory is not dataclasses.MISSING else f.default
    return defaults
