"""tiled_mlp(): the functional entry point of the tiled MLP.

Invariant: the result equals mlp(x) (same shape, dtype and device; values up to the rounding of a
different summation order in the weight gradients), with gradients for x and for every trainable
parameter of mlp, each delivered exactly once per backward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from tiledmlp.ops.mlp.engine import TileEngine
from tiledmlp.ops.mlp.fast import FastEngine
from tiledmlp.ops.mlp.function import TiledMLPFunction, TiledRun, anchor_input
from tiledmlp.ops.mlp.generic import GenericEngine
from tiledmlp.ops.mlp.memory_model import MemoryModel
from tiledmlp.ops.mlp.structure import MLPStructure, recognise, recognised_before
from tiledmlp.ops.mlp.tile_rules import resolve_tiles
from tiledmlp.ops.mlp.traced import traced_tiled_mlp
from tiledmlp.ops.mlp.untiled import UntiledCall, running_untiled
from tiledmlp.ops.tiling.backend import LOCAL, ParamBackend
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.ops.tiling.state import AutocastState
from tiledmlp.ops.tiling.tiles import TileCount, TilePlan, split_even

__all__ = ["run_tiled_mlp", "tile_plan", "tiled_mlp"]

logger = logging.getLogger(__name__)


def tiled_mlp(
    mlp: nn.Module,
    x: torch.Tensor,
    *args: torch.Tensor,
    num_tiles: int | str | TilePolicy = "auto",
    tile_tokens: int | None = None,
    forward: Callable[..., Any] | None = None,
    backend: ParamBackend | None = None,
    plan_tokens: int | None = None,
    count: TileCount | None = None,
    kernels: bool = True,
) -> Any:
    """Runs the token-wise module `mlp` over `x` in tiles of tokens, keeping no intermediates.

    Recognised MLPs (gated: separate gate/up/down as in Llama, Mistral, Qwen, Gemma; fused
    gate_up as in Phi-3; plain fc1 -> act -> fc2; with or without bias; the module's own
    activation) take the minimal-recompute path: the backward recomputes only the first
    projection(s), never the down projection. Cost: 11U FLOPs per training step for a gated MLP
    against 9U untiled (U = 2 * tokens * hidden * intermediate), 7U against 6U for a plain MLP;
    per tile of n tokens about 5 * n * intermediate elements of transient memory (4 for plain;
    with low-precision weights over several tiles, whose float32 gradient accumulators take
    twice the gradients' bytes, the backward walks the intermediate dimension in chunks no wider
    than hidden, so about 5 * n * hidden).
    Any other token-wise module (LoRA-wrapped projections, MoE blocks, custom MLPs) takes the
    generic path: each tile is re-run under autograd in the backward (the whole module is
    recomputed once more), with the forward's RNG and autocast state.

    Args:
        mlp: a token-wise module: each output row depends only on the same input row.
        x: (batch, seq, hidden) or (tokens, hidden), floating point.
        *args: further per-token inputs of the module, split into tiles with x; each has x's
            leading dims (e.g. MoE experts' routing indices and weights, (tokens, top_k)).
            Modules called with such inputs take the generic path.
        num_tiles: a positive int; "auto" (default): a memory-budget rule that never uses more
            memory than the untiled module and runs it untiled when tiling would not save memory;
            "arctic": ceil(tokens / hidden) tiles as in Arctic Long Sequence Training;
            "target:<GB>": the fewest tiles whose working memory fits <GB> GiB (ops/mlp/tile_rules.py);
            or a TilePolicy (checked once where it was built, not again per call).
        tile_tokens: tokens per tile (the last tile takes the remainder), instead of num_tiles.
        forward: the module's untiled computation, used for the structure probe, the generic
            path's tiles and untiled runs; default: the module itself. A module whose forward
            was replaced by one calling tiled_mlp passes its original forward here.
        backend: how a training engine that partitions parameters (DeepSpeed ZeRO-3) makes
            them whole (see ops/tiling/backend.py); default: parameters are local and whole.
        plan_tokens: resolve the tile policy for this many tokens (when larger than x's) and
            split x's tokens into that plan's number of tiles: ranks that agreed on their
            largest token count run the same number of tiles.
        count: a TileCount to add this call's tiles to (1 when it ran untiled).
        kernels: let gated MLPs whose activation is SiLU, GELU-tanh or GELU use the fused Triton
            elementwise kernels where they can run (CUDA). False: PyTorch only. Either way the
            result is the same formula; a kernel that fails on a device is replaced by PyTorch
            there for the rest of the process, with one warning (ops/mlp/glu/kernels.py).

    Returns:
        What mlp(x) returns: a Tensor of shape (..., out), or the module's tuple of outputs.

    Raises:
        TypeError: x is not a floating-point Tensor, or its dtype does not match the MLP's.
        ValueError: bad num_tiles / tile_tokens, x not 2-D or 3-D, x's last dim is not the MLP's
            hidden size, or the module changes the number of tokens.
    """
    return run_tiled_mlp(
        mlp, x, *args, policy=TilePolicy.of(num_tiles, tile_tokens), forward=forward,
        backend=backend, plan_tokens=plan_tokens, count=count, kernels=kernels,
    )  # fmt: skip


def run_tiled_mlp(
    mlp: nn.Module,
    x: torch.Tensor,
    *args: torch.Tensor,
    policy: TilePolicy,
    forward: Callable[..., Any] | None = None,
    backend: ParamBackend | None = None,
    plan_tokens: int | None = None,
    count: TileCount | None = None,
    kernels: bool = True,
) -> Any:
    """tiled_mlp with its tile policy built: what the library's own callers run (TiledMLP,
    patched modules, the planner), which hold a TilePolicy. The other arguments are
    tiled_mlp's."""
    _check_x(x)
    _check_args(x, args)
    if torch.compiler.is_compiling() and (backend is None or backend is LOCAL):
        # See Note [tiled_mlp under torch.compile]
        structure = None if args else recognised_before(mlp)
        fwd = forward if forward is not None else mlp
        return traced_tiled_mlp(mlp, x, args, policy, fwd, structure, plan_tokens, kernels)
    return _eager_tiled_mlp(
        mlp, x, args, policy, forward, backend, plan_tokens, count, kernels
    )  # fmt: skip


# Note [tiled_mlp under torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Dynamo cannot trace TiledMLPFunction (Python-side tile loops, anchors read through grad_fn):
# while compiling, tiled_mlp goes through ops/mlp/traced.py instead (the custom operator
# tiledmlp::mlp for recognised MLPs, per-tile checkpoints for any other module). The probe
# runs eagerly only (patch_model runs it; so does an eager call): a module never recognised
# before takes the per-tile checkpoints, exact as well. The eager
# function below is never traced: a call that must run it under compile (a parameter-
# partitioning engine's backend) is one graph break.
@torch.compiler.disable
def _eager_tiled_mlp(
    mlp: nn.Module,
    x: torch.Tensor,
    args: tuple[torch.Tensor, ...],
    policy: TilePolicy,
    forward: Callable[..., Any] | None,
    backend: ParamBackend | None,
    plan_tokens: int | None,
    count: TileCount | None,
    kernels: bool,
) -> Any:
    """tiled_mlp through TiledMLPFunction (see tiled_mlp)."""
    call = UntiledCall(mlp, forward)
    if running_untiled(mlp):
        return call(x, *args)  # the tiled op is running this module's own forward: never tile twice
    backend = backend if backend is not None else LOCAL
    structure = None if args else recognise(mlp, call, ignore_hooks=backend.engine_hooks)
    with nullcontext() if backend is LOCAL else backend.gathered(list(mlp.parameters())):
        out, plan = _run(mlp, x, args, structure, call, backend, policy, plan_tokens, kernels)
    if count is not None:
        count.add(1 if plan is None else max(1, plan.num_tiles))
    return out


def _run(
    mlp: nn.Module,
    x: torch.Tensor,
    args: tuple[torch.Tensor, ...],
    structure: MLPStructure | None,
    call: UntiledCall,
    backend: ParamBackend,
    policy: TilePolicy,
    plan_tokens: int | None,
    kernels: bool = True,
) -> tuple[Any, TilePlan | None]:
    """The module's result and the plan that ran (None: untiled)."""
    engine, plan = _prepare(mlp, x, policy, call, structure, backend, plan_tokens, kernels)
    if (plan is None or plan.num_tiles == 0) and backend.engine_hooks and x.numel():
        # An engine that fetches parameters in the children's hooks (ZeRO-3) would record
        # those fetches and prefetch them in later steps, where the tiled op gathers them
        # itself: run "untiled" as one tile, so that the children's hooks never fire.
        plan = split_even(x.numel() // x.shape[-1], 1)
    if plan is None or plan.num_tiles == 0:
        logger.debug("tiled_mlp: running %s untiled", type(mlp).__name__)
        return call(x, *args), None

    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad
        or any(a.requires_grad for a in args)
        or any(p.requires_grad for p in engine.params)
    )
    x_in, x_node = anchor_input(x) if needs_grad else (x, None)
    anchored = [anchor_input(a) if needs_grad else (a, None) for a in args]
    run = TiledRun(
        engine=engine,
        plan=plan,
        x_node=x_node,
        lead_shape=tuple(x.shape[:-1]),
        extras=tuple(args),
        extra_nodes=tuple(node for _, node in anchored),
    )
    keeps = engine.untiled_keeps(x)
    run.record_versions(
        [(_ParamName(mlp, w), w, keeps.get(id(w))) for w in engine.weights]
        + [(f"extra input {i}", a, None) for i, (a, node) in enumerate(anchored) if node is None]
    )
    if not needs_grad:
        outs = run.shaped(run.run_forward(x))
    else:
        res = TiledMLPFunction.apply(x_in, run, *(a for a, _ in anchored), *engine.params)
        outs = run.shaped(run.with_none_slots(res if isinstance(res, tuple) else (res,)))
    if engine.returns_tuple:
        return tuple(outs), plan
    return outs[0], plan


def tile_plan(
    mlp: nn.Module,
    x: torch.Tensor,
    *,
    policy: TilePolicy,
    forward: Callable[[torch.Tensor], Any] | None = None,
) -> TilePlan | None:
    """The tile plan run_tiled_mlp(mlp, x, policy=policy) would use; None when it would run
    untiled."""
    _check_x(x)
    call = UntiledCall(mlp, forward)
    plan = _prepare(mlp, x, policy, call, recognise(mlp, call))[1]
    return plan if plan is not None and plan.num_tiles > 0 else None


def _check_x(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tiled_mlp: x must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(
            f"tiled_mlp: x must be a floating-point tensor (the MLP's hidden states), got dtype "
            f"{x.dtype}; cast it, e.g. x.float()."
        )
    if x.dim() not in (2, 3):
        raise ValueError(
            f"tiled_mlp: x must be (batch, seq, hidden) or (tokens, hidden), got shape "
            f"{tuple(x.shape)}; reshape it first."
        )


def _check_args(x: torch.Tensor, args: tuple[torch.Tensor, ...]) -> None:
    lead = tuple(x.shape[:-1])
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor) or tuple(a.shape[: len(lead)]) != lead:
            got = tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__
            raise ValueError(
                f"tiled_mlp: extra input {i} must be a tensor with x's leading dims {lead} "
                f"(one row per token), got {got}; pass other arguments by closing over them."
            )


def _prepare(
    mlp: nn.Module,
    x: torch.Tensor,
    policy: TilePolicy,
    call: UntiledCall,
    structure: MLPStructure | None,
    backend: ParamBackend = LOCAL,
    plan_tokens: int | None = None,
    kernels: bool = True,
) -> tuple[TileEngine, TilePlan | None]:
    """Checks x against the module, builds the engine (fast when `structure` is given) and
    resolves the plan."""
    hidden = x.shape[-1]
    expected = structure.hidden_size if structure is not None else _declared_hidden(mlp)
    if expected is not None and hidden != expected:
        raise ValueError(
            f"tiled_mlp: x's last dimension is {hidden} but the MLP's hidden size is {expected}; "
            f"expected x of shape (..., {expected})."
        )
    autocast = AutocastState.capture(x.device.type)
    engine: TileEngine
    model: MemoryModel | None = None
    if structure is not None:
        fast = FastEngine(structure, autocast, backend, kernels)
        model = MemoryModel(structure, fast.compute_dtype(x), tuple(fast.params))
        engine = fast
    else:
        engine = GenericEngine(mlp, call, autocast, three_d=x.dim() == 3, backend=backend)
    num_tokens = x.numel() // hidden if hidden else 0
    elem = x.element_size()
    if plan_tokens is None or plan_tokens <= num_tokens:
        return engine, resolve_tiles(policy, num_tokens, hidden, model, elem)
    # Ranks agreed on the largest token count: resolve the policy for it, so that every rank
    # runs the same number of tiles, then split this rank's tokens into that many.
    agreed = resolve_tiles(policy, plan_tokens, hidden, model, elem)
    if agreed is None:
        return engine, None
    return engine, split_even(num_tokens, agreed.num_tiles)


class _ParamName:
    """A parameter's name in the message of a failed version check, looked up only then (a
    per-call named_parameters() walk would cost more than a small tile's work)."""

    def __init__(self, mlp: nn.Module, param: torch.Tensor) -> None:
        self.mlp = mlp
        self.param = param

    def __str__(self) -> str:
        for name, p in self.mlp.named_parameters():
            if p is self.param:
                return f"parameter {name!r}"
        return "a weight of the MLP"


def _declared_hidden(mlp: nn.Module) -> int | None:
    """The hidden size a generic module declares (hidden_size attribute or config), if any."""
    for owner in (mlp, getattr(mlp, "config", None)):
        value = getattr(owner, "hidden_size", None) if owner is not None else None
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
