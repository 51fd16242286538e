"""One training step of a model cut to a few layers, on fake tensors, tracked by segment.

The model is built under FakeTensorMode (nothing is allocated), the features applied
(apply_stack.py), and one step run: forward, loss, backward, optimizer step. The tracker closes
a segment when the gradient of layer L-2's input forms and when layer 2's does (Segments).

Invariant: what is counted is every storage the step creates on the simulated device, plus the
parameters, buffers and optimizer states that exist before it; host buffers are not counted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.config.plan import StepSpec
from tiledmlp.ops.tiling.assumed import assume_device
from tiledmlp.patching.features.activation_offloading import enable_checkpointing, offloader_of
from tiledmlp.plan.apply_stack import apply_stack, build_model, decoder_layers_of, decoder_of
from tiledmlp.plan.device_overhead import CUBLAS_WORKSPACES, device_overhead
from tiledmlp.plan.forked import beside
from tiledmlp.plan.native_offload import host_offload
from tiledmlp.plan.sim.caching_allocator import HOLD, reserve_beyond_peak
from tiledmlp.plan.sim.deeper import deeper
from tiledmlp.plan.sim.exchange import register_exchanged
from tiledmlp.plan.sim.fast_fake import fake_mode
from tiledmlp.plan.sim.periodic_tiles import PeriodicTiles, replayed_reserve
from tiledmlp.plan.sim.phase_tracker import PhaseTracker
from tiledmlp.plan.sim.segments import CATEGORIES, Segments, StepEstimate
from tiledmlp.plan.sim.step_record import StepRecord, optimizer_split, segment_peaks

__all__ = ["MARKED", "FakeStep", "prepare", "simulate"]

MARKED = 4  # the fewest layers whose step is cut in three segments (Segments)


@dataclass
class FakeStep:
    """One cut model on fake tensors, ready for a step: its trainable parameters, the optimizer
    states alive before the step, and the tensors that exist before it."""

    model: Any
    params: list[nn.Parameter]
    opt: torch.optim.Optimizer | None
    states: list[torch.Tensor]


def prepare(config: Any, layers: int, patch: PatchConfig | None, step: StepSpec) -> FakeStep:
    """The model cut to `layers`, with `patch`'s features (None: untiled; its attention by head
    groups where `step.attention_kernel` is "by_heads"), checkpointed as `step` says; AdamW's
    states created as after a first step."""
    model = build_model(config, step.dtype, layers)
    if patch is not None:
        hidden = config.get_text_config().hidden_size
        if step.attention_kernel.name == "by_heads":
            patch = dataclasses.replace(patch, attention_kernel=step.attention_kernel)
        apply_stack(model, hidden, patch)
    if step.checkpointing:
        every = step.every_n_layers
        enable_checkpointing(model, every_n_layers=every, offload=step.transformers_offload)
        if offloader_of(model) is None:  # else tiledmlp's offloader sets transformers' aside
            host_offload(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = None
    if step.optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()  # creates the states, as after a first step
        opt.zero_grad(set_to_none=True)
    states = [t for s in (opt.state.values() if opt else ()) for t in s.values()]
    return FakeStep(model, params, opt, states)


def simulate(
    config: Any,
    layers: int,
    *,
    step: StepSpec,
    patch: PatchConfig | None,
    cut_tiles: bool = False,
    deeper_too: bool = False,
    build_from: tuple[int, ...] = (),
    full_card: bool = False,
) -> Any:
    """One `step` of the model cut to `layers` decoder layers with `patch`'s features (None:
    untiled), on fake tensors; the tile policy resolves as on `step.device_type`. Under a
    sharding engine (`step.sharded`) the parameters are not counted (and their gradients
    leave once accumulated): the engine's own memory is added by the caller, and so is its
    optimizer (give "none"). `step.checkpointing` is taken as it is (estimate_step turns it on
    for activation offloading).
    `cut_tiles`: the tile loops' repeated tiles run once (periodic_tiles.py): the same peaks,
    breakdowns and allocator reserve (replayed on the whole loops' trace, rebuilt).
    `step.expandable_segments`: the caching allocator's setting the reserve is replayed with
    (caching_allocator.py). `deeper_too`: also the step of `layers` + 1 layers, as a pair
    (Segments of each): built from this step's record where it shows it (deeper.py), else
    simulated. `build_from` (layer counts from MARKED up, below `layers`): simulate the first
    one's layers and build the step of `layers` from its record (deeper.py); where the record
    does not show it, the next one's; where none does, simulate the step. `full_card`: only
    the reserve of a card with no room left (the held blocks taken back: caching_allocator.py,
    HOLD) is replayed; the Segments then have nothing reclaimable.
    `step.attention_kernel`: the kernel whose backward buffers a GPU's attention calls get
    (plan/device_overhead.py, Note [Attention backward buffers])."""
    run = functools.partial(_run, config, step=step, patch=patch, cut_tiles=cut_tiles)
    held_of = functools.partial(_held_of, config, step=step)
    finish = functools.partial(
        _finish, checkpointing=step.checkpointing, cut_tiles=cut_tiles,
        expandable=step.expandable_segments, full_card=full_card,
    )  # fmt: skip
    if step.every_n_layers > 1:  # deeper.py repeats one layer: the layers alternate here
        build_from = ()
    for short in build_from if not deeper_too else ():
        built = deeper(run(short)[0], layers - short) if MARKED <= short < layers else None
        if built is not None:
            return finish(built, held_of(layers))
    record, held = run(layers)
    if not deeper_too:
        return finish(record, held)
    ahead = deeper(record) if step.every_n_layers == 1 else None
    if ahead is None:
        more, more_held = run(layers + 1)
    else:
        more, more_held = ahead, held_of(layers + 1)
    # the two allocator replays side by side where a CPU is idle (forked.py)
    return beside(lambda: finish(record, held), lambda: finish(more, more_held))


@dataclass
class _Held:
    """What exists before the step: by category ("weights", "optimizer"), and the caching
    allocator's first requests (the tensors', then on a GPU the cuBLAS workspaces)."""

    fixed: dict[str, int]
    start: list[int]


def _held(step: FakeStep, ids: torch.Tensor, sharded: bool, device_type: str) -> _Held:
    model = step.model
    kept = [*model.buffers(), ids] if sharded else [*model.parameters(), *model.buffers(), ids]
    fixed = {"weights": sum(map(nbytes, kept)), "optimizer": sum(map(nbytes, step.states))}
    # the caching allocator's view: what exists before the step, then (on a GPU) the cuBLAS
    # workspaces its first matmul takes, counted beside the tensors (device_overhead.py)
    before = [*map(nbytes, [*kept, *step.states])]
    return _Held(fixed, [*before, *_workspaces(device_type)])


def _workspaces(device_type: str) -> tuple[int, ...]:
    """The cuBLAS workspaces a GPU's first matmul takes (device_overhead.py); none elsewhere."""
    return CUBLAS_WORKSPACES if device_type == "cuda" else ()


