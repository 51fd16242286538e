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
  tiled_norms): their float32 intermediates exist one tile at a time.

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
the local tokens with all heads. So a GPU's step is simulated at seq_len / P tokens, plus the
all-to-all's transient buffers (a send copy and the received tensor of the largest of query, key
and value, key/value heads repeated up to P when there are fewer): "all_to_all" in the
breakdown. Weights, gradients and optimizer states are counted whole on every GPU (replicated,
as under DDP); ZeRO-3 or FSDP sharding would lower them further.

Host memory ("host_peak_mib"): what a stack keeps on the host for one GPU's step: with
offloading, the inputs of every checkpointed layer but the last, pinned (ops/host_memory.py,
what the offloader moves and what patch_model checks before the first offloaded step); with the
"cpu-offload" optimizer, its two states per parameter in the parameters' dtype (the figure the
"adamw" optimizer counts on the device; DeepSpeed's CPU Adam also keeps float32 master weights).

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

from tiledmlp.config.stacks import STACKS
from tiledmlp.ops.functional import tiled_mlp
from tiledmlp.ops.host_memory import offload_bytes
from tiledmlp.ops.loss import tiled_cross_entropy
from tiledmlp.ops.offload import ActivationOffloader
from tiledmlp.ops.policy import TilePolicy, assume_device
from tiledmlp.ops.values import check_int
from tiledmlp.patching.detect import norms_of
from tiledmlp.patching.offloading import before_forward, enable_checkpointing
from tiledmlp.plan.device_overhead import DeviceOverhead, device_overhead
from tiledmlp.plan.fake_memory import StorageTracker
from tiledmlp.plan.layer import cut_config, dense_mlp
from tiledmlp.sequence_parallel.attention import kv_repeat

logger = logging.getLogger(__name__)

__all__ = ["OPTIMIZERS", "STACKS", "StepEstimate", "estimate_step", "max_seq_len", "plan_model"]

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


