"""patch_model / unpatch_model: tiled MLP forwards on module instances.

Patching sets an instance attribute `forward` on each detected MLP (the class is untouched) and
records what it replaced; unpatching deletes or restores exactly that. Parameters, buffers and
submodules are never touched, so state_dict keys and values, save_pretrained and from_pretrained
are unaffected.

Invariant: a patched module computes what its original forward computes, with the same
gradients; calling patch_model again is idempotent (same arguments) or updates the tile policy.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.tiled import TiledMLPConfig
from tiledmlp.ops.functional import tiled_mlp
from tiledmlp.ops.policy import TilePolicy
from tiledmlp.ops.structure import recognise
from tiledmlp.ops.tiles import TileCount
from tiledmlp.ops.untiled import UntiledCall
from tiledmlp.patching.agreement import StepTokens, install_agreement
from tiledmlp.patching.bound import BoundForward, bind
from tiledmlp.patching.detect import Candidate, detect_mlps, hidden_size_of, norms_of
from tiledmlp.patching.engine_registry import backend_for, run_checks
from tiledmlp.patching.layers import (
    LAYER,
    LAYER_KIND,
    decoder_layers,
    install_layer,
    layer_parts,
    tiled_layer_forward,
)
from tiledmlp.patching.loss import loss_patched, patch_loss, unpatch_loss
from tiledmlp.patching.offloading import install_offloading, offloader_of, remove_offloading
from tiledmlp.patching.state import STATE, PatchState, original_forward
from tiledmlp.sequence_parallel.groups import SequenceParallelGroups, make_groups
from tiledmlp.sequence_parallel.install import install as install_sp
from tiledmlp.sequence_parallel.install import installed_groups as sp_installed
from tiledmlp.sequence_parallel.install import remove as remove_sp

__all__ = [
    "PatchReport",
    "original_forward",
    "patch_model",
    "patch_report",
    "tile_counts",
    "tiled_forward",
    "unpatch_model",
]

logger = logging.getLogger(__name__)

_AGREEMENT = "_tiledmlp_agreement"


@dataclass(frozen=True)
class PatchReport:
    """What patch_model did: a snapshot, taken when it ran. A model changed since (PEFT
    adapters injected into its MLPs, say, which move them to the generic path at their next
    call) is described as it is now by patch_report(model).

    Attributes:
        patched: qualified names of the modules now tiled (including ones already patched).
        paths: name -> "fast: <kind>" or "generic: <kind>".
        skipped: (name, reason) for candidates left untiled.
        config: the tile policy applied.
        loss: with tiled_loss=True, "tiled" when the training loss now runs through
            tiled_cross_entropy, else the reason it does not; None when not asked.
        offloading: with activation_offloading=True, what is offloaded; None when not asked.
        sequence_parallel: with sequence_parallel_size, what the attention now runs as (Ulysses
            over P ranks, wrapping the model's own implementation); None when not asked.
    """

    patched: list[str]
    paths: dict[str, str]
    skipped: list[tuple[str, str]] = field(default_factory=list)
    config: TiledMLPConfig = field(default_factory=TiledMLPConfig)
    loss: str | None = None
    offloading: str | None = None
    sequence_parallel: str | None = None

    def __str__(self) -> str:
        norms = sum(1 for name in self.patched if self.paths[name] == "generic: norm")
        layers = sum(1 for name in self.patched if self.paths[name] == f"generic: {LAYER_KIND}")
        mlps = len(self.patched) - norms - layers
        parts = [f"{mlps} MLP(s)"] if mlps or not (norms or layers) else []
        parts += [f"{norms} norm(s)"] if norms else []
        parts += [f"{layers} decoder layer(s)"] if layers else []
        what = " and ".join(parts)
        lines = [f"tiled {what} with {self.config}"]
        lines += [f"  {name}: {self.paths[name]}" for name in self.patched]
        lines += [f"  skipped {name}: {why}" for name, why in self.skipped]
        if self.loss is not None:
            lines.append(f"  loss: {self.loss}")
        if self.offloading is not None:
            lines.append(f"  activation offloading: {self.offloading}")
        if self.sequence_parallel is not None:
            lines.append(f"  sequence parallelism: {self.sequence_parallel}")
        return "\n".join(lines)


def patch_report(model: nn.Module) -> PatchReport | None:
    """The PatchReport of `model` as it is now (None when nothing is patched): each tiled
    module's path re-derived from its current children (PEFT adapters injected after patching
    show as the generic path they now take), the loss, offloading and sequence parallelism as
    installed now."""
    paths: dict[str, str] = {}
    config = None
    for name, module in model.named_modules():
        state = module.__dict__.get(STATE)
        if state is None:
            continue
        config = state.config
        if (
            state.path == "fast"
            and recognise(module, UntiledCall(module, original_forward(module))) is None
        ):
            paths[name] = "generic: changed since patching (e.g. adapters injected)"
        else:
            paths[name] = f"{state.path}: {state.kind}"
    loss = "tiled" if loss_patched(model) else None
    offloading = "on" if offloader_of(model) is not None else None
    groups = sp_installed(model)
    sp = None if groups is None else f"Ulysses over {groups.sp_size} ranks"
    if not paths and loss is None and offloading is None and sp is None:
        return None
    return PatchReport(sorted(paths), paths, [], config or TiledMLPConfig(), loss, offloading, sp)


def tiled_forward(self: nn.Module, x: Any, *args: Any, **kwargs: Any) -> Any:
    """The tiled forward installed on patched modules (bound to the instance with
    patching.bound.bind, so a deepcopy or an unpickled copy of a patched model runs its own
    weights)."""
    state: PatchState = self.__dict__[STATE]
    orig = original_forward(self)
    if kwargs or len(args) != state.per_token_args or not isinstance(x, torch.Tensor):
        return orig(x, *args, **kwargs)  # an unexpected call shape: leave it untiled
    run_checks(self)
    return tiled_mlp(
        self,
        x,
        *args,
        num_tiles=state.config.policy,
        forward=orig,
        backend=backend_for(self),
        plan_tokens=state.step.value,
        count=state.count,
        kernels=state.config.kernels,
    )


def _ours_on_top(module: nn.Module) -> bool:
    fwd = module.__dict__.get("forward")
    return (
        isinstance(fwd, BoundForward)
        and fwd.func in (tiled_forward, tiled_layer_forward)
        and fwd.module is module
    )


def _patch_one(
    module: nn.Module, cand: Candidate, config: TiledMLPConfig, step: StepTokens
) -> None:
    existing = module.__dict__.get(STATE)
    if existing is not None:
        existing.config = config  # idempotent; a new policy replaces the old one
        existing.step = step
        return
    state = PatchState(
        module.__dict__.get("forward"), config, cand.path, cand.kind, cand.per_token_args, step
    )
    module.__dict__[STATE] = state
    module.forward = bind(tiled_forward, module, original_forward)  # type: ignore[method-assign]


def patch_model(
    model: nn.Module,
    config: PatchConfig | None = None,
    *,
    num_tiles: int | str | TilePolicy = "auto",
    tile_tokens: int | None = None,
    generic: bool = False,
    hidden_size: int | None = None,
    tiled_loss: bool = False,
    loss_num_tiles: int | str | None = None,
    activation_offloading: bool = False,
    tiled_norms: bool = False,
    tiled_layers: bool = False,
    tiled_mlp: bool = True,
    sequence_parallel_size: int | None = None,
    sequence_parallel_group: Any = None,
    kernels: bool = True,
) -> PatchReport:
    """Makes every MLP of `model` tiled, in place (and with the options, its loss and norms).

    MLPs are found by structure (see tiledmlp.patching.detect): gated, fused gated and plain
    MLPs take the minimal-recompute fast path; LoRA-wrapped, Conv1D and dropout MLPs and MoE
    experts take the generic path (MoE routers stay untiled, so router logits keep their
    gradients).

    Args:
        model: a Hugging Face causal LM or any nn.Module containing MLPs.
        config: a PatchConfig (tiledmlp.PatchConfig), instead of the keyword arguments, which
            are its fields (the tile policy as num_tiles / tile_tokens, the loss's as
            loss_num_tiles):

            - num_tiles: a positive int, "auto", "arctic" or "target:<GB>" (see tiled_mlp), or
              a TilePolicy.
            - tile_tokens: tokens per tile, instead of num_tiles.
            - generic: also tile token-wise MLP-like modules whose structure is not
              recognised, with the generic path (otherwise they are an error).
            - hidden_size: the hidden size of the MLPs; default: model.config.hidden_size or
              the embedding dimension.
            - tiled_loss: also compute the training loss (when labels are given) with
              tiled_cross_entropy, so the logits never exist at once (see
              patching/loss.py); outputs without labels are unchanged.
            - loss_num_tiles: the loss's tiles (an int or "auto"); default: the MLPs' count,
              or "auto" for the MLP-only policies.
            - activation_offloading: also keep the inputs of the model's checkpointed layers
              in host memory between the forward and their recompute (see
              patching/offloading.py); needs the model's own non-reentrant gradient
              checkpointing, checked at each training forward (it may be enabled later).
            - tiled_norms: also tile the model's normalisation layers (LayerNorm / RMSNorm over
              the hidden size, the final norm included) with the generic path: their float32
              intermediates (several tokens x hidden x 4 bytes each, the largest part of a
              checkpointed layer's recompute once the MLP is tiled) then exist one tile at a
              time.
            - tiled_layers: also tile the rest of each decoder layer that is token-wise (the
              norm, the q/k/v projections, per-head norms and rotary embedding before the
              attention core; o_proj, the residuals, the norm and the MLP after it) with the
              generic path (see patching/layers.py): a checkpointed layer's recompute then
              holds only the layer input, q, k, v, the attention output and their gradients.
              Llama-family layers (Llama, Mistral, Qwen2, Qwen3 and alike) are recognised;
              any other decoder layer is an error.
            - tiled_mlp: False leaves the MLPs alone (e.g. `tiled_mlp=False, tiled_loss=True`:
              the tiled loss only); then an option that cannot be applied is an error.
            - sequence_parallel_size: P > 1 makes the attention sequence-parallel (Ulysses)
              over P ranks of the initialised process group (consecutive ranks form a group;
              see tiledmlp.sequence_parallel): every forward then takes this rank's shard of
              each sequence with its position_ids (tiledmlp.sequence_parallel.shard_batch),
              and the model's loss (given the shard's shift_labels) is the exact
              token-weighted loss over the whole sequences, gradients scaled for engines that
              average over the world. Call it on every rank before an engine wraps the model.
              1 or None: no change.
            - sequence_parallel_group: a process group of P ranks to use instead of the
              consecutive ones (every rank passes its own group).
            - kernels: let the fast path use the fused Triton elementwise kernels where they
              can run (CUDA; see tiled_mlp). False: PyTorch only.

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
    # the keyword arguments, by name (the keyword-only parameters, read before any local)
    config = _config(config, {k: v for k, v in locals().items() if k in _DEFAULTS})
    sp_groups = _sequence_parallel_groups(
        model, config.sequence_parallel_size, config.sequence_parallel_group
    )
    candidates, skipped = _candidates(model, config)
    layers = _layer_candidates(model) if config.tiled_layers else []
    offloading = _install_offloading(model) if config.activation_offloading else None
    if candidates or layers:
        step = _step_agreement(model)
        for cand in candidates:
            _patch_one(cand.module, cand, config.mlp_config, step)
        for name, layer, parts in layers:
            install_layer(layer, parts, config.mlp_config, step)
            candidates.append(Candidate(name, layer, "generic", LAYER_KIND))
    loss = None
    if config.tiled_loss:
        loss, sp_groups = _patch_loss(model, config, sp_groups)
    sequence_parallel = _install_sequence_parallel(model, sp_groups)
    _reset_tile_counts(model)
    paths = {c.name: f"{c.path}: {c.kind}" for c in candidates}
    report = PatchReport(
        sorted(paths), paths, skipped, config.mlp_config, loss, offloading, sequence_parallel
    )
    logger.info("%s", report)
    return report