# _held_of's model built once per process for each config and options: the sequence's length
# changes only the token ids' bytes (fixed["weights"], and their request among the first)
_HELD: dict[tuple[Any, ...], tuple[_Held, int]] = {}


def _held_of(config: Any, layers: int, *, step: StepSpec) -> _Held:
    """_held of the model cut to `layers`, built (not run) on fake tensors. The stack is not
    applied: patching changes no parameter, buffer or optimizer state (its probes are most of
    the cost of building a deep model)."""
    device_type = step.device_type
    key = (config.to_json_string(), layers, step.dtype, step.optimizer, str(step.tiles),
           device_type, step.sharded)  # fmt: skip
    if key not in _HELD:
        with fake_mode(), assume_device(device_type):
            bare = dataclasses.replace(step, checkpointing=False)
            built = prepare(config, layers, None, bare)
            one = _held(built, torch.zeros(1, 1, dtype=torch.long), step.sharded, device_type)
        # the ids' request: the last before the optimizer states' and the workspaces'
        _HELD[key] = (one, len(one.start) - len(built.states) - len(_workspaces(device_type)) - 1)
    one, at = _HELD[key]
    ids = step.seq_len * torch.empty((), dtype=torch.long).element_size()
    start = [*one.start[:at], ids, *one.start[at + 1 :]]
    return _Held({**one.fixed, "weights": one.fixed["weights"] - one.start[at] + ids}, start)


