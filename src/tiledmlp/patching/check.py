"""tiledmlp.check: one training step of a model, unpatched and patched, from the same weights and
micro-batches, compared loss by loss and gradient by gradient (check_result.py holds the rule).

A step is gradient accumulation over at least two micro-batches (each loss divided by their
number, one backward each), so a weight's gradient counted once per tile or once per micro-batch
shows. Three copies of the model run it: the untiled one and the patched one in the model's own
dtype (or under autocast), and a reference in a wider dtype (float64 unless told), each through
the same engine (a StepEngine: one process, DDP, FSDP2). The caller's model is never changed.

Tile policies that choose their count from the length or from memory ("auto", "arctic",
"target:<GB>", tokens per tile) would run one tile at a check's short length; the check runs
CHECK_TILES tiles instead (and says so), so that every tiled call really runs several tiles.

Invariant: the three steps see the same weights, micro-batches and random state; on several
processes every rank reaches the same verdict (the pass flag is all-reduced).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.patching.check_result import NO_REFERENCE_ULPS, CheckResult, StepCost, compare
from tiledmlp.patching.features.tiled_modules import tile_counts
from tiledmlp.patching.patch import patch_model
from tiledmlp.process_memory import process_peak_bytes

__all__ = ["CHECK_SEQ_LEN", "CHECK_TILES", "LocalEngine", "StepEngine", "check", "check_policy"]

#: tiles per call where the user's policy picks its count from the length or memory
CHECK_TILES = 4
#: the check's default tokens per sequence: short, the tiles' logic is what is checked
CHECK_SEQ_LEN = 256
_MiB = 2**20

LossFn = Callable[[nn.Module, Mapping[str, Any]], torch.Tensor]


class StepEngine(Protocol):
    """What runs a step: wraps a model, syncs gradients on the last micro-batch only (as the
    Trainer does), and makes a parameter's gradient whole for the comparison."""

    name: str
    world_size: int

    def wrap(self, model: nn.Module) -> nn.Module: ...

    def accumulating(
        self, wrapped: nn.Module, last: bool
    ) -> contextlib.AbstractContextManager[Any]: ...

    def whole(self, grad: torch.Tensor) -> torch.Tensor: ...


class LocalEngine:
    """One process, no engine."""

    name = "single"
    world_size = 1

    def wrap(self, model: nn.Module) -> nn.Module:
        return model

    def accumulating(
        self, wrapped: nn.Module, last: bool
    ) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def whole(self, grad: torch.Tensor) -> torch.Tensor:
        return grad


def check_policy(config: PatchConfig) -> tuple[PatchConfig, list[str]]:
    """`config` with CHECK_TILES tiles wherever its policy picks the count from the length or
    memory (module docstring), and the notes that say so."""
    notes: list[str] = []
    changes: dict[str, Any] = {}
    if config.tiled_mlp and config.tiles.rule != "count":
        changes["tiles"] = TilePolicy("count", CHECK_TILES)
        notes.append(
            f"tiles: your policy ({config.tiles}) picks its count from the length or memory; the "
            f"check runs {CHECK_TILES} tiles per call so that the tiles' logic runs"
        )
    if config.tiled_loss and config.loss_policy.rule != "count":
        changes["loss_tiles"] = TilePolicy("count", CHECK_TILES)
        notes.append(f"loss: the check runs the tiled loss in {CHECK_TILES} tiles")
    return (dataclasses.replace(config, **changes) if changes else config), notes