def _install_offloading(model: nn.Module) -> str:
    """Installs activation offloading; returns what the report says."""
    install_offloading(model)
    return "checkpointed layer inputs to host memory (all but the last layer's)"


def _install_sequence_parallel(
    model: nn.Module, sp_groups: SequenceParallelGroups | None
) -> str | None:
    """Makes the attention sequence-parallel over `sp_groups` unless it already is; returns
    what the report says (None: no sequence parallelism)."""
    if sp_groups is None:
        return None
    if sp_installed(model) is None:
        done = install_sp(model, sp_groups)
        logger.debug("sequence parallelism: %s", done)
    return f"Ulysses over {sp_groups.sp_size} ranks (data-parallel size {sp_groups.dp_size})"


def _reset_tile_counts(model: nn.Module) -> None:
    """Zeroes every patched module's tile count: patch_model's probes ran the patched modules,
    and tile_counts counts the model's own calls only."""
    for module in model.modules():
        state = module.__dict__.get(STATE)
        if state is not None:
            state.count.calls = state.count.tiles = state.count.last = 0


def _config(config: PatchConfig | None, options: dict[str, Any]) -> PatchConfig:
    """patch_model's PatchConfig: the one given, or the keyword arguments'."""
    if config is None:
        return PatchConfig.from_kwargs(options)
    if not isinstance(config, PatchConfig):
        raise TypeError(
            f"patch_model: config must be a PatchConfig, got {type(config).__name__}; pass "
            "options by keyword (patch_model(model, num_tiles=4))"
        )
    given = sorted(k for k, v in options.items() if v is not _DEFAULTS[k] and v != _DEFAULTS[k])
    if given:
        raise TypeError(
            f"patch_model: give a PatchConfig or keyword arguments, not both (got "
            f"{', '.join(given)} beside config)"
        )
    return config


