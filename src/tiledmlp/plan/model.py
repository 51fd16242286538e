"""Peak device memory of one full training step of a whole model, per stack, on fake tensors.

The model described by a `transformers` config is built under torch's FakeTensorMode with all
its layers (nothing is allocated; an 8B model at 128K tokens is planned on a laptop CPU) and runs
one training step on (1, seq_len) tokens: the decoder forward, the loss, the backward and, with
an optimizer, its step; storages are tracked as in fake_memory.py. Stacks:

- "untiled": the model as it is (logits upcast to float32 for the loss, like Hugging Face);
- "tiled_mlp": every decoder MLP through tiled_mlp;
- "tiled_mlp_loss": also the loss through tiled_cross_entropy (logits never exist at once);
- "tiled_mlp_loss_offload": also activation offloading (always with checkpointing, which it
  needs): the checkpointed layers' inputs live in host memory, counted apart ("host");
- "tiled_mlp_loss_offload_norms": also the normalisation layers tiled (patch_model's
  tiled_norms): their float32 intermediates exist one tile at a time;
- "tiled_layer": also the rest of each decoder layer that is token-wise (patch_model's
  tiled_layers: norm, q/k/v, rotary; o_proj, residuals, norm, MLP): a layer's recompute holds
  the layer input, q, k, v, the attention output and their gradients; the attention core runs
  by head groups (patching/attention_core.py), and the device overhead counts one group's
  attention backward buffers.

Checkpointing is the model's own non-reentrant gradient checkpointing (`--gradient-checkpointing`).
Optimizers: "none"; "adamw" (torch.optim.AdamW, foreach, states in the parameters' dtype,
created before the step as in any step after the first); "cpu-offload" (states and the update
on the host, e.g. DeepSpeed ZeRO-Offload; gradients are still counted on the device, an upper
bound). The breakdown sorts what is alive at the peak by what it is: "weights", "grads",
"optimizer" (states and update temporaries), "checkpoints" (the layers' saved inputs),
"activations" (other tensors kept from the forward), "loss" (created while computing the loss),
"recompute" (created in the backward: the recomputed layer, activation gradients, prefetched
inputs). Attention runs through SDPA as in layer.py (flash-like O(seq) memory).

Sequence parallelism (Ulysses, P ranks): each GPU holds seq_len / P tokens of every tensor
outside attention; inside, whole sequences with heads / P, i.e. the same number of elements as
the local tokens with all heads. So a GPU's step is simulated at seq_len / P tokens, its
attention on the whole sequence's shapes (plan/exchange.py: views, so that the attention core's
per-call temporaries are those of the GPU), plus the
all-to-all's transient buffers (a send copy and the received tensor of the largest of query, key
and value, key/value heads repeated up to P when there are fewer): "all_to_all" in the
breakdown.

Engines ("engine"; plan/engines.py has the model and its assumptions): "ddp" (the default)
counts weights, gradients and optimizer states whole on every GPU, as the simulation sees them.
"zero3" (DeepSpeed ZeRO-3) and "fsdp2" (fully_shard) shard them over the P GPUs: the simulation
then counts no parameter and lets each gradient go once accumulated (the engine reduce-scatters
it; one in flight shows as "grads"), and the engine's own bytes are added: "weights", "grads"
and "optimizer" become the GPU's shards, "gathered" the parameters gathered in flight (a layer
and its prefetch, the embeddings for the loss), "reduce_scatter" the gradient buffers.
"offload_params" (ZeRO-Infinity's offload_param, FSDP2's CPUOffloadPolicy) keeps the shards of
the parameters, the gradients and the optimizer on the host. The moment of the peak is found
with the engine in place, so it may differ from DDP's.

Host memory ("host_peak_mib", the same as "host_per_gpu_mib"; by part in
"host_breakdown_mib"): what a stack keeps on the host for one GPU's step: with offloading, the
inputs of every checkpointed layer but the last, pinned ("checkpoints"; ops/host_memory.py,
what the offloader moves and what patch_model checks before the first offloaded step); under
"ddp" with the "cpu-offload" optimizer, its two states per parameter in the parameters' dtype
(the figure the "adamw" optimizer counts on the device); under "zero3" or "fsdp2", what the
engine keeps there (engines.py: DeepSpeed's float32 master partitions, states and gradient
partitions; the parameters' shards with "offload_params"). "host_per_node_mib": the same for the
GPUs of one node (at most 8 of the P).

Invariant: the estimate depends only on the config's shapes, the sequence length, the dtype,
the stack and its options; no weights are read or downloaded.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tiledmlp.config.stacks import STACKS, stack_option
from tiledmlp.config.tiled import TiledMLPConfig
from tiledmlp.ops.functional import tiled_mlp
from tiledmlp.ops.host_memory import offload_bytes
from tiledmlp.ops.loss import tiled_cross_entropy
from tiledmlp.ops.offload import ActivationOffloader
from tiledmlp.ops.policy import TilePolicy, assume_device
from tiledmlp.ops.values import check_int
from tiledmlp.patching.detect import norms_of
from tiledmlp.patching.layers import install_layer, layer_parts
from tiledmlp.patching.offloading import before_forward, enable_checkpointing
from tiledmlp.plan.device_overhead import DeviceOverhead, device_overhead
from tiledmlp.plan.engines import (
    ENGINES,
    GPUS_PER_NODE,
    ParamCounts,
    check_engine,
    engine_memory,
)
from tiledmlp.plan.exchange import register_exchanged
from tiledmlp.plan.fake_memory import StorageTracker
from tiledmlp.plan.layer import cut_config, dense_mlp
from tiledmlp.sequence_parallel.attention import kv_repeat
from tiledmlp.sequence_parallel.sizes import check_sequence_divisible

logger = logging.getLogger(__name__)

__all__ = [
    "ENGINES",
    "OPTIMIZERS",
    "STACKS",
    "StepEstimate",
    "estimate_step",
    "host_breakdown",
    "max_seq_len",
    "param_counts",
    "plan_model",
]

MiB = 2**20
OPTIMIZERS = ("none", "adamw", "cpu-offload")
_SHORT = 4  # the extrapolation simulates 4 and 5 layers
CATEGORIES = ("weights", "grads", "optimizer", "checkpoints", "activations", "loss", "recompute")


@dataclass(frozen=True)
class StepEstimate:
    """One stack's peak device bytes and what was alive at the peak, by category."""

    peak: int
    breakdown: dict[str, int]
    checkpointing: bool

    def as_json(self) -> dict[str, Any]:
        return {
            "peak_mib": round(self.peak / MiB, 1),
            "breakdown_mib": {k: round(v / MiB, 1) for k, v in self.breakdown.items()},
            "gradient_checkpointing": self.checkpointing,
        }


