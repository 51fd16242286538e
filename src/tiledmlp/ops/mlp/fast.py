"""Minimal-recompute tile math for recognised MLPs (gated, fused gated, plain two-layer).

Cost model, with N tokens, hidden h, intermediate m and U = 2*N*h*m FLOPs (one full GEMM):
- gated / fused gated: forward 3U, backward 5U + recompute of the first projections 2U (gate and
  up; one GEMM when they are fused) = 11U per step, against 9U untiled. The down projection is
  never recomputed.
- plain: forward 2U, backward 4U + recompute 1U = 7U, against 6U untiled.
Memory: the forward keeps nothing but the output. The backward holds, per tile of n tokens,
about 5*n*m elements (gated) or 4*n*m (plain) in the compute dtype, plus one float32 accumulator
per weight when weights or compute are lower precision than float32. With such accumulators and
more than one tile, each tile's backward runs in chunks of the intermediate dimension no wider
than the hidden size h, so m above becomes at most about h (ops/mlp/chunks.py).

Fused elementwise: where the gate's activation is exactly SiLU, GELU-tanh or GELU
(glu_kernels.activation_kind) and Triton kernels can run on the device (CUDA), act(g) * u and
the whole backward chain (du, dg and h again for the down projection's weight gradient) are one
pass each, in place: a gated tile then holds 3*n*m elements. Elsewhere (or with kernels=False,
or on a device where a kernel failed: glu_kernels' failover) the module's own activation runs
through PyTorch (the reference path).

Invariant: every tile's weight gradients go into one accumulator per weight (grads.GradSlot);
the backward returns each parameter's gradient once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from tiledmlp.ops.mlp.chunks import chunk_params, chunk_ranges, is_elementwise
from tiledmlp.ops.mlp.engine import TileEngine
from tiledmlp.ops.mlp.glu import kernels as glu_kernels
from tiledmlp.ops.mlp.params import LinearParams, MLPParams
from tiledmlp.ops.mlp.structure import MLPKind, MLPStructure
from tiledmlp.ops.tiling.backend import LOCAL, ParamBackend
from tiledmlp.ops.tiling.grads import GradPart, GradSlot, Scratch
from tiledmlp.ops.tiling.state import AutocastState
from tiledmlp.ops.tiling.tiles import TilePlan

__all__ = ["FastEngine"]


_Weights = MLPParams[torch.Tensor]  # the module's tensors, or their casts to the compute dtype
_Slots = MLPParams[GradSlot | None]  # one accumulator per tensor that needs a gradient
_PartSlots = MLPParams[GradSlot | GradPart | None]  # or a part of one (an intermediate chunk)


def _mm_into(out: torch.Tensor, x: torch.Tensor, lin: LinearParams[torch.Tensor]) -> torch.Tensor:
    """out = x @ weight.T (+ bias), the same GEMM F.linear runs, written into `out`."""
    if lin.bias is None:
        return torch.mm(x, lin.weight.t(), out=out)
    return torch.addmm(lin.bias, x, lin.weight.t(), out=out)


class FastEngine:
    """Tiled forward and backward for a recognised MLP structure (a TileEngine).

    Args:
        structure: the recognised MLP.
        autocast: autocast settings captured when the forward ran.
        backend: how the module's parameters are made whole (ops/tiling/backend.py); the caller
            gathers `weights` around the forward and the backward.
        kernels: whether the fused elementwise kernels may be used (False: PyTorch only).
    """

    returns_tuple = False  # the module returns one tensor

    def __init__(
        self,
        structure: MLPStructure,
        autocast: AutocastState,
        backend: ParamBackend = LOCAL,
        kernels: bool = True,
    ) -> None:
        self.structure = structure
        self.autocast = autocast
        self.backend = backend
        self.kernels = kernels
        # The tensors this engine captured, each read once; never `lin.weight` again: a
        # parametrized weight (spectral norm in training) would run its parametrization, and its
        # power iteration, once more.
        self._named: _Weights = MLPParams.of(structure)
        self.params: list[torch.Tensor] = [p for p in self._named.flat() if p is not None]
        self.weights = self.params  # every parameter the computation uses (all are inputs)
        gated = structure.kind in (MLPKind.GATED, MLPKind.FUSED_GATED)
        self.glu = glu_kernels.activation_kind(structure.act) if gated else None
        self.elementwise = is_elementwise(structure.act)

    def _fused(self, t: torch.Tensor) -> str | None:
        """The activation kind for the fused elementwise kernels, or None for PyTorch."""
        if self.glu is None or not self.kernels:
            return None
        if glu_kernels.kernels_available(t.device) or glu_kernels.kernels_planned(t):
            return self.glu
        return None

    # -- dtypes ------------------------------------------------------------------------------

    def compute_dtype(self, x: torch.Tensor) -> torch.dtype:
        """The dtype the module's own GEMMs would run in (autocast's, else the input's)."""
        dtypes = {p.dtype for p in self.params}
        cast = self.autocast.compute_dtype(x.dtype, *dtypes)
        if cast is not None:
            return cast
        if dtypes != {x.dtype}:
            raise TypeError(
                f"tiled_mlp: x has dtype {x.dtype} but the MLP's parameters have "
                f"{sorted(str(d) for d in dtypes)}; expected them to match (the module itself "
                "would fail). Cast x or the module, or run under torch.autocast."
            )
        return x.dtype

    def untiled_keeps(self, x: torch.Tensor) -> dict[int, bool]:
        """Which parameters (by id) the untiled module's autograd would keep by reference for its
        backward, for an input like x: a Linear's backward keeps its weight only when its input
        needs a gradient (for d(input)), never its bias, and nothing of a weight that autocast
        casts (it keeps the cast copy). Changing a kept tensor in place before the backward makes
        the untiled module raise too; changing one it does not keep leaves its gradients exact
        for the forward that ran (the tiled backward, which recomputes from it, must refuse)."""
        of_x = self._named.projections_of_x()
        first = [p for lin in of_x for p in (lin.weight, lin.bias) if p is not None]
        x_grad = x.requires_grad and torch.is_grad_enabled()
        hidden_grad = x_grad or any(p.requires_grad for p in first)
        keeps = {id(p): False for p in self.params}
        for lin, input_grad in [(lin, x_grad) for lin in of_x] + [(self._named.down, hidden_grad)]:
            cast = self.autocast.compute_dtype(x.dtype, lin.weight.dtype)
            copied = cast is not None and cast != lin.weight.dtype
            keeps[id(lin.weight)] = input_grad and not copied
        return keeps

    def _cast(self, dtype: torch.dtype) -> _Weights:
        return self._named.map(lambda p: p.to(dtype))

    def _act(self, g: torch.Tensor) -> torch.Tensor:
        if not self.autocast.enabled:
            return self.structure.act(g)  # every caller already runs with autocast off
        with self.autocast.restore():
            return self.structure.act(g)

    def _halves(self, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.structure.intermediate_size
        first, second = gu[:, :m], gu[:, m:]
        return (first, second) if self.structure.gate_first else (second, first)

    # -- outputs -----------------------------------------------------------------------------

    def output_slots(self) -> tuple[bool | None, ...]:
        """One output, with x's leading dims."""
        return (True,)

    def backward_needed(self, grad_outs: Sequence[torch.Tensor | None]) -> bool:
        """Whether the output got a gradient."""
        return grad_outs[0] is not None

    # -- forward -----------------------------------------------------------------------------

    def forward(
        self, x: torch.Tensor, plan: TilePlan, extras: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """Tiled forward without keeping intermediates.

        Args:
            x: (tokens, hidden).
            plan: the tile split of the tokens.
            extras: none (a recognised MLP takes x alone).

        Returns:
            [(tokens, output_size) in the compute dtype].
        """
        s = self.structure
        cd = self.compute_dtype(x)
        w = self._cast(cd)
        out = torch.empty((x.shape[0], s.output_size), dtype=cd, device=x.device)
        kind = self._fused(x)
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            for start, stop in plan.bounds():
                self._forward_tile(x[start:stop].to(cd), w, out[start:stop], kind)
        return [out]

    def _forward_tile(
        self, xt: torch.Tensor, w: _Weights, out: torch.Tensor, kind: str | None
    ) -> None:
        if self.structure.kind is MLPKind.PLAIN:
            h = self._act(w.first(xt))
        else:
            g, u, _ = self._gate_up(xt, w)
            if kind is not None:
                h = glu_kernels.glu_forward(g, u, kind, out=g)
            else:
                h = self._act(g).mul_(u)
        _mm_into(out, h.to(xt.dtype), w.down)

    def _gate_up(
        self, xt: torch.Tensor, w: _Weights
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(g, u, gu) of a gated tile: for a fused gate_up, g and u are the two halves of one
        GEMM's result gu; else gu is None."""
        if w.up is not None:  # separate gate and up projections
            g = w.first(xt)
            return g, w.up(xt), None
        gu = w.first(xt)
        return (*self._halves(gu), gu)

    def recompute_tile(
        self, x_tile: torch.Tensor, extra_tiles: Sequence[torch.Tensor], i: int
    ) -> list[torch.Tensor | None]:
        """One tile's output under autograd, for a graph of the backward (create_graph=True):
        the forward's GEMMs and activation, differentiable in x_tile and the parameters.

        Args:
            x_tile: (n, hidden), part of the autograd graph.
            extra_tiles: none (a recognised MLP takes x alone).
            i: the tile's index (unused: the computation holds no per-tile state).

        Returns:
            [(n, output_size) in the compute dtype, with its graph].
        """
        cd = self.compute_dtype(x_tile)
        w = self._cast(cd)
        with torch.enable_grad(), torch.autocast(x_tile.device.type, enabled=False):
            x = x_tile.to(cd)
            if w.up is not None:
                h = self._act(w.first(x)) * w.up(x)
            elif self.structure.kind is MLPKind.FUSED_GATED:
                g, u = self._halves(w.first(x))
                h = self._act(g) * u
            else:
                h = self._act(w.first(x))
            return [w.down(h.to(cd))]

    # -- intermediate chunks (ops/mlp/chunks.py: Note [intermediate chunks]) ------------------

    def _chunks(self) -> list[tuple[int, int]]:
        """[start, stop) ranges of the intermediate dimension, each at most about the hidden
        size wide; one range when it is not wider."""
        return chunk_ranges(self.structure.intermediate_size, self.structure.hidden_size)

    def _chunk(
        self, w: _Weights, slots: _Slots, start: int, stop: int
    ) -> tuple[_Weights, _PartSlots]:
        """The weights and gradient slots of intermediate units [start, stop)."""
        return chunk_params(self.structure, w, start, stop), chunk_params(
            self.structure, slots, start, stop
        )

    # -- backward ----------------------------------------------------------------------------

    def backward(
        self,
        x: torch.Tensor,
        extras: Sequence[torch.Tensor],
        grad_outs: Sequence[torch.Tensor | None],
        plan: TilePlan,
        needs_x: bool,
        needs_extras: Sequence[bool],
        needs_params: Sequence[bool],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Recomputes the first projection(s) per tile and accumulates every gradient once.

        Per tile of n tokens the live intermediates peak at five (n, m) tensors (gated) or four
        (plain): the recomputed projection(s), the activation (reused in place as its own
        gradient), the activation's re-evaluation for its derivative, and that derivative.

        Args:
            x: (tokens, hidden), the forward input.
            extras: none (a recognised MLP takes x alone).
            grad_outs: [(tokens, output_size)], the gradient of the output (backward_needed).
            plan: the same tile split the forward used.
            needs_x: whether to return a gradient for x.
            needs_extras: none.
            needs_params: per entry of `self.params`, whether it needs a gradient.

        Returns:
            (dx of shape (tokens, hidden) in x's dtype or None, [], per-parameter gradients or
            None).
        """
        (grad_out,) = grad_outs
        assert grad_out is not None  # the Function returns early otherwise (backward_needed)
        cd = self.compute_dtype(x)
        w = self._cast(cd)
        scratch = Scratch()
        single = plan.num_tiles == 1
        needed = [p for p, need in zip(self.params, needs_params) if need]
        # See Note [intermediate chunks]
        wide = any(not GradSlot.sums_in_place(p, cd, single) for p in needed)
        if wide and self.elementwise:
            chunks = self._chunks()
        else:
            chunks = [(0, self.structure.intermediate_size)]
        need_iter = iter(needs_params)
        down_weight = self._named.down.weight
        slots: _Slots = self._named.map(
            lambda p: (
                GradSlot(p, cd, scratch, single, transposed=len(chunks) > 1 and p is down_weight)
                if next(need_iter)
                else None
            )
        )
        need_up = needs_x or any(
            sl is not None for lin in slots.projections_of_x() for sl in (lin.weight, lin.bias)
        )
        dx = torch.empty_like(x) if needs_x else None
        kind = self._fused(x)
        tile = self._backward_tile if kind is None else self._backward_tile_fused
        parts: list[tuple[_Weights, _PartSlots]]
        parts = (
            [(w, cast(_PartSlots, slots))]
            if len(chunks) == 1
            else [self._chunk(w, slots, *c) for c in chunks]
        )
        down_bias = slots.down.bias if len(chunks) > 1 else None  # per tile, not per chunk

        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            for start, stop in plan.bounds():
                xt = x[start:stop].to(cd)
                dyt = grad_out[start:stop].to(cd)
                dxt = None if dx is None else dx[start:stop]
                if down_bias is not None:
                    down_bias.add_rows(dyt)
                for j, (wc, sc) in enumerate(parts):
                    # One call per chunk of a tile: its temporaries die on return, before the
                    # next one's exist.
                    tile(xt, dyt, wc, sc, need_up, dxt, kind, j > 0)
                del xt, dyt, dxt  # casts of x and dy die before the next tile's exist
        return dx, [], self._results(slots, needs_params)

    def _backward_tile(
        self,
        xt: torch.Tensor,
        dyt: torch.Tensor,
        w: _Weights,
        slots: _PartSlots,
        need_up: bool,
        dxt: torch.Tensor | None,
        kind: str | None = None,
        add_dx: bool = False,
    ) -> None:
        """One tile's backward through PyTorch and the module's own activation (add_dx: add
        the tile's dx to dxt instead of writing it)."""
        s = self.structure
        cd = xt.dtype
        if s.kind is MLPKind.PLAIN:
            g, u, gu = w.first(xt), None, None
        else:
            g, u, gu = self._gate_up(xt, w)

        a = self._act(g.clone() if s.act_in_place else g).to(cd)
        h = a if u is None else a * u  # the down projection's input
        self._down_grads(slots, dyt, h)
        if not need_up:
            return
        if u is None:
            del a, h
            dz = self._act_grad(g, torch.mm(dyt, w.down.weight))
            self._input_grads(slots, xt, w, dxt, add_dx, dz)
            return
        dh = torch.mm(dyt, w.down.weight, out=h)
        du = a.mul_(dh)
        da = u.mul_(dh)
        del dh, h, a
        dg = self._act_grad(g, da)
        del da
        if gu is not None:
            # [dg | du] in gate_up's layout: one GEMM each for the weight grad and for dx.
            g.copy_(dg)
            u.copy_(du)
            del dg, du
            self._input_grads(slots, xt, w, dxt, add_dx, gu)
        else:
            self._input_grads(slots, xt, w, dxt, add_dx, dg, du)

    def _backward_tile_fused(
        self,
        xt: torch.Tensor,
        dyt: torch.Tensor,
        w: _Weights,
        slots: _PartSlots,
        need_up: bool,
        dxt: torch.Tensor | None,
        kind: str | None,
        add_dx: bool = False,
    ) -> None:
        """_backward_tile with the fused elementwise kernels (gated MLPs with an activation of
        `kind`): three (n, m) tensors at most."""
        assert kind is not None  # chosen by backward() only for a recognised activation
        g, u, gu = self._gate_up(xt, w)
        if not need_up:
            self._down_grads(slots, dyt, glu_kernels.glu_forward(g, u, kind, out=g))
            return
        dh = torch.mm(dyt, w.down.weight)
        glu_kernels.glu_backward(g, u, dh, kind, h_out=dh)  # g <- dg, u <- du, dh <- h
        self._down_grads(slots, dyt, dh)
        del dh
        if gu is not None:  # dg and du were written over its halves: [dg | du] in its layout
            self._input_grads(slots, xt, w, dxt, add_dx, gu)
        else:
            self._input_grads(slots, xt, w, dxt, add_dx, g, u)

    @staticmethod
    def _down_grads(slots: _PartSlots, dyt: torch.Tensor, h: torch.Tensor) -> None:
        """The down projection's weight (dy^T h) and bias gradients of a tile."""
        if slots.down.weight is not None:
            slots.down.weight.add_mm(dyt.t(), h)
        if slots.down.bias is not None:
            slots.down.bias.add_rows(dyt)

    def _input_grads(
        self,
        slots: _PartSlots,
        xt: torch.Tensor,
        w: _Weights,
        dxt: torch.Tensor | None,
        add_dx: bool,
        d1: torch.Tensor,
        d2: torch.Tensor | None = None,
    ) -> None:
        """The first projection(s)' gradients and dx of a tile, from d1 (the gradient of the
        first linear's output: dz, dg, or [dg | du] in a fused gate_up's layout) and d2 (du of
        a separate up projection); add_dx: dx is added to dxt (a later intermediate chunk)."""
        ds = [d1] if d2 is None else [d1, d2]
        for lin_slots, d in zip(slots.projections_of_x(), ds):
            self._first_grads(lin_slots, d, xt)
        if dxt is not None:
            terms = [(d, lin.weight) for d, lin in zip(ds, w.projections_of_x())]
            self._dx_into(dxt, terms, add_dx)

    def _act_grad(self, z: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """Gradient through the module's own activation at z, by re-evaluating it (elementwise,
        no GEMM) under autograd; the result has z's dtype."""
        z_leaf = z.detach().requires_grad_()
        with torch.enable_grad():
            # The activation sees a non-leaf (a copy if it writes in place): hooks that modules
            # get from FlopCounterMode or profilers cannot run on a leaf inside autograd.grad.
            a = self._act(z_leaf.clone() if self.structure.act_in_place else z_leaf.view_as(z_leaf))
        (dz,) = torch.autograd.grad(a, z_leaf, grad.to(a.dtype))
        return dz.to(z.dtype)

    @staticmethod
    def _first_grads(
        lin_slots: LinearParams[GradSlot | GradPart | None], dz: torch.Tensor, xt: torch.Tensor
    ) -> None:
        if lin_slots.weight is not None:
            lin_slots.weight.add_mm(dz.t(), xt)
        if lin_slots.bias is not None:
            lin_slots.bias.add_rows(dz)

    @staticmethod
    def _dx_into(
        out: torch.Tensor, terms: list[tuple[torch.Tensor, torch.Tensor]], add: bool = False
    ) -> None:
        """out = sum of d @ w over the (d, w) terms (the first projection, then a separate up
        projection), accumulated in the compute dtype, stored in out's dtype; add: out += that
        sum instead."""
        (d1, w1), *rest = terms
        if out.dtype == d1.dtype:
            if add:
                torch.addmm(out, d1, w1, out=out)
            else:
                torch.mm(d1, w1, out=out)
            for d, w in rest:
                torch.addmm(out, d, w, out=out)
            return
        t = torch.mm(d1, w1)
        for d, w in rest:
            torch.addmm(t, d, w, out=t)
        if add:
            out.add_(t)
        else:
            out.copy_(t)

    def _results(self, slots: _Slots, needs_params: Sequence[bool]) -> list[torch.Tensor | None]:
        present = [sl for p, sl in zip(self._named.flat(), slots.flat()) if p is not None]
        return [
            sl.result() if (sl is not None and need) else None
            for sl, need in zip(present, needs_params)
        ]


_: type[TileEngine] = FastEngine  # mypy checks FastEngine against the TileEngine protocol