_DEFAULTS = {
    name: p.default
    for name, p in inspect.signature(patch_model).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
}


def _candidates(
    model: nn.Module, config: PatchConfig
) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """The MLPs (and norms) to tile and the skipped candidates."""
    if not (config.tiled_mlp or config.tiled_norms):
        return [], []
    hidden = config.hidden_size if config.hidden_size is not None else hidden_size_of(model)
    if hidden is None:
        raise ValueError(
            f"patch_model: cannot tell the hidden size of {type(model).__name__} (no "
            "config.hidden_size and no nn.Embedding); pass hidden_size=..."
        )
    candidates: list[Candidate] = []
    skipped: list[tuple[str, str]] = []
    if config.tiled_mlp:
        candidates, skipped = _mlp_candidates(model, hidden, config.generic)
    if config.tiled_norms:
        taken = {id(c.module) for c in candidates}
        candidates += [c for c in norms_of(model, hidden) if id(c.module) not in taken]
    return candidates, skipped


def _layer_candidates(model: nn.Module) -> list[tuple[str, nn.Module, Any]]:
    """The decoder layers to tile (tiled_layers=True): every one must be recognised."""
    found = decoder_layers(model)
    if not found:
        raise ValueError(
            f"patch_model: tiled_layers=True but {type(model).__name__} has no decoder layers "
            "(modules with an attention and an MLP child); drop tiled_layers"
        )
    layers = []
    for name, layer in found:
        parts = layer.__dict__.get(LAYER) or layer_parts(layer)
        if isinstance(parts, str):
            raise ValueError(
                f"patch_model: tiled_layers cannot tile {name} ({type(layer).__name__}): "
                f"{parts}; only Llama-family decoder layers are tiled, drop tiled_layers (the "
                "MLPs, norms and loss can still be tiled)"
            )
        layers.append((name, layer, parts))
    return layers