def _run(
    config: Any, layers: int, *, step: StepSpec, patch: PatchConfig | None, cut_tiles: bool
) -> tuple[StepRecord, _Held]:
    """The step run on fake tensors (simulate): its record and what existed before it."""
    device_type, sharded = step.device_type, step.sharded
    with fake_mode(), assume_device(device_type):
        built = prepare(config, layers, patch, step)
        model = built.model
        if step.sequence_parallel_size > 1:
            _refuse_window_under_sp(model, step.seq_len * step.sequence_parallel_size)
            register_exchanged(step.sequence_parallel_size, model)
        ids = torch.zeros(1, step.seq_len, dtype=torch.long)
        # on a GPU, the attention backward's own buffers at their calls (device_overhead.py)
        tracker = PhaseTracker(
            [*model.parameters(), *model.buffers(), *built.states, ids],
            device_overhead(device_type, step.attention_kernel.name).buffers,
        )
        offloader = offloader_of(model)
        if offloader is not None and device_type != "cpu":
            # the offloader's side-stream copies hold their blocks (phase_tracker.py)
            offloader.side_stream_use = tracker.defer
        grads: set[int | None] = set()
        if sharded:  # the engine takes each gradient into its partition once accumulated
            for p in built.params:
                p.register_post_accumulate_grad_hook(functools.partial(_hand_over, tracker, grads))
        decoder_layers = decoder_layers_of(model)
        # The gradient of layer i's input is formed when layer i's backward ends.
        # With 4 layers both marks close at once; fewer layers are simulated whole (no marks).
        marks = [len(decoder_layers) - 2, 2] if len(decoder_layers) >= MARKED else []
        watch = _watch_layers(decoder_layers, tracker, marks)
        periodic = PeriodicTiles(tracker)
        with tracker, periodic if cut_tiles else contextlib.nullcontext():
            _step(model, ids, built.opt, tracker)
        for h in watch.hooks:
            h.remove()
        if marks and len(tracker.segments) != 3:
            raise ValueError(
                f"{type(model).__name__}: could not follow its decoder layers' backward "
                f"(saw {len(tracker.segments) - 1} of 2 marks); this model cannot be planned yet"
            )
        grads |= {tracker.serial(p.grad) for p in built.params if p.grad is not None}
        held = _held(built, ids, sharded, device_type)
    record = _record(tracker, periodic, watch, grads, len(decoder_layers))
    record.params = _param_layers(built.params, decoder_layers)
    return record, held


def _param_layers(
    params: list[nn.Parameter], decoder_layers: nn.ModuleList
) -> list[tuple[int, int | None]]:
    """(bytes, the decoder layer holding it or None) of each trainable parameter, in order."""
    layer_of = {id(p): i for i, layer in enumerate(decoder_layers) for p in layer.parameters()}
    return [(p.numel() * p.element_size(), layer_of.get(id(p))) for p in params]


def _record(
    tracker: PhaseTracker, periodic: PeriodicTiles, watch: _Watch, grads: set[int | None],
    layers: int,
) -> StepRecord:  # fmt: skip
    """The record of the step `tracker` followed (_run), with what its hooks saw."""
    changes = {phase: (where, n) for where, n, phase in tracker.phase_changes}
    loss_at, backward_at = changes.get("loss", (0, 0)), changes.get("backward", (0, 0))
    ends = watch.backward_ends
    return StepRecord(
        # as the step left it: the model's release after it is no part of it
        trace=tracker.trace[: tracker.marks[-1]],
        phase_of=tracker.phase_of,
        bytes_of=tracker.bytes_of,
        buffers=tracker.buffers,
        marks=tracker.marks,
        flushes=[(where, n) for where, n, _ in tracker.phase_changes],
        repeats=periodic.repeats,
        grads=grads,
        checkpoint_inputs=watch.checkpoint_inputs,
        forward_starts=watch.forward_starts,
        forward_end=loss_at[0],
        backward_start=backward_at[0] + backward_at[1],
        backward_ends=[ends.get(i, -1) for i in range(layers)],
        optimizer_start=changes["optimizer"][0] if "optimizer" in changes else None,
    )