class _PhaseTracker(StorageTracker):
    """A StorageTracker that gives each storage a serial number and the phase of the step that
    created it, and, per segment of the step (closed by `mark`), the peak of new storage and
    (serial, bytes) of what was alive then. Storage keys are reused once a storage dies, serials
    never are. Host buffers (on the meta device) are not device memory and are not counted."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__(known)
        self.phase = "forward"
        self._serial: dict[int, int] = {}  # live storage key -> serial
        self.phase_of: list[str] = []  # serial -> phase
        self.segments: list[tuple[int, dict[int, int]]] = []
        self._peak = 0
        self._at_peak: dict[int, int] = {}

    def serial(self, t: torch.Tensor) -> int | None:
        """The serial of a live tracked tensor's storage (None when not created in the step)."""
        return self._serial.get(self._key(t))

    def _alive(self) -> dict[int, int]:
        return {self._serial[k]: e[0] for k, e in self._refs.items() if e[0]}

    def mark(self) -> None:
        """Closes the current segment; the next starts from what is alive now."""
        self.segments.append((self._peak, self._at_peak))
        self._peak, self._at_peak = self.live, self._alive()

    def _track(self, t: torch.Tensor) -> None:
        if t.device.type == "meta":
            return
        key = self._key(t)
        if key not in self._refs:
            self._serial[key] = len(self.phase_of)
            self.phase_of.append(self.phase)
        super()._track(t)
        if self.live > self._peak:
            self._peak, self._at_peak = self.live, self._alive()

    def _release(self, key: int) -> None:
        super()._release(key)
        if key not in self._refs:
            self._serial.pop(key, None)