def check(
    model: nn.Module,
    batch: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    config: PatchConfig | None = None,
    *,
    micro_batches: int = 2,
    autocast: torch.dtype | None = None,
    reference_dtype: torch.dtype | None = torch.float64,
    engine: StepEngine | None = None,
    loss_fn: LossFn | None = None,
    seed: int = 0,
    notes: Sequence[str] = (),
    **options: Any,
) -> CheckResult:
    """Runs one training step of `model` unpatched and patched (patch_model with `config` or
    `options`) and compares the loss and every parameter's gradient.

    Args:
        model: an unpatched model (left unchanged: the steps run on copies).
        batch: a mapping of tensors (input_ids, labels, ...; (batch, seq)) split along its
            first dimension into `micro_batches`, or a sequence of at least two such mappings,
            one per micro-batch.
        config: what to patch (PatchConfig), or instead `**options` as patch_model takes them.
        micro_batches: micro-batches a mapping is split into (at least 2).
        autocast: run the forwards under torch.autocast in this dtype (float16 / bfloat16 mixed
            precision); None: in the model's own dtype.
        reference_dtype: the reference step's dtype (float64; None: no reference, the tiled
            step is compared with the untiled one).
        engine: what runs the steps (LocalEngine when None).
        loss_fn: (model, micro-batch) -> scalar loss; default `model(**micro_batch).loss`.
        seed: the random state each step starts from (dropout draws the same masks).
        notes: lines to show under the verdict's first line.

    Returns:
        A CheckResult (`passed`, `text()`, `as_dict()`).

    Raises:
        ValueError: fewer than two micro-batches, a patched model, sequence parallelism (not
            checked yet), or nothing to tile; TypeError: unknown options.
    """
    config = PatchConfig.given(config, options, "tiledmlp.check")
    if config.sequence_parallel:
        raise ValueError(
            "tiledmlp.check does not run sequence parallelism; check without "
            "sequence_parallel_size (the tiles' logic is the same on each rank)"
        )
    if tile_counts(model):
        raise ValueError("tiledmlp.check takes the unpatched model; call it before patch_model")
    micro = _micro_batches(batch, micro_batches)
    config, policy_notes = check_policy(config)
    engine = engine or LocalEngine()
    loss_fn = loss_fn or _model_loss
    params = [p for p in model.parameters() if p.is_floating_point()]
    dtype = autocast or (params[0].dtype if params else torch.float32)
    device = params[0].device if params else torch.device("cpu")
    micro = [_to(mb, device, None) for mb in micro]

    untiled = _Run(copy.deepcopy(model))
    untiled.step(micro, engine, autocast, loss_fn, seed)
    tiled = _Run(copy.deepcopy(model))
    report = patch_model(tiled.model, config)
    tiled.step(micro, engine, autocast, loss_fn, seed)
    counts = {n: c.last for n, c in tile_counts(tiled.model).items()}
    ref_notes: list[str] = []
    ref, reference_dtype = _reference(
        model, micro, engine, loss_fn, seed, reference_dtype, dtype, autocast, ref_notes
    )

    names = list(dict.fromkeys([*untiled.grads, *tiled.grads]))
    compared = [
        compare(
            n, tiled.grads.get(n), untiled.grads.get(n), ref.grads.get(n) if ref else None, dtype
        )
        for n in names
    ]
    compared.sort(key=lambda c: c.ratio, reverse=True)
    loss = compare(  # the loss's rounding is its own dtype's (a bf16 model's loss is float32)
        "loss",
        torch.tensor(tiled.loss),
        torch.tensor(untiled.loss),
        torch.tensor(ref.loss) if ref else None,
        untiled.loss_dtype,
    )
    failed = [c.name for c in compared if not c.ok] + ([] if loss.ok else ["loss"])
    return CheckResult(
        passed=_agreed(not failed),
        report=str(report),
        tiles=counts,
        untiled_calls=[n for n, c in counts.items() if c <= 1],
        loss=loss,
        losses={
            "untiled": untiled.loss,
            "tiled": tiled.loss,
            "reference": ref.loss if ref else None,
        },
        params=compared,
        failed=failed,
        dtype=_name(dtype),
        reference_dtype=None if reference_dtype is None else _name(reference_dtype),
        micro_batches=len(micro),
        tokens=_tokens(micro[0]),
        engine=engine.name,
        world_size=engine.world_size,
        untiled_cost=untiled.cost,
        tiled_cost=tiled.cost,
        notes=[*notes, *policy_notes, *ref_notes],
    )