def _finish(
    record: StepRecord,
    held: _Held,
    *,
    checkpointing: bool,
    cut_tiles: bool,
    expandable: bool,
    full_card: bool = False,
) -> Segments:
    """The step's Segments from its record: each segment's peak and what was alive at it by
    category, the allocator's reserve replayed on its trace (simulate; `full_card` as there)."""
    trace = record.trace

    def replay(holds: bool) -> int:
        if cut_tiles:  # replayed on the loops' whole trace, rebuilt (periodic_tiles.py)
            return replayed_reserve(held.start, trace, record.repeats,
                                    expandable=expandable, holds=holds)  # fmt: skip
        return reserve_beyond_peak(held.start, trace, expandable=expandable, holds=holds)

    # a card with no room left takes the held blocks back (caching_allocator.py: HOLD)
    has_held = any(b == HOLD for _, b in trace)
    if full_card:  # a full card's replay: the held blocks taken back (with none, the same)
        reserve, reclaimable = replay(False), 0
    else:
        reserve = replay(True)
        reclaimable = reserve - replay(False) if has_held else 0
    segments, buffer_peaks = segment_peaks(record)
    seen = (record.grads, record.checkpoint_inputs, checkpointing)
    parts = [
        _categorise(
            record.phase_of,
            peak,
            at_peak,
            held.fixed,
            *seen,
            (reserve, reclaimable),
            with_buffers - peak,
        )
        for (peak, at_peak), with_buffers in zip(segments, buffer_peaks)
    ]
    optimizer = parts.pop() if optimizer_split(record) is not None else None
    head, middle, tail = parts if len(parts) == 3 else [parts[0]] * 3  # < MARKED layers: one
    return Segments(head, middle, tail, optimizer)


def _hand_over(tracker: PhaseTracker, grads: set[int | None], p: torch.Tensor) -> None:
    """A sharding engine's reduce-scatter: the accumulated gradient (noted as one) leaves."""
    if p.grad is not None:
        grads.add(tracker.serial(p.grad))
    p.grad = None


@dataclass
class _Watch:
    """What the hooks on the decoder layers saw: their inputs' serials, where each layer's
    forward began and where the gradient of its input formed (indices into the trace)."""

    hooks: list[Any]
    checkpoint_inputs: set[int | None]
    forward_starts: list[int]
    backward_ends: dict[int, int]