def _tile(model: nn.Module, hidden: int, num_tiles: int | str, norms: bool) -> None:
    """Every decoder MLP (and with `norms` every norm over the hidden size) through tiled_mlp,
    as patch_model does; patch_model's detection probes values, which fake tensors lack."""
    modules = [dense_mlp(layer, hidden) for layer in _layers(model)]
    if norms:
        modules += [c.module for c in norms_of(model, hidden)]
    for module in modules:
        original = type(module).forward.__get__(module)
        module.forward = functools.partial(tiled_mlp, module, num_tiles=num_tiles, forward=original)


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
) -> StepEstimate:
    """Peak device memory of one training step of `stack` (see the module docstring).

    A model's decoder layers are alike, so what is alive at any moment of the step grows
    affinely with their number, and in the backward it changes by the same amount from one
    middle layer to the next: the peak is the larger of the peak up to the end of the
    second-to-last layer's backward and the peak from the start of the second layer's backward
    on (the middle layers lie on a line between the two). Both are measured with 4 and 5
    layers and extrapolated to the model's depth; `exact=True` runs every layer instead (what
    the tests compare the extrapolation with).

    Raises:
        ValueError: an unknown stack or optimizer; a model that cannot be planned (see
            layer.py: SDPA attention and dense MLPs only).
    """
    if stack not in STACKS:
        raise ValueError(f"stack must be one of {', '.join(STACKS)}, got {stack!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {optimizer!r}")
    checkpointing = checkpointing or "offload" in stack
    run = functools.partial(
        _simulate,
        config,
        seq_len=seq_len,
        stack=stack,
        dtype=dtype,
        checkpointing=checkpointing,
        optimizer=optimizer,
        num_tiles=num_tiles,
        device_type=device_type,
    )
    depth = config.get_text_config().num_hidden_layers
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
) -> _Segments:
    """One step of the model cut to `layers` decoder layers, on fake tensors; the tile policy
    resolves as on `device_type`."""
    text = config.get_text_config()
    with FakeTensorMode(), assume_device(device_type):
        model = _build(config, dtype, layers)
        if stack != "untiled":
            _tile(model, text.hidden_size, num_tiles, norms=stack.endswith("_norms"))
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
        ids = torch.zeros(1, seq_len, dtype=torch.long)
        # A prepared 4-D mask (one stored byte) stops the model from building a (seq, seq) one
        # it cannot prove unnecessary on fake tensors; the layers then get none (_without_mask).
        causal = torch.ones((), dtype=torch.bool).expand(1, 1, seq_len, seq_len)
        alive = [*model.parameters(), *model.buffers(), *states, ids]
        tracker = _PhaseTracker(alive)
        checkpoint_inputs: set[int | None] = set()
        decoder_layers = _layers(model)
        # The gradient of layer i's input is formed when layer i's backward ends.
        # With 4 layers both marks close at once; fewer layers are simulated whole (no marks).
        marks = [len(decoder_layers) - 2, 2] if len(decoder_layers) >= _SHORT else []

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
            layer.register_forward_pre_hook(_without_mask, with_kwargs=True)
            for layer in decoder_layers
        ]
        decoder = getattr(model, model.base_model_prefix)
        head = model.get_output_embeddings()
        if "offload" in stack:
            # The real mechanism (what the root's pre-hook does before each training forward),
            # with host buffers on the meta device: host memory is not counted.
            offloader = ActivationOffloader()
            offloader.pool.device = torch.device("meta")
            before_forward(offloader, list(decoder_layers), model, ())
        with tracker:
            hidden = decoder(input_ids=ids, attention_mask=causal).last_hidden_state
            tracker.phase = "loss"
            if stack in ("untiled", "tiled_mlp"):
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
        for h in hooks:
            h.remove()
        if marks and len(tracker.segments) != 3:
            raise ValueError(
                f"{type(model).__name__}: could not follow its decoder layers' backward "
                f"(saw {len(tracker.segments) - 1} of 2 marks); this model cannot be planned yet"
            )
        grads = {tracker.serial(p.grad) for p in params if p.grad is not None}
        weights = sum(_nbytes(t) for t in (*model.parameters(), *model.buffers(), ids))
        state_bytes = sum(_nbytes(t) for t in states)

        def estimate(peak: int, at_peak: dict[int, int]) -> StepEstimate:
            breakdown = dict.fromkeys(CATEGORIES, 0)
            breakdown["weights"] = weights
            breakdown["optimizer"] = state_bytes
            for serial, nbytes in at_peak.items():
                phase = tracker.phase_of[serial]
                if serial in grads:
                    what = "grads"
                elif serial in checkpoint_inputs:
                    what = "checkpoints"
                elif phase == "forward":
                    what = "activations"
                else:
                    what = {"loss": "loss", "backward": "recompute", "optimizer": "optimizer"}[
                        phase
                    ]
                breakdown[what] += nbytes
            return StepEstimate(weights + state_bytes + peak, breakdown, checkpointing)

        parts = [estimate(peak, at) for peak, at in tracker.segments]
        return _Segments(*parts) if len(parts) == 3 else _Segments(parts[0], parts[0], parts[0])


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
) -> dict[str, Any]:
    """Every stack's peak MiB and breakdown at `seq_len`; with a budget, each stack's longest
    sequence that fits ("max_seq_len", a multiple of `granularity`). The tile policy resolves
    as on `device_type` (a GPU by default). With `sequence_parallel_size` P, every figure is
    per GPU for a sequence of `seq_len` tokens split over P GPUs (module docstring), and
    "max_seq_len" is the whole sequence's length (a multiple of P x granularity).

    "peak_mib" is tensor-level; "device_overhead_mib" is what the process holds on the device
    beside the tensors (plan/device_overhead.py, per term in "device_overhead_breakdown_mib";
    zero on the CPU). `budget_bytes` is the card's memory: a stack fits when its peak plus its
    overhead does.

    Returns:
        {stack: {"peak_mib", "breakdown_mib", "gradient_checkpointing", "device_overhead_mib",
        "device_overhead_breakdown_mib", "host_peak_mib"[, "max_seq_len"]}} ("host_peak_mib":
        host memory of one GPU's step, module docstring).

    Raises:
        ValueError: seq_len not divisible by sequence_parallel_size, or heads that Ulysses
            cannot split over it.
    """
    p = sequence_parallel_size
    check_int("sequence_parallel_size", p)
    if seq_len % p:
        raise ValueError(
            f"seq_len {seq_len} must be divisible by the sequence-parallel size {p} (each GPU "
            f"holds seq_len / {p} tokens)"
        )
    per_token = _all_to_all_bytes_per_token(config, p, dtype)
    options: dict[str, Any] = {
        "dtype": dtype,
        "checkpointing": checkpointing,
        "optimizer": optimizer,
        "num_tiles": num_tiles,
        "device_type": device_type,
    }
    out: dict[str, Any] = {}
    local = seq_len // p
    overhead = device_overhead(config, device_type)
    num_params = count_params(config, dtype) if optimizer == "cpu-offload" else None
    for i, stack in enumerate(stacks, 1):
        logger.info("%s (%d of %d): one step at %s tokens", stack, i, len(stacks), f"{local:,}")
        est = estimate_step(config, seq_len=local, stack=stack, **options)
        if p > 1:
            extra = int(per_token * local)
            est = StepEstimate(
                est.peak + extra, {**est.breakdown, "all_to_all": extra}, est.checkpointing
            )
        entry = {**est.as_json(), **overhead.as_json(est.peak, local)}
        host = host_bytes(
            config, seq_len=local, stack=stack, dtype=dtype, optimizer=optimizer,
            num_params=num_params,
        )  # fmt: skip
        entry["host_peak_mib"] = round(host / MiB, 1)
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
        out[stack] = entry
    return out


def host_bytes(
    config: Any,
    *,
    seq_len: int,
    stack: str,
    dtype: torch.dtype,
    optimizer: str,
    num_params: int | None = None,
) -> int:
    """Host bytes of one GPU's step at `seq_len` local tokens (module docstring, "host");
    `num_params` spares building the model again for "cpu-offload"."""
    text = config.get_text_config()
    elem = torch.empty((), dtype=dtype).element_size()
    total = 0
    if "offload" in stack:
        total += offload_bytes(int(text.num_hidden_layers), seq_len, int(text.hidden_size), elem)
    if optimizer == "cpu-offload":
        total += 2 * (num_params if num_params is not None else count_params(config, dtype)) * elem
    return total


def count_params(config: Any, dtype: torch.dtype) -> int:
    """The model's parameters (tied ones once), counted on fake tensors."""
    with FakeTensorMode():
        model = _build(config, dtype, int(config.get_text_config().num_hidden_layers))
        return sum(p.numel() for p in model.parameters())


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