class _Run:
    """One copy of the model and what its step gave: the loss (the micro-batches' mean) and
    each parameter's whole gradient (dropped from the model once read)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        for p in model.parameters():
            p.grad = None
        self.loss = 0.0
        self.loss_dtype = torch.float32
        self.grads: dict[str, torch.Tensor] = {}
        self.cost = StepCost(0.0, None, "")

    def step(
        self,
        micro: list[dict[str, Any]],
        engine: StepEngine,
        autocast: torch.dtype | None,
        loss_fn: LossFn,
        seed: int,
    ) -> None:
        wrapped = engine.wrap(self.model)
        losses: list[float] = []
        device = next(self.model.parameters()).device

        def run() -> None:
            for i, mb in enumerate(micro):
                with engine.accumulating(wrapped, last=i == len(micro) - 1):
                    with _autocast(device, autocast):
                        loss = loss_fn(wrapped, mb)
                    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                        raise ValueError(
                            "tiledmlp.check: the loss must be a scalar tensor; give the batch "
                            "labels (a causal LM computes its loss from them) or a loss_fn"
                        )
                    (loss / len(micro)).backward()
                losses.append(loss.detach().double().item())
                self.loss_dtype = loss.dtype

        torch.manual_seed(seed)
        self.cost = _measure(run, device)
        self.loss = sum(losses) / len(losses)
        for name, p in self.model.named_parameters():
            if p.grad is not None:
                self.grads[name] = engine.whole(p.grad).detach()
            p.grad = None


def _reference(
    model: nn.Module,
    micro: list[dict[str, Any]],
    engine: StepEngine,
    loss_fn: LossFn,
    seed: int,
    wanted: torch.dtype | None,
    dtype: torch.dtype,
    autocast: torch.dtype | None,
    notes: list[str],
) -> tuple[_Run | None, torch.dtype | None]:
    """The reference step in `wanted` (None where it would run as the untiled step does);
    where the model's kernels refuse float64, float32 for a narrower dtype, else none (noted)."""
    if wanted is None or (wanted == dtype and autocast is None):
        return None, None
    for ref_dtype in (wanted, torch.float32):
        if ref_dtype == torch.float32 and (wanted == torch.float32 or dtype == torch.float32):
            break
        run = _Run(copy.deepcopy(model).to(ref_dtype))
        try:
            run.step([_to(mb, None, ref_dtype) for mb in micro], engine, None, loss_fn, seed)
        except (RuntimeError, NotImplementedError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            notes.append(f"reference: the model does not run in {_name(ref_dtype)} ({first})")
            continue
        return run, ref_dtype
    notes.append(
        "reference: none; the tiled step is compared with the untiled one directly (within "
        f"{NO_REFERENCE_ULPS:g} units of rounding at each gradient's scale)"
    )
    return None, None


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _measure(run: Callable[[], None], device: torch.device) -> StepCost:
    """The step's time and its peak memory above what was held before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        start = time.perf_counter()
        run()
        torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated(device) - before) / _MiB
        return StepCost(seconds, peak, "max_memory_allocated")
    start = time.perf_counter()
    grown = process_peak_bytes(run, 0)
    seconds = time.perf_counter() - start
    if grown is None:  # no /proc: the step ran once without a reading
        return StepCost(seconds, None, "not readable here")
    return StepCost(seconds, grown / _MiB, "process VmHWM")


@contextlib.contextmanager
def _autocast(device: torch.device, dtype: torch.dtype | None) -> Iterator[None]:
    if dtype is None:
        yield
        return
    with torch.autocast(device.type, dtype=dtype):
        yield


def _model_loss(model: nn.Module, mb: Mapping[str, Any]) -> torch.Tensor:
    out = model(**mb)
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, Mapping):
        loss = out.get("loss")
    if loss is None:
        raise ValueError(
            "tiledmlp.check: the model returned no loss; give the batch labels (e.g. labels = "
            "input_ids for a causal LM) or pass loss_fn"
        )
    return loss  # type: ignore[no-any-return]


def _micro_batches(
    batch: Mapping[str, Any] | Sequence[Mapping[str, Any]], n: int
) -> list[dict[str, Any]]:
    """The step's micro-batches (at least two; see check's `batch`)."""
    if isinstance(batch, Mapping):
        if n < 2:
            raise ValueError(
                f"tiledmlp.check: micro_batches must be at least 2 (gradient accumulation is "
                f"part of what is checked), got {n}"
            )
        sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()}
        if len(sizes) != 1:
            raise ValueError(
                "tiledmlp.check: the batch must hold tensors with one batch size (dim 0), got "
                f"{sorted(sizes) or 'none'}"
            )
        size = sizes.pop()
        if size < n or size % n:
            raise ValueError(
                f"tiledmlp.check: a batch of {size} sequence(s) cannot be split into {n} "
                f"micro-batches; give a batch of {n} x k sequences or a list of micro-batches"
            )
        step = size // n
        return [
            {k: v[i * step : (i + 1) * step] if isinstance(v, torch.Tensor) and v.dim() else v
             for k, v in batch.items()}
            for i in range(n)
        ]  # fmt: skip
    micro = [dict(mb) for mb in batch]
    if len(micro) < 2:
        raise ValueError(
            f"tiledmlp.check: give at least 2 micro-batches (gradient accumulation is part of "
            f"what is checked), got {len(micro)}"
        )
    return micro


def _to(
    mb: Mapping[str, Any], device: torch.device | None, dtype: torch.dtype | None
) -> dict[str, Any]:
    """The micro-batch on `device`, its floating tensors in `dtype` (None: as they are)."""
    out: dict[str, Any] = {}
    for k, v in mb.items():
        if isinstance(v, torch.Tensor):
            v = v if device is None else v.to(device)
            if dtype is not None and v.is_floating_point():
                v = v.to(dtype)
        out[k] = v
    return out


def _tokens(mb: Mapping[str, Any]) -> int:
    ids = mb.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return int(ids.numel())
    first = next((v for v in mb.values() if isinstance(v, torch.Tensor)), None)
    return int(first.shape[:-1].numel()) if first is not None and first.dim() > 1 else 0


def _agreed(passed: bool) -> bool:
    """The pass flag, the same on every rank (a failure on one fails all)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return passed
    flag = torch.tensor([1 if passed else 0], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