def _watch_layers(decoder_layers: nn.ModuleList, tracker: PhaseTracker, marks: list[int]) -> _Watch:
    """Hooks that note each checkpointed layer's input (by serial), where each layer's forward
    begins and its input's gradient forms, and close the tracker's segments when the gradients
    of layers `marks`' inputs form; and that pass no mask."""
    watch = _Watch([], set(), [], {})

    def formed(index: int, _g: torch.Tensor) -> None:
        watch.backward_ends.setdefault(index, len(tracker.trace))
        for _ in range(marks.count(index)):
            tracker.mark()

    def remember(m: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or tracker.phase != "forward":
            return
        watch.checkpoint_inputs.add(tracker.serial(x))
        index = next(i for i, layer in enumerate(decoder_layers) if layer is m)
        if len(watch.forward_starts) == index:
            watch.forward_starts.append(len(tracker.trace))
        if x.requires_grad:
            x.register_hook(functools.partial(formed, index))

    watch.hooks += [layer.register_forward_pre_hook(remember) for layer in decoder_layers]
    watch.hooks += [
        layer.register_forward_pre_hook(_without_mask, with_kwargs=True) for layer in decoder_layers
    ]
    return watch


def _step(
    model: Any, ids: torch.Tensor, opt: torch.optim.Optimizer | None, tracker: PhaseTracker
) -> None:
    """The training step itself, as a trainer runs it (the model called with labels: its own
    loss, or the tiled loss patched on it), each phase named on the tracker; the last segment
    closed."""
    seq_len = ids.shape[1]
    decoder = decoder_of(model)
    # A prepared 4-D mask (one stored byte) stops the model from building a (seq, seq) one
    # it cannot prove unnecessary on fake tensors; the layers then get none (_without_mask).
    causal = torch.ones((), dtype=torch.bool).expand(1, 1, seq_len, seq_len)
    # what is created once the decoder has returned its last hidden states is the loss's
    window: dict[str, torch.Tensor] = {}
    hooks = _window_masks(model, seq_len, window)
    hooks.append(decoder.register_forward_hook(lambda *_: setattr(tracker, "phase", "loss")))
    try:
        loss = model(input_ids=ids, attention_mask=causal, labels=ids).loss
    finally:
        for h in hooks:
            h.remove()
        # the model's forward has returned: its mask lives on only where the layers' saved
        # tensors or checkpoints keep it, as the real model's local does
        window.clear()
    tracker.phase = "backward"
    loss.backward()
    del loss
    if opt is not None:
        tracker.phase = "optimizer"
        opt.step()
    tracker.mark()


def _categorise(
    phase_of: list[str],
    peak: int,
    at_peak: dict[int, int],
    fixed: dict[str, int],
    grads: set[int | None],
    checkpoint_inputs: set[int | None],
    checkpointing: bool,
    reserve: tuple[int, int] = (0, 0),
    attention: int = 0,
) -> StepEstimate:
    """One segment's peak with what was alive at it sorted into CATEGORIES (module docstring);
    `fixed` holds what existed before the step ("weights", "optimizer"); `reserve`: the step's
    replayed allocator reserve and the part of it a full card takes back (StepEstimate)."""
    breakdown = dict.fromkeys(CATEGORIES, 0)
    breakdown.update(fixed)
    for serial, nbytes in at_peak.items():
        phase = phase_of[serial]
        if serial in grads:
            what = "grads"
        elif serial in checkpoint_inputs:
            what = "checkpoints"
        elif phase == "forward":
            what = "activations"
        else:
            what = {"loss": "loss", "backward": "recompute", "optimizer": "optimizer"}[phase]
        breakdown[what] += nbytes
    return StepEstimate(
        sum(fixed.values()) + peak, breakdown, checkpointing, reserve[0], attention, reserve[1]
    )


def _sliding_window(model: Any) -> tuple[int, list[bool]] | None:
    """The window of the model's sliding-window (or chunked) layers and, per decoder layer,
    whether it takes it; None where it has none. As transformers builds the masks: per layer by
    the config's `layer_types` where it has them ("sliding_attention": Gemma 2 and 3, GPT-OSS,
    ...; "chunked_attention" with `attention_chunk_size`: Llama 4), else every layer where
    `sliding_window` is set (Mistral, Mixtral, Phi-3, Starcoder2, Qwen3-MoE, ...:
    create_sliding_window_causal_mask for the whole model). Either mask is (seq, seq) once the
    sequence reaches the window."""
    cfg = model.config.get_text_config()
    types = getattr(cfg, "layer_types", None)
    size = getattr(cfg, "sliding_window", None)
    if getattr(cfg, "use_sliding_window", None) is False:
        size = None
    kind = "sliding_attention"
    if isinstance(types, list) and "chunked_attention" in types:
        size, kind = getattr(cfg, "attention_chunk_size", None), "chunked_attention"
    if not isinstance(size, int):
        return None
    layers = len(decoder_layers_of(model))
    takes = [t == kind for t in types[:layers]] if isinstance(types, list) else [True] * layers
    return (size, takes) if any(takes) else None


def _refuse_window_under_sp(model: Any, whole: int) -> None:
    """Sequence parallelism gives sliding-window layers a mask of the whole sequence built in
    its attention (sequence_parallel/masks.py), which the simulation does not model: refused
    where the window is shorter than the whole sequence of `whole` tokens."""
    window = _sliding_window(model)
    size = None if window is None else window[0]
    if size is not None and size < whole:
        raise ValueError(
            f"{type(model).__name__}: its sliding-window layers (window {size:,}) cannot be "
            f"planned under sequence parallelism yet at {whole:,} tokens; plan them with "
            "sequence parallel size 1, or a sequence no longer than the window"
        )


def _window_masks(model: Any, seq_len: int, window: dict[str, torch.Tensor]) -> list[Any]:
    """Hooks giving the sliding-window layers the mask a real step gives them. The model builds
    one (1, 1, seq, seq) boolean mask for its sliding-window layers where the sequence is not
    shorter than the window (transformers' masking utilities: causal attention alone cannot
    express it), after the embeddings and before the first layer; the layers' checkpoints or
    saved tensors keep it through the backward, the recomputed layers get it again."""
    found = _sliding_window(model)
    if found is None or seq_len < found[0]:
        return []
    layers = decoder_layers_of(model)

    def build(_m: nn.Module, _args: tuple[Any, ...]) -> None:
        window["mask"] = torch.empty((1, 1, seq_len, seq_len), dtype=torch.bool)

    def give(
        _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return args, {**kwargs, "attention_mask": window["mask"]}

    hooks = [layers[0].register_forward_pre_hook(build, prepend=True)]
    hooks += [
        layer.register_forward_pre_hook(give, with_kwargs=True)
        for layer, takes in zip(layers, found[1])
        if takes
    ]
    return hooks


def _without_mask(
    _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Under fake tensors the model cannot see that the positions form one unpadded sequence
    and builds a (seq, seq) mask; a real step passes none and SDPA runs causal (see layer.py)."""
    if "attention_mask" in kwargs:
        kwargs["attention_mask"] = None
    return args, kwargs


def nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())