def _build(config: Any, dtype: torch.dtype, layers: int) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_config(
        cut_config(config, layers), attn_implementation="sdpa", dtype=dtype, trust_remote_code=False
    ).train()


def _tile(model: nn.Module, hidden: int, num_tiles: int | str, stack: str) -> None:
    """Every decoder MLP (and as the stack says, every norm over the hidden size and every
    decoder layer) through tiled_mlp, as patch_model does; patch_model's detection probes
    values, which fake tensors lack (a decoder layer's probe only records, see
    patching/layers.py)."""
    modules = [dense_mlp(layer, hidden) for layer in _layers(model)]
    if stack_option(stack, "tiled_norms"):
        modules += [c.module for c in norms_of(model, hidden)]
    if stack_option(stack, "tiled_layers"):
        # A tiled layer runs its MLP and norms untiled inside its own tiles (patch_model's
        # patches on them are bypassed there): only the modules outside the layers are tiled.
        inside = {id(m) for layer in _layers(model) for m in layer.modules()}
        modules = [m for m in modules if id(m) not in inside]
    for module in modules:
        original = type(module).forward.__get__(module)
        module.forward = functools.partial(tiled_mlp, module, num_tiles=num_tiles, forward=original)
    if stack_option(stack, "tiled_layers"):
        config = TiledMLPConfig(num_tiles=num_tiles)
        for i, layer in enumerate(_layers(model)):
            parts = layer_parts(layer)
            if isinstance(parts, str):
                raise ValueError(
                    f"{type(model).__name__}: decoder layer {i} cannot be tiled ({parts}); "
                    f"the {stack} stack cannot be planned for this model"
                )
            install_layer(layer, parts, config)


def _layers(model: Any) -> nn.ModuleList:
    decoder = getattr(model, model.base_model_prefix)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"{type(model).__name__}: no decoder layers at .{model.base_model_prefix}.layers; "
            "this model cannot be planned as a whole yet"
        )
    return layers


