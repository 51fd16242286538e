"""The tiled MLP autograd Function.

Invariants:
- Exactly-once gradients: the weights are explicit inputs of the Function; the backward returns
  each parameter's gradient once (summed over tiles), so AccumulateGrad, DDP's reducer and ZeRO's
  hooks fire once per parameter per backward.
- Nothing is packed by this Function when x requires grad: x is saved by a tiny anchor op that
  runs before the tiled math, and the weights are kept by reference. Under non-reentrant
  activation checkpointing PyTorch's recompute stops once every saved tensor is rebuilt, i.e.
  right after the anchor, so the layer recompute never re-runs the MLP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiledmlp.ops.mlp.engine import TileEngine
from tiledmlp.ops.tiling.guards import check_versions, refuse_double_backward
from tiledmlp.ops.tiling.tiles import TilePlan

__all__ = ["TiledMLPFunction", "TiledRun", "anchor_input"]


class _InputAnchor(torch.autograd.Function):
    """Identity that saves its input; the tiled Function reads x back from this node."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def anchor_input(x: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Returns (x as an anchored view, the node holding x) when x requires grad, else (x, None)."""
    if not x.requires_grad:
        return x, None
    anchored = _InputAnchor.apply(x)
    return anchored, anchored.grad_fn


@dataclass
class TiledRun:
    """Everything one call's forward hands to its backward, besides tensors.

    Attributes:
        engine: the tile engine (ops/mlp/engine.py).
        plan: the tile split, fixed for forward and backward.
        x_node: the anchor node holding x, or None when the Function saved x itself.
        lead_shape: x.shape[:-1].
        slots: set by the forward: the engine's output_slots() (per output of the module, None
            where it is None, else whether it has x's leading dims).
    """

    engine: TileEngine
    plan: TilePlan
    x_node: Any
    lead_shape: tuple[int, ...]
    extras: tuple[torch.Tensor | None, ...] = ()
    extra_nodes: tuple[Any, ...] = ()
    slots: tuple[bool | None, ...] = ()
    versions: tuple[tuple[object, torch.Tensor, int, bool | None], ...] = ()

    def record_versions(self, named: Sequence[tuple[object, torch.Tensor, bool | None]]) -> None:
        """Remembers the version counters of the tensors the backward recomputes from but does
        not save (the weights, kept by reference; extra inputs that need no grad), each with
        whether the untiled module's autograd would keep it too (None: not known)."""
        self.versions = tuple((name, t, t._version, keeps) for name, t, keeps in named)

    def release_anchored(self) -> None:
        """Drops the references to the extra inputs an anchor saved (the backward reads those
        from their anchors): a reference kept here would keep them alive past a checkpoint's
        pack hooks and an activation offloader (a decoder layer's input, say)."""
        self.extras = tuple(
            e if node is None else None for e, node in zip(self.extras, self.extra_nodes)
        )

    def flat_extras(self, extras: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Per-token extra inputs flattened to (tokens, ...), detached."""
        n = len(self.lead_shape)
        return [e.detach().reshape(-1, *e.shape[n:]) for e in extras]

    def run_forward(self, x: torch.Tensor) -> list[torch.Tensor | None]:
        """Tiled forward on x of shape (..., hidden); outputs flattened over tokens (tokens, ...)
        where they have x's leading dims (see Note [Flat outputs])."""
        # Detached before tiling: slices of a requires-grad tensor taken under no_grad look like
        # graph members without a grad_fn, which breaks module hooks (FlopCounterMode's).
        flat = x.detach().reshape(-1, x.shape[-1])
        given = [e for e in self.extras if e is not None]  # all given before release_anchored
        outs = self.engine.forward(flat, self.plan, self.flat_extras(given))
        self.slots = self.engine.output_slots()
        return outs

    def shaped(self, outs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """The outputs of run_forward (None re-inserted) in their final shapes: views, no copy."""
        return [
            None if o is None else (o.view(*self.lead_shape, *o.shape[1:]) if keep else o)
            for o, keep in zip(outs, self.keeps_lead())
        ]

    def keeps_lead(self) -> list[bool]:
        """Per output slot, whether the output has x's leading dims (True for None outputs)."""
        return [slot is None or slot for slot in self.slots]

    def with_none_slots(self, tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Per output of the module: the Function's tensors (outputs or their gradients, None
        outputs dropped) with None re-inserted where the module returned None."""
        it = iter(tensors)
        return [None if slot is None else next(it) for slot in self.slots]


class TiledMLPFunction(torch.autograd.Function):
    """Tiled MLP with exactly-once parameter gradients.

    Inputs: x (the anchored input, (..., hidden)), a TiledRun, the per-token extra inputs
    (anchored when they require grad), then the engine's parameters.
    Outputs: the module's output tensor(s), flattened over tokens (None outputs are dropped;
    both are undone outside, see Note [Flat outputs]).

    Note [Flat outputs]: the engines allocate each output afresh, so the Function returns
    tensors that own their storage; the view to x's leading dims is taken outside the Function
    (TiledRun.shaped). A view made inside a custom Function may not be modified in place
    (autograd cannot rebase the Function's backward onto it), while the model around a module
    may modify its output in place (Llama 4's MoE adds the routed experts' output into the
    shared expert's with `add_`); a view taken outside costs no copy and allows it.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, run: TiledRun, *tensors: torch.Tensor) -> Any:
        outs = [o for o in run.run_forward(x) if o is not None]
        run.release_anchored()
        ctx.run = run
        ctx.set_materialize_grads(False)  # an unused output gives None, not a zero-filled tensor
        if run.x_node is None:
            ctx.save_for_backward(x)
        non_diff = [o for o in outs if not (o.is_floating_point() or o.is_complex())]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return outs[0] if len(outs) == 1 else tuple(outs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        run: TiledRun = ctx.run
        check_versions("tiled_mlp", run.versions)
        if not run.engine.backward_needed(grads):
            return (None, None, *([None] * (len(ctx.needs_input_grad) - 2)))
        if torch.is_grad_enabled():  # create_graph=True: autograd enables grad mode only then
            if run.engine.backend.engine_hooks:
                refuse_double_backward("tiled_mlp under a parameter-partitioning engine")
            return _graph_backward(ctx, run, grads)
        # Partitioned parameters (ZeRO-3) are whole for the backward, as for the forward.
        with torch.no_grad(), run.engine.backend.gathered_for_backward(run.engine.weights):
            return _backward(ctx, run, grads)


@dataclass
class _Saved:
    """What a backward reads back: x, the per-token extras, the upstream gradients flattened
    over tokens, and which inputs need a gradient."""

    x: torch.Tensor
    flat: torch.Tensor  # x as (tokens, hidden)
    extras: tuple[torch.Tensor, ...]
    flat_grads: list[torch.Tensor | None]
    needs_x: bool
    needs_extras: Sequence[bool]
    needs_params: Sequence[bool]


def _given(extra: torch.Tensor | None) -> torch.Tensor:
    if extra is None:  # only anchored extras are released, and those are read from the anchor
        raise RuntimeError("tiled_mlp: an extra input was released but has no anchor")
    return extra


def _saved(ctx: Any, run: TiledRun, grads: tuple[torch.Tensor | None, ...]) -> _Saved:
    x = run.x_node.saved_tensors[0] if run.x_node is not None else ctx.saved_tensors[0]
    flat = x.reshape(-1, x.shape[-1])
    n_extra = len(run.extras)
    extras = tuple(
        node.saved_tensors[0] if node is not None else _given(e)
        for node, e in zip(run.extra_nodes, run.extras)
    )
    flat_grads = list(run.with_none_slots(grads))  # the outputs were flat: so are their grads
    return _Saved(
        x=x,
        flat=flat,
        extras=extras,
        flat_grads=flat_grads,
        needs_x=ctx.needs_input_grad[0],
        needs_extras=ctx.needs_input_grad[2 : 2 + n_extra],
        needs_params=ctx.needs_input_grad[2 + n_extra :],
    )


def _backward(ctx: Any, run: TiledRun, grads: tuple[torch.Tensor | None, ...]) -> Any:
    """TiledMLPFunction.backward with the module's parameters whole."""
    sv = _saved(ctx, run, grads)
    dx, egrads, pgrads = run.engine.backward(
        sv.flat,
        run.flat_extras(sv.extras),
        sv.flat_grads,
        run.plan,
        sv.needs_x,
        sv.needs_extras,
        sv.needs_params,
    )
    egrads = [None if g is None else g.view(e.shape) for g, e in zip(egrads, sv.extras)]
    return (None if dx is None else dx.view(sv.x.shape), None, *egrads, *pgrads)


def _graph_backward(ctx: Any, run: TiledRun, grads: tuple[torch.Tensor | None, ...]) -> Any:
    """TiledMLPFunction.backward under create_graph=True (gradient penalties, Hessian-vector
    products): each tile is recomputed under autograd and differentiated with create_graph, so
    the returned gradients carry the graph that second-order terms need. Exact like the
    first-order path; the graphs of all tiles stay alive until the second backward, i.e. the
    memory of the untiled module's autograd graph, the price of a graph of the backward."""
    sv = _saved(ctx, run, grads)
    engine = run.engine
    wanted = [p for p, need in zip(engine.params, sv.needs_params) if need]
    # Not detached (unlike run.flat_extras): the extras stay part of the caller's graph.
    flat_extras = [e.reshape(-1, *e.shape[len(run.lead_shape) :]) for e in sv.extras]
    dx_tiles: list[torch.Tensor] = []
    extra_tiles: list[list[torch.Tensor]] = [[] for _ in sv.extras]
    pgrads: list[torch.Tensor | None] = [None] * len(wanted)
    for i, (start, stop) in enumerate(run.plan.bounds()):
        xt = sv.flat[start:stop]
        et = [e[start:stop] for e in flat_extras]
        outs = engine.recompute_tile(xt, et, i)
        pairs = [
            (o, g[start:stop])
            for o, g in zip(outs, sv.flat_grads)
            if o is not None and g is not None and o.requires_grad
        ]
        inputs = [xt] if sv.needs_x else []
        inputs += [t for t, need in zip(et, sv.needs_extras) if need]
        got: list[torch.Tensor | None] = [None] * (len(inputs) + len(wanted))
        if pairs:
            got = list(
                torch.autograd.grad(
                    [o for o, _ in pairs],
                    inputs + wanted,
                    [g for _, g in pairs],
                    create_graph=True,
                    allow_unused=True,
                )
            )
        sinks = [dx_tiles] if sv.needs_x else []
        sinks += [tiles for tiles, need in zip(extra_tiles, sv.needs_extras) if need]
        for sink, t, g in zip(sinks, inputs, got):
            sink.append(torch.zeros_like(t) if g is None else g)
        for k, g in enumerate(got[len(inputs) :]):
            prev = pgrads[k]
            if g is not None:
                pgrads[k] = g if prev is None else prev + g
    dx = torch.cat(dx_tiles).view(sv.x.shape) if sv.needs_x else None
    egrads = [
        torch.cat(tiles).view(e.shape) if need else None
        for tiles, e, need in zip(extra_tiles, sv.extras, sv.needs_extras)
    ]
    it = iter(pgrads)
    return (dx, None, *egrads, *(next(it) if need else None for need in sv.needs_params))