def _patch_loss(
    model: nn.Module, config: PatchConfig, sp_groups: SequenceParallelGroups | None
) -> tuple[str, SequenceParallelGroups | None]:
    """Patches the loss; returns what the report says and the sequence-parallel groups to
    (re)install."""
    # The loss probe runs the model on a few tokens without position_ids: never through the
    # sequence-parallel attention (taken off for the probe, put back by the caller).
    current = sp_installed(model)
    if current is not None:
        remove_sp(model)
        sp_groups = sp_groups or current
    why = patch_loss(model, config.loss_policy)
    if why is not None and not config.tiled_mlp:
        raise ValueError(f"patch_model: the loss of {type(model).__name__} cannot be tiled: {why}")
    return why or "tiled", sp_groups


def _sequence_parallel_groups(
    model: nn.Module, size: int | None, group: Any
) -> SequenceParallelGroups | None:
    """The groups to install (None: no sequence parallelism asked); checks before any
    collective that a model already sequence-parallel is asked for the same size (`size` was
    checked by PatchConfig)."""
    if size is None and group is None:
        return None
    current = sp_installed(model)
    if current is not None:
        if size is not None and size != current.sp_size:
            raise ValueError(
                f"patch_model: the model is already sequence-parallel over {current.sp_size} "
                f"ranks, asked for {size}; unpatch_model(model) first"
            )
        return current
    if size == 1 and group is None:
        return None
    return make_groups(size if size is not None else _group_size(group), group)