def estimate_step(
    config: Any,
    *,
    seq_len: int,
    stack: str,
    dtype: torch.dtype = torch.bfloat16,
    checkpointing: bool = False,
    optimizer: str = "none",
    num_tiles: int | str = "auto",
    exact: bool = False,
    device_type: str = "cuda",
    engine: str = "ddp",
    world: int = 1,
    offload_params: bool = False,
    sequence_parallel_size: int = 1,
) -> StepEstimate:
    """Peak device memory of one training step of `stack` on one GPU (see the module docstring).

    A model's decoder layers are alike, so what is alive at any moment of the step grows
    affinely with their number, and in the backward it changes by the same amount from one
    middle layer to the next: the peak is the larger of the peak up to the end of the
    second-to-last layer's backward and the peak from the start of the second layer's backward
    on (the middle layers lie on a line between the two). Both are measured with 4 and 5
    layers and extrapolated to the model's depth; `exact=True` runs every layer instead (what
    the tests compare the extrapolation with). Under a sharding `engine` ("zero3", "fsdp2")
    over `world` GPUs, the parameters, gradients and optimizer states are the engine's
    (plan/engines.py) instead of whole ones. With `sequence_parallel_size` P > 1, `seq_len` is
    one GPU's share and its attention runs on the whole sequence's shapes (plan/exchange.py).

    Raises:
        ValueError: an unknown stack, optimizer or engine, or options the engine cannot
            combine; a model that cannot be planned (see layer.py: SDPA attention and dense
            MLPs only).
    """
    if stack not in STACKS:
        raise ValueError(f"stack must be one of {', '.join(STACKS)}, got {stack!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    check_engine(engine, offload_params=offload_params, optimizer=optimizer)
    sharded = engine != "ddp"
    run = functools.partial(
        _simulate,
        config,
        seq_len=seq_len,
        stack=stack,
        dtype=dtype,
        checkpointing=checkpointing or stack_option(stack, "activation_offloading"),
        optimizer="none" if sharded else optimizer,  # the engine's optimizer: engines.py
        num_tiles=num_tiles,
        device_type=device_type,
        sharded=sharded,
        sequence_parallel_size=sequence_parallel_size,
    )
    est = _simulated(run, config.get_text_config().num_hidden_layers, exact)
    if not sharded:
        return est
    held = engine_memory(
        engine,
        param_counts(config),
        world=world,
        elem=torch.empty((), dtype=dtype).element_size(),
        optimizer=optimizer,
        offload_params=offload_params,
    ).device
    breakdown = {k: est.breakdown.get(k, 0) + v for k, v in held.items()}
    return StepEstimate(
        est.peak + sum(held.values()), {**est.breakdown, **breakdown}, est.checkpointing
    )


def _simulated(run: Any, depth: int, exact: bool) -> StepEstimate:
    """The simulated peak of the whole depth, extrapolated from 4 and 5 layers unless `exact`
    (estimate_step)."""
    if exact or depth <= _SHORT + 1:
        return _larger(run(depth))
    short, longer = run(_SHORT), run(_SHORT + 1)
    if longer.middle.peak > max(longer.head.peak, longer.tail.peak):
        return _larger(run(depth))  # layers unlike each other: no shortcut
    return max(
        _extrapolate(short.head, longer.head, depth),
        _extrapolate(short.tail, longer.tail, depth),
        key=lambda e: e.peak,
    )


@dataclass(frozen=True)
class _Segments:
    """Peaks of one simulated step of L layers: up to the end of layer L-2's backward ("head"),
    from there to the end of layer 2's backward ("middle"), and the rest ("tail"). The head
    and the tail each hold the end layers (which differ: the last layer's input stays on the
    device, the first layer's backward prefetches nothing) and one layer like the middle ones."""

    head: StepEstimate
    middle: StepEstimate
    tail: StepEstimate


def _larger(s: _Segments) -> StepEstimate:
    return max((s.head, s.middle, s.tail), key=lambda e: e.peak)


def _extrapolate(short: StepEstimate, longer: StepEstimate, depth: int) -> StepEstimate:
    """From _SHORT and _SHORT + 1 layers to `depth`, along the line through the two."""

    def line(a: int, b: int) -> int:
        return a + (depth - _SHORT) * (b - a)

    breakdown = {k: line(short.breakdown[k], longer.breakdown[k]) for k in CATEGORIES}
    return StepEstimate(line(short.peak, longer.peak), breakdown, short.checkpointing)


@dataclass
class _FakeStep:
    """One cut model on fake tensors, ready for a step: its trainable parameters, the optimizer
    states alive before the step, and the tensors that exist before it."""

    model: Any
    params: list[nn.Parameter]
    opt: torch.optim.Optimizer | None
    states: list[torch.Tensor]


def _prepare(config: Any, layers: int, stack: str, dtype: torch.dtype, checkpointing: bool,
             optimizer: str, num_tiles: int | str) -> _FakeStep:  # fmt: skip
    """The model cut to `layers`, tiled as `stack` says; AdamW's states created as after a
    first step."""
    model = _build(config, dtype, layers)
    if stack != "untiled":
        hidden = config.get_text_config().hidden_size
        _tile(model, hidden, num_tiles, stack)
    if checkpointing:
        enable_checkpointing(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = None
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-5, foreach=True)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()  # creates the states, as after a first step
        opt.zero_grad(set_to_none=True)
    states = [t for s in (opt.state.values() if opt else ()) for t in s.values()]
    return _FakeStep(model, params, opt, states)


def _simulate(
    config: Any,
    layers: int,
    *,
    seq_len: int,
    stack: str,
    dtype: torch.dtype,
    checkpointing: bool,
    optimizer: str,
    num_tiles: int | str,
    device_type: str = "cuda",
    sharded: bool = False,
    sequence_parallel_size: int = 1,
) -> _Segments:
    """One step of the model cut to `layers` decoder layers, on fake tensors; the tile policy
    resolves as on `device_type`. `sharded`: the parameters are not counted (and their
    gradients leave once accumulated): a sharding engine's own memory is added by the caller."""
    with FakeTensorMode(), assume_device(device_type):
        step = _prepare(config, layers, stack, dtype, checkpointing, optimizer, num_tiles)
        model = step.model
        if sequence_parallel_size > 1:
            register_exchanged(sequence_parallel_size, model)
        ids = torch.zeros(1, seq_len, dtype=torch.long)
        tracker = _PhaseTracker([*model.parameters(), *model.buffers(), *step.states, ids])
        grads: set[int | None] = set()
        if sharded:  # the engine takes each gradient into its partition once accumulated
            for p in step.params:
                p.register_post_accumulate_grad_hook(functools.partial(_hand_over, tracker, grads))
        decoder_layers = _layers(model)
        # The gradient of layer i's input is formed when layer i's backward ends.
        # With 4 layers both marks close at once; fewer layers are simulated whole (no marks).
        marks = [len(decoder_layers) - 2, 2] if len(decoder_layers) >= _SHORT else []
        checkpoint_inputs, hooks = _watch_layers(decoder_layers, tracker, marks)
        if stack_option(stack, "activation_offloading"):
            # The real mechanism (what the root's pre-hook does before each training forward),
            # with host buffers on the meta device: host memory is not counted.
            offloader = ActivationOffloader()
            offloader.pool.device = torch.device("meta")
            before_forward(offloader, list(decoder_layers), model, ())
        with tracker:
            _step(model, stack, ids, step.opt, tracker, num_tiles)
        for h in hooks:
            h.remove()
        if marks and len(tracker.segments) != 3:
            raise ValueError(
                f"{type(model).__name__}: could not follow its decoder layers' backward "
                f"(saw {len(tracker.segments) - 1} of 2 marks); this model cannot be planned yet"
            )
        grads |= {tracker.serial(p.grad) for p in step.params if p.grad is not None}
        kept = [*model.buffers(), ids] if sharded else [*model.parameters(), *model.buffers(), ids]
        fixed = {"weights": sum(map(_nbytes, kept)), "optimizer": sum(map(_nbytes, step.states))}
        parts = [
            _categorise(tracker, peak, at_peak, fixed, grads, checkpoint_inputs, checkpointing)
            for peak, at_peak in tracker.segments
        ]
        return _Segments(*parts) if len(parts) == 3 else _Segments(parts[0], parts[0], parts[0])


def _hand_over(tracker: _PhaseTracker, grads: set[int | None], p: torch.Tensor) -> None:
    """A sharding engine's reduce-scatter: the accumulated gradient (noted as one) leaves."""
    if p.grad is not None:
        grads.add(tracker.serial(p.grad))
    p.grad = None


def _watch_layers(
    decoder_layers: nn.ModuleList, tracker: _PhaseTracker, marks: list[int]
) -> tuple[set[int | None], list[Any]]:
    """Hooks that note each checkpointed layer's input (by serial) and close the tracker's
    segments when the gradients of layers `marks`' inputs form; and that pass no mask."""
    checkpoint_inputs: set[int | None] = set()

    def remember(m: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0] if args else None
        if not isinstance(x, torch.Tensor) or tracker.phase != "forward":
            return
        checkpoint_inputs.add(tracker.serial(x))
        index = next(i for i, layer in enumerate(decoder_layers) if layer is m)
        for _ in range(marks.count(index) if x.requires_grad else 0):
            x.register_hook(lambda _g: tracker.mark())

    hooks = [layer.register_forward_pre_hook(remember) for layer in decoder_layers]
    hooks += [
        layer.register_forward_pre_hook(_without_mask, with_kwargs=True) for layer in decoder_layers
    ]
    return checkpoint_inputs, hooks


def _step(
    model: Any,
    stack: str,
    ids: torch.Tensor,
    opt: torch.optim.Optimizer | None,
    tracker: _PhaseTracker,
    num_tiles: int | str,
) -> None:
    """The training step itself, each phase named on the tracker; the last segment closed."""
    text = model.config.get_text_config()
    seq_len = ids.shape[1]
    decoder = getattr(model, model.base_model_prefix)
    head = model.get_output_embeddings()
    # A prepared 4-D mask (one stored byte) stops the model from building a (seq, seq) one
    # it cannot prove unnecessary on fake tensors; the layers then get none (_without_mask).
    causal = torch.ones((), dtype=torch.bool).expand(1, 1, seq_len, seq_len)
    hidden = decoder(input_ids=ids, attention_mask=causal).last_hidden_state
    tracker.phase = "loss"
    if not stack_option(stack, "tiled_loss"):
        logits = head(hidden)
        loss = model.loss_function(logits, ids, vocab_size=text.vocab_size)
        del logits
    else:
        # the loss's policy as patch_model(tiled_loss=True) sets it
        loss = tiled_cross_entropy(
            hidden,
            head.weight,
            ids,
            bias=head.bias,
            num_tiles=TilePolicy.of(num_tiles).for_loss(),
            shift=True,
        )
    del hidden
    tracker.phase = "backward"
    loss.backward()
    del loss
    if opt is not None:
        tracker.phase = "optimizer"
        opt.step()
    tracker.mark()


def _categorise(
    tracker: _PhaseTracker,
    peak: int,
    at_peak: dict[int, int],
    fixed: dict[str, int],
    grads: set[int | None],
    checkpoint_inputs: set[int | None],
    checkpointing: bool,
) -> StepEstimate:
    """One segment's peak with what was alive at it sorted into CATEGORIES (module docstring);
    `fixed` holds what existed before the step ("weights", "optimizer")."""
    breakdown = dict.fromkeys(CATEGORIES, 0)
    breakdown.update(fixed)
    for serial, nbytes in at_peak.items():
        phase = tracker.phase_of[serial]
        if serial in grads:
            what = "grads"
        elif serial in checkpoint_inputs:
            what = "checkpoints"
        elif phase == "forward":
            what = "activations"
        else:
            what = {"loss": "loss", "backward": "recompute", "optimizer": "optimizer"}[phase]
        breakdown[what] += nbytes
    return StepEstimate(sum(fixed.values()) + peak, breakdown, checkpointing)


def _without_mask(
    _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Under fake tensors the model cannot see that the positions form one unpadded sequence
    and builds a (seq, seq) mask; a real step passes none and SDPA runs causal (see layer.py)."""
    if "attention_mask" in kwargs:
        kwargs["attention_mask"] = None
    return args, kwargs


def _nbytes(t: torch.Tensor) -> int:
    return int(t.untyped_storage().nbytes())


def max_seq_len(
    config: Any,
    budget_bytes: int,
    *,
    stack: str,
    granularity: int = 1024,
    upper: int = 1 << 24,
    hint: int | None = None,
    extra_bytes_per_token: float = 0.0,
    overhead: DeviceOverhead | None = None,
    **options: Any,
) -> int:
    """The longest sequence (a multiple of `granularity`, at most `upper`) whose step fits
    `budget_bytes` with `stack`; 0 when not even `granularity` tokens fit.

    The peak grows with the sequence, nearly affinely (exactly between tile-count changes), so
    the search extrapolates along the line through its last two estimates until it has a length
    that does not fit, then interpolates inside that bracket; every answer is verified (it fits,
    one more granule does not). `hint` (tokens) is a first guess, e.g. a length already planned.
    `extra_bytes_per_token` adds memory the simulation does not see (the all-to-all's buffers);
    `overhead` adds the device's own (plan/device_overhead.py: CUDA context, workspaces,
    attention backward buffers, allocator), so that the step fits a card of `budget_bytes`.
    """
    cache: dict[int, int] = {}

    def peak(n: int) -> int:
        if n not in cache:
            tokens = n * granularity
            step = estimate_step(config, seq_len=tokens, stack=stack, **options).peak
            step += int(extra_bytes_per_token * tokens)
            cache[n] = step + (overhead.total(step, tokens) if overhead is not None else 0)
            logger.info("  %s tokens: %.1f GiB", f"{tokens:,}", cache[n] / 2**30)
        return cache[n]

    limit = max(1, upper // granularity)
    lo = 1
    if peak(lo) > budget_bytes:
        return 0
    hi = min(limit, max(2, (hint or 0) // granularity))
    while peak(hi) <= budget_bytes:  # extend along the line until past the budget
        if hi >= limit:
            return limit * granularity
        slope = max(1.0, (peak(hi) - peak(lo)) / (hi - lo))
        step = int((budget_bytes - peak(hi)) / slope * 1.05) + 1
        lo, hi = hi, min(limit, hi + max(1, step))
    while hi - lo > 1:  # fits(lo), not fits(hi)
        guess = lo + int((budget_bytes - peak(lo)) * (hi - lo) / max(1, peak(hi) - peak(lo)))
        mid = min(max(guess, lo + 1), hi - 1)
        if peak(mid) <= budget_bytes:
            lo = mid
            if mid + 1 < hi and peak(mid + 1) > budget_bytes:
                return mid * granularity
        else:
            hi = mid
    return lo * granularity


def plan_model(
    config: Any,
    *,
    seq_len: int,
    dtype: torch.dtype = torch.bfloat16,
    checkpointing: bool = False,
    optimizer: str = "none",
    num_tiles: int | str = "auto",
    budget_bytes: int | None = None,
    stacks: tuple[str, ...] = STACKS,
    granularity: int = 1024,
    device_type: str = "cuda",
    sequence_parallel_size: int = 1,
    engine: str = "ddp",
    offload_params: bool = False,
) -> dict[str, Any]:
    """Every stack's peak MiB and breakdown at `seq_len`; with a budget, each stack's longest
    sequence that fits ("max_seq_len", a multiple of `granularity`). The tile policy resolves
    as on `device_type` (a GPU by default). With `sequence_parallel_size` P, every figure is
    per GPU for a sequence of `seq_len` tokens split over P GPUs (module docstring), and
    "max_seq_len" is the whole sequence's length (a multiple of P x granularity). `engine`
    "zero3" or "fsdp2" shards the parameters, gradients and optimizer states over the P GPUs
    (plan/engines.py; "ddp", the default, keeps them whole); `offload_params` keeps the
    parameters and gradients on the host.

    "peak_mib" is tensor-level; "device_overhead_mib" is what the process holds on the device
    beside the tensors (plan/device_overhead.py, per term in "device_overhead_breakdown_mib";
    zero on the CPU). `budget_bytes` is the card's memory: a stack fits when its peak plus its
    overhead does ("per_gpu_mib", the two together).

    Returns:
        {stack: {"peak_mib", "breakdown_mib", "gradient_checkpointing", "device_overhead_mib",
        "device_overhead_breakdown_mib", "per_gpu_mib", "host_peak_mib", "host_per_gpu_mib",
        "host_breakdown_mib", "host_per_node_mib"[, "max_seq_len"]}} (host memory of one GPU's
        step, and of one node's GPUs of this job: module docstring).

    Raises:
        ValueError: seq_len not divisible by sequence_parallel_size, heads that Ulysses
            cannot split over it, or an engine and options that cannot be combined.
    """
    p = sequence_parallel_size
    check_int("sequence_parallel_size", p)
    check_sequence_divisible(seq_len, p, seq_name="seq_len")
    check_engine(engine, offload_params=offload_params, optimizer=optimizer)
    options: dict[str, Any] = {
        "dtype": dtype,
        "checkpointing": checkpointing,
        "optimizer": optimizer,
        "num_tiles": num_tiles,
        "device_type": device_type,
        "engine": engine,
        "world": p,
        "offload_params": offload_params,
        "sequence_parallel_size": p,
    }
    out: dict[str, Any] = {}
    for i, stack in enumerate(stacks, 1):
        logger.info(
            "%s (%d of %d): one step at %s tokens", stack, i, len(stacks), f"{seq_len // p:,}"
        )
        out[stack] = _plan_stack(config, stack, seq_len, p, budget_bytes, granularity, options)
    return out


def _plan_stack(
    config: Any,
    stack: str,
    seq_len: int,
    p: int,
    budget_bytes: int | None,
    granularity: int,
    options: dict[str, Any],
) -> dict[str, Any]:
    """One stack's entry of plan_model's answer."""
    local = seq_len // p
    per_token = _all_to_all_bytes_per_token(config, p, options["dtype"])
    overhead = device_overhead(
        config,
        options["device_type"],
        itemsize=options["dtype"].itemsize,
        sequence_parallel_size=p,
        by_heads=stack_option(stack, "tiled_layers"),
    )
    est = estimate_step(config, seq_len=local, stack=stack, **options)
    if p > 1:
        extra = int(per_token * local)
        est = StepEstimate(
            est.peak + extra, {**est.breakdown, "all_to_all": extra}, est.checkpointing
        )
    entry = {**est.as_json(), **overhead.as_json(est.peak, local)}
    entry["per_gpu_mib"] = round((est.peak + overhead.total(est.peak, local)) / MiB, 1)
    keys = ("dtype", "optimizer", "engine", "world", "offload_params")
    host = host_breakdown(config, seq_len=local, stack=stack, **{k: options[k] for k in keys})
    entry["host_peak_mib"] = entry["host_per_gpu_mib"] = round(sum(host.values()) / MiB, 1)
    entry["host_breakdown_mib"] = {k: round(v / MiB, 1) for k, v in host.items()}
    entry["host_per_node_mib"] = round(min(p, GPUS_PER_NODE) * sum(host.values()) / MiB, 1)
    if budget_bytes is not None:
        logger.info(
            "%s: searching the longest sequence within %.1f GiB", stack, budget_bytes / 2**30
        )
        entry["max_seq_len"] = p * max_seq_len(
            config,
            budget_bytes,
            stack=stack,
            granularity=granularity,
            hint=local,
            extra_bytes_per_token=per_token,
            overhead=overhead,
            **options,
        )
    return entry


def host_breakdown(
    config: Any,
    *,
    seq_len: int,
    stack: str,
    dtype: torch.dtype,
    optimizer: str,
    engine: str = "ddp",
    world: int = 1,
    offload_params: bool = False,
) -> dict[str, int]:
    """Host bytes of one GPU's step at `seq_len` local tokens, by what they hold (module
    docstring, "host"): "checkpoints" (offloaded layer inputs), "params", "grads",
    "optimizer"."""
    text = config.get_text_config()
    elem = torch.empty((), dtype=dtype).element_size()
    out = {"checkpoints": 0, "params": 0, "grads": 0, "optimizer": 0}
    if stack_option(stack, "activation_offloading"):
        out["checkpoints"] = offload_bytes(
            int(text.num_hidden_layers), seq_len, int(text.hidden_size), elem
        )
    if engine != "ddp":
        counts = param_counts(config)
        held = engine_memory(
            engine, counts, world=world, elem=elem, optimizer=optimizer,
            offload_params=offload_params,
        )  # fmt: skip
        for k, v in held.host.items():
            out[k] += v
    elif optimizer == "cpu-offload":
        out["optimizer"] = 2 * param_counts(config).total * elem
    return out


_COUNTS: dict[str, ParamCounts] = {}


def param_counts(config: Any) -> ParamCounts:
    """The model's parameters (tied ones once) by where they sit, counted on fake tensors once
    per config."""
    key = config.to_json_string()
    if key not in _COUNTS:
        with FakeTensorMode():
            model = _build(config, torch.bfloat16, int(config.get_text_config().num_hidden_layers))
            head = model.get_output_embeddings()
            embed = model.get_input_embeddings().weight
            tied = head is None or head.weight is embed
            _COUNTS[key] = ParamCounts(
                numels=tuple(p.numel() for p in model.parameters()),
                layer=max(sum(p.numel() for p in layer.parameters()) for layer in _layers(model)),
                embed=embed.numel(),
                head=0 if tied else head.weight.numel(),
            )
    return _COUNTS[key]


def _all_to_all_bytes_per_token(config: Any, p: int, dtype: torch.dtype) -> float:
    """Bytes per local token of one layer's all-to-all buffers under Ulysses over p GPUs, beyond
    what the local simulation counts (0 for p = 1): the exchange of the largest of query, key
    and value (key/value heads repeated up to p when there are fewer) holds a send copy and the
    received tensor beside the local one; the received tensors then replace the local ones the
    simulation already counts."""
    if p == 1:
        return 0.0
    text = config.get_text_config()
    heads = int(text.num_attention_heads)
    kv = int(getattr(text, "num_key_value_heads", None) or heads)
    kv_sent = kv * kv_repeat(heads, kv, p)  # the check the attention wrapper makes
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2.0 * max(heads, kv_sent) * head_dim * elem
