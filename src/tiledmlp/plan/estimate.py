"""The estimate of one stack's peak device memory for a whole model's step (estimate_step).

Two short simulations (fake_step.py) are extrapolated to the model's depth (segments.py); a
sharding engine's own memory (engines.py) is added.

Invariant: the estimate depends only on the config's shapes, the step (config/plan.py's
StepSpec) and the features applied (a PatchConfig, or None for the untiled model).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.plan import OPTIMIZERS, StepSpec
from tiledmlp.plan.apply_stack import build_model, decoder_layers_of
from tiledmlp.plan.engines import ParamCounts, check_engine, engine_memory
from tiledmlp.plan.fake_step import MARKED, simulate
from tiledmlp.plan.sim.segments import SHORT, Segments, StepEstimate, extrapolate, larger

__all__ = ["OPTIMIZERS", "estimate_step", "param_counts"]


def estimate_step(
    config: Any,
    step: StepSpec,
    patch: PatchConfig | None,
    *,
    exact: bool = False,
    whole: bool = False,
    full_card: bool = False,
) -> StepEstimate:
    """Peak device memory of one training `step` with the features of `patch` (None: the
    model untiled) on one GPU (see the module docstring).

    A model's decoder layers are alike, so what is alive at any moment of the step grows
    affinely with their number, and in the backward it changes by the same amount from one
    middle layer to the next: the peak is the larger of the peak up to the end of the
    second-to-last layer's backward and the peak from the start of the second layer's backward
    on (the middle layers lie on a line between the two). Both are measured with 5 layers
    (simulated) and 6 (built from the 5 layers' record where it shows them, plan/sim/deeper.py;
    else simulated) and extrapolated to the model's depth (every layer simulated instead where
    the model's `layer_types` past the fifth layer do not repeat its fourth, as Gemma 3's five
    sliding-window layers to one global); `exact=True` runs every layer
    instead (what the tests compare the extrapolation with); `whole=True` counts every layer
    too, the layers beyond 4 built from the 4 layers' record where it shows them and the
    model's layer types allow it (_shorts), else those beyond 5 from the 5 layers' (deeper.py:
    the same figures as `exact`, at the cost of one or two short simulations), else every
    layer simulated (a model whose layer types do not repeat as a built step's would, such
    as Gemma 3's five sliding-window layers to one global). Under a sharding engine
    (`step.engine` "zero3", "fsdp2") over `step.world` GPUs, the parameters, gradients and
    optimizer states are the engine's (plan/engines.py) instead of whole ones. With
    `step.sequence_parallel_size` P > 1, `step.seq_len` is one GPU's share and its attention
    runs on the whole sequence's shapes (plan/sim/exchange.py). `step.expandable_segments`:
    the CUDA caching allocator's setting whose reserve the estimate carries
    (plan/sim/caching_allocator.py). `full_card=True`: only what a card with no room left
    holds is replayed (`full_card_reserve`, as without it; nothing `reclaimable`): what a
    search for the longest sequence needs, at one replay of the allocator instead of two.

    Raises:
        ValueError: an engine and options it cannot combine; a model that cannot be planned
            (see layer.py: SDPA attention and dense MLPs only).
    """
    check_engine(step.engine, offload_params=step.offload_params, optimizer=step.optimizer)
    simulated = dataclasses.replace(
        step,
        # activation offloading (ours or transformers') needs checkpointing and turns it on
        checkpointing=step.checkpointing
        or step.transformers_offload
        or (patch is not None and patch.activation_offloading),
        optimizer="none" if step.sharded else step.optimizer,  # the engine's: engines.py
    )
    # repeated tiles run once; the allocator replays the loops' whole trace, rebuilt
    run = functools.partial(
        simulate, config, step=simulated, patch=patch, cut_tiles=True, full_card=full_card
    )
    depth = int(config.get_text_config().num_hidden_layers)
    if whole and not exact:
        run = functools.partial(run, build_from=_shorts(config, simulated, depth))
    # the line through 5 and 6 layers holds where the layers past the fifth repeat its fourth
    types = getattr(config.get_text_config(), "layer_types", None)
    every = simulated.every_n_layers if simulated.checkpointing else 1
    if every > 1:  # the layers alternate: a line in whole periods (Note [Every N-th layer])
        mixed = isinstance(types, list) and len(set(types[:depth])) > 1
        est = _periodic(run, depth, every, exact or whole or mixed)
    else:
        est = _simulated(run, depth, exact or whole or not _built_alike(types, SHORT, depth))
    return _with_engine(config, step, est) if step.sharded else est


def _shorts(config: Any, step: StepSpec, depth: int) -> tuple[int, ...]:
    """The short steps the whole depth is built from (simulate's `build_from`), in the order
    tried: 4 layers, then 5, each only where the step built from it (deeper.py: its
    second-to-last layer repeated, its last layer last) has the model's layer types
    (`layer_types`: deeper.py sees only the recorded layers). With none, every layer is
    simulated."""
    types = getattr(config.get_text_config(), "layer_types", None)
    return tuple(n for n in (MARKED, SHORT) if _built_alike(types, n, depth))


def _built_alike(types: Any, layers: int, depth: int) -> bool:
    """Whether a step of `depth` layers built from `layers` recorded ones (deeper.py) has the
    layer types `types` (a model's `layer_types`; None: all alike)."""
    if not isinstance(types, list) or depth <= layers:
        return True
    built = [*types[: layers - 1], *[types[layers - 2]] * (depth - layers), types[layers - 1]]
    return built == types[:depth]


def _with_engine(config: Any, step: StepSpec, est: StepEstimate) -> StepEstimate:
    """`est` with a sharding engine's own device memory added (plan/engines.py)."""
    held = engine_memory(
        step.engine,
        param_counts(config),
        world=step.world,
        elem=torch.empty((), dtype=step.dtype).element_size(),
        optimizer=step.optimizer,
        offload_params=step.offload_params,
    ).device
    breakdown = {k: est.breakdown.get(k, 0) + v for k, v in held.items()}
    return StepEstimate(
        est.peak + sum(held.values()),
        {**est.breakdown, **breakdown},
        est.checkpointing,
        est.reserve,  # the engine's own buffers are not replayed through the allocator
        est.attention,
        est.reclaimable,
    )


def _simulated(run: Any, depth: int, exact: bool) -> StepEstimate:
    """The simulated peak of the whole depth, extrapolated from 5 and 6 layers unless `exact`
    (estimate_step)."""
    if exact or depth <= SHORT + 1:
        return larger(run(depth))
    # SHORT + 1 layers built from SHORT's record where it shows them (deeper.py)
    short, longer = run(SHORT, deeper_too=True)
    if longer.middle.peak > max(longer.head.peak, longer.tail.peak):
        return larger(run(depth))  # layers unlike each other: no shortcut
    head = extrapolate(short.head, longer.head, depth)
    tail = extrapolate(short.tail, longer.tail, depth)
    est = larger(Segments(head, head, tail, _optimizer_line(short, longer, depth)))
    # the allocator's reserve does not follow a line in the depth; with expandable segments it
    # is that of one layer's backward and the loss, replayed at both depths: the larger stands
    pressed = max(e.head.reserve - e.head.reclaimable for e in (short, longer))
    # the blocks held for the offloader's copies grow with the layers offloaded: along the line
    a, b = short.head.reclaimable, longer.head.reclaimable
    reclaimable = max(a, b, a + (depth - SHORT) * (b - a))
    return dataclasses.replace(est, reserve=pressed + reclaimable, reclaimable=reclaimable)


def _periodic(run: Any, depth: int, every: int, exact: bool) -> StepEstimate:
    """The simulated peak of the whole depth where only every `every`-th layer is checkpointed
    (estimate_step), extrapolated unless `exact`.

    Note [Every N-th layer]: layers 0, N, 2N, ... are checkpointed, the others keep their
    activations: the layers repeat with period N, not 1. Two steps whose depths differ by N
    and leave the same remainder as the model's (so that their last layers are checkpointed
    as the model's are) give a line in whole periods through the head and tail segments;
    deeper.py, which repeats one layer, builds none of them (each is simulated). Where the
    middle segment peaks above both ends (a checkpointed layer only in the middle), or the
    model's layer types differ, every layer is simulated."""
    short = SHORT + (depth - SHORT) % every
    if exact or depth <= short + every:
        return larger(run(depth))
    first, second = run(short), run(short + every)
    if second.middle.peak > max(second.head.peak, second.tail.peak):
        return larger(run(depth))
    head = extrapolate(first.head, second.head, depth, short_layers=short, period=every)
    tail = extrapolate(first.tail, second.tail, depth, short_layers=short, period=every)
    optimizer = _optimizer_line(first, second, depth, short_layers=short, period=every)
    est = larger(Segments(head, head, tail, optimizer))
    pressed = max(e.head.reserve - e.head.reclaimable for e in (first, second))
    a, b = first.head.reclaimable, second.head.reclaimable
    reclaimable = max(a, b, a + (depth - short) // every * (b - a))
    return dataclasses.replace(est, reserve=pressed + reclaimable, reclaimable=reclaimable)


def _optimizer_line(
    short: Segments, longer: Segments, depth: int, **line: int
) -> StepEstimate | None:
    """The optimizer's step extrapolated on its own line (None where a step has none): its
    peak grows by a layer's parameters and states per layer, the backward's by a layer's
    activations, so a line through two steps that peak in different ones misses both."""
    if short.optimizer is None or longer.optimizer is None:
        return None
    return extrapolate(short.optimizer, longer.optimizer, depth, **line)


_COUNTS: dict[str, ParamCounts] = {}


def param_counts(config: Any) -> ParamCounts:
    """The model's parameters (tied ones once) by where they sit, counted on fake tensors once
    per config."""
    key = config.to_json_string()
    if key not in _COUNTS:
        with FakeTensorMode():
            model = build_model(
                config, torch.bfloat16, int(config.get_text_config().num_hidden_layers)
            )
            head = model.get_output_embeddings()
            embed = model.get_input_embeddings().weight
            tied = head is None or head.weight is embed
            _COUNTS[key] = ParamCounts(
                numels=tuple(p.numel() for p in model.parameters()),
                layer=max(
                    sum(p.numel() for p in layer.parameters()) for layer in decoder_layers_of(model)
                ),
                embed=embed.numel(),
                head=0 if tied else head.weight.numel(),
            )
    return _COUNTS[key]