def _group_size(group: Any) -> int:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "patch_model: sequence_parallel_group given but no process group is initialised; "
            "call torch.distributed.init_process_group first (e.g. run under torchrun)"
        )
    return int(dist.get_world_size(group))


def _mlp_candidates(
    model: nn.Module, hidden: int, generic: bool
) -> tuple[list[Candidate], list[tuple[str, str]]]:
    """The MLPs to tile and the skipped candidates; raises when nothing or something not
    understood was found (see patch_model)."""
    found = detect_mlps(model, hidden)
    candidates = list(found.candidates)
    skipped = list(found.skipped)
    if found.not_understood:
        if not generic:
            names = ", ".join(f"{n or '<root>'} ({why})" for n, why in found.not_understood)
            raise ValueError(
                f"patch_model: these modules look like MLPs but their structure is not "
                f"understood: {names}. Tiling them needs the generic path (per-tile recompute "
                "of the whole module, exact for token-wise modules): pass generic=True."
            )
        modules = dict(model.named_modules())
        candidates += [
            Candidate(n, modules[n], "generic", "custom") for n, _ in found.not_understood
        ]
    if not candidates:
        why = "".join(f"; skipped {n or '<root>'}: {r}" for n, r in skipped)
        raise ValueError(
            f"patch_model: found no MLP to tile in {type(model).__name__} (hidden size "
            f"{hidden}): expected token-wise modules with gate/up/down, fused gate_up or "
            "fc1/fc2 projections, or MoE experts. Is hidden_size right, and are the weights "
            f"materialised (not on the meta device)?{why}"
        )
    return candidates, skipped


def _step_agreement(model: nn.Module) -> StepTokens:
    """The root's once-per-step token agreement (installed on the first patch_model call)."""
    existing = model.__dict__.get(_AGREEMENT)
    if existing is not None:
        return existing[0]  # type: ignore[no-any-return]
    step = StepTokens()
    model.__dict__[_AGREEMENT] = (step, install_agreement(model, step))
    return step


def tile_counts(model: nn.Module) -> dict[str, TileCount]:
    """How many tiles each patched module of `model` ran since it was patched (the MLPs, and
    the norms with tiled_norms), by qualified name (an untiled call counts 1 tile; `last` is
    the latest call's count). Calls made by patch_model's own probes are not counted."""
    return {
        name: module.__dict__[STATE].count
        for name, module in model.named_modules()
        if STATE in module.__dict__
    }


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
    covered = [
        f"cannot restore {name or '<root>'} ({type(module).__name__}): another forward was "
        "installed over the tiled one, and removing ours would remove it too. Remove that one "
        "first (or leave the model patched)"
        for name, module in model.named_modules()
        if STATE in module.__dict__ and not _ours_on_top(module)
    ]
    if covered:
        raise RuntimeError(f"unpatch_model: {covered[0]}")
    restored = []
    if remove_sp(model):
        restored.append("<sequence parallelism>")
    agreement = model.__dict__.pop(_AGREEMENT, None)
    if agreement is not None:
        agreement[1].remove()
    if unpatch_loss(model):
        restored.append("<loss>")
    if remove_offloading(model):
        restored.append("<activation offloading>")
    for name, module in model.named_modules():
        state = module.__dict__.pop(STATE, None)
        module.__dict__.pop(LAYER, None)
        if state is None:
            continue
        if state.saved is None:
            module.__dict__.pop("forward", None)
        else:
            module.forward = state.saved  # type: ignore[method-assign]
        restored.append(name)
    return restored
