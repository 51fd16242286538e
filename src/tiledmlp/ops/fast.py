"""Minimal-recompute tile math for recognised MLPs (gated, fused gated, plain two-layer).

Cost model, with N tokens, hidden h, intermediate m and U = 2*N*h*m FLOPs (one full GEMM):
- gated / fused gated: forward 3U, backward 5U + recompute of the first projections 2U (gate and
  up; one GEMM when they are fused) = 11U per step, against 9U untiled. The down projection is
  never recomputed.
- plain: forward 2U, backward 4U + recompute 1U = 7U, against 6U untiled.
Memory: the forward keeps nothing but the output. The backward holds, per tile of n tokens,
about 5*n*m elements (gated) or 4*n*m (plain) in the compute dtype, plus one float32 accumulator
per weight when weights or compute are lower precision than float32.

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

import torch
import torch.nn.functional as F

from tiledmlp.ops import glu_kernels
from tiledmlp.ops.backend import LOCAL, ParamBackend
from tiledmlp.ops.grads import GradSlot, Scratch
from tiledmlp.ops.state import AutocastState
from tiledmlp.ops.structure import MLPKind, MLPStructure
from tiledmlp.ops.tiles import TilePlan

__all__ = ["FastEngine"]


def _mm_into(
    out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
) -> torch.Tensor:
    """out = x @ w.T (+ b), the same GEMM F.linear runs, written into `out`."""
    if b is None:
        return torch.mm(x, w.t(), out=out)
    return torch.addmm(b, x, w.t(), out=out)


class FastEngine:
    """Tiled forward and backward for a recognised MLP structure.

    Args:
        structure: the recognised MLP.
        autocast: autocast settings captured when the forward ran.
        backend: how the module's parameters are made whole (ops/backend.py); the caller
            gathers `weights` around the forward and the backward.
        kernels: whether the fused elementwise kernels may be used (False: PyTorch only).
    """

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
        self._slots = structure.params()  # weight, bias per linear; None where no bias
        self.params: list[torch.Tensor] = [p for p in self._slots if p is not None]
        self.weights = self.params  # every parameter the computation uses (all are inputs)
        gated = structure.kind in (MLPKind.GATED, MLPKind.FUSED_GATED)
        self.glu = glu_kernels.activation_kind(structure.act) if gated else None

    def _fused(self, t: torch.Tensor) -> str | None:
        """The activation kind for the fused elementwise kernels, or None for PyTorch."""
        if self.glu is None or not self.kernels or not glu_kernels.kernels_available(t.device):
            return None
        return self.glu

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
        # The tensors this engine captured (_slots: weight, bias per linear, the down projection
        # last), never `lin.weight` again: a parametrized weight (spectral norm in training)
        # would run its parametrization, and its power iteration, once more.
        pairs = list(zip(self._slots[0::2], self._slots[1::2], strict=True))
        first = [p for pair in pairs[:-1] for p in pair if p is not None]
        x_grad = x.requires_grad and torch.is_grad_enabled()
        hidden_grad = x_grad or any(p.requires_grad for p in first)
        keeps = {id(p): False for p in self.params}
        for i, (weight, _) in enumerate(pairs):
            assert weight is not None  # every linear has a weight
            cast = self.autocast.compute_dtype(x.dtype, weight.dtype)
            copied = cast is not None and cast != weight.dtype
            input_grad = hidden_grad if i == len(pairs) - 1 else x_grad
            keeps[id(weight)] = input_grad and not copied
        return keeps

    def _cast(self, dtype: torch.dtype) -> list[torch.Tensor | None]:
        return [None if p is None else p.to(dtype) for p in self._slots]

    def _act(self, g: torch.Tensor) -> torch.Tensor:
        if not self.autocast.enabled:
            return self.structure.act(g)  # every caller already runs with autocast off
        with self.autocast.restore():
            return self.structure.act(g)

    def _halves(self, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.structure.intermediate_size
        first, second = gu[:, :m], gu[:, m:]
        return (first, second) if self.structure.gate_first else (second, first)

    # -- forward -----------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, plan: TilePlan) -> torch.Tensor:
        """Tiled forward without keeping intermediates.

        Args:
            x: (tokens, hidden).
            plan: the tile split of the tokens.

        Returns:
            (tokens, output_size) in the compute dtype.
        """
        s = self.structure
        cd = self.compute_dtype(x)
        w = self._cast(cd)
        out = torch.empty((x.shape[0], s.output_size), dtype=cd, device=x.device)
        kind = self._fused(x)
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            for start, stop in plan.bounds():
                self._forward_tile(x[start:stop].to(cd), w, out[start:stop], kind)
        return out

    def _forward_tile(
        self, xt: torch.Tensor, w: list[torch.Tensor | None], out: torch.Tensor, kind: str | None
    ) -> None:
        if self.structure.kind is MLPKind.PLAIN:
            h = self._act(F.linear(xt, w[0], w[1]))  # type: ignore[arg-type]
        else:
            g, u, _ = self._gate_up(xt, w)
            if kind is not None:
                h = glu_kernels.glu_forward(g, u, kind, out=g)
            else:
                h = self._act(g).mul_(u)
        _mm_into(out, h.to(xt.dtype), w[-2], w[-1])  # type: ignore[arg-type]

    def _gate_up(
        self, xt: torch.Tensor, w: list[torch.Tensor | None]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(g, u, gu) of a gated tile: for a fused gate_up, g and u are the two halves of one
        GEMM's result gu; else gu is None."""
        if self.structure.kind is MLPKind.GATED:
            g = F.linear(xt, w[0], w[1])  # type: ignore[arg-type]
            return g, F.linear(xt, w[2], w[3]), None  # type: ignore[arg-type]
        gu = F.linear(xt, w[0], w[1])  # type: ignore[arg-type]
        return (*self._halves(gu), gu)

    def recompute_tile(self, xt: torch.Tensor) -> torch.Tensor:
        """One tile's output under autograd, for a graph of the backward (create_graph=True):
        the forward's GEMMs and activation, differentiable in xt and the parameters.

        Args:
            xt: (n, hidden), part of the autograd graph.

        Returns:
            (n, output_size) in the compute dtype, with its graph.
        """
        s = self.structure
        cd = self.compute_dtype(xt)
        w = self._cast(cd)
        with torch.enable_grad(), torch.autocast(xt.device.type, enabled=False):
            x = xt.to(cd)
            if s.kind is MLPKind.GATED:
                h = self._act(F.linear(x, w[0], w[1])) * F.linear(x, w[2], w[3])  # type: ignore[arg-type]
            elif s.kind is MLPKind.FUSED_GATED:
                g, u = self._halves(F.linear(x, w[0], w[1]))  # type: ignore[arg-type]
                h = self._act(g) * u
            else:
                h = self._act(F.linear(x, w[0], w[1]))  # type: ignore[arg-type]
            return F.linear(h.to(cd), w[-2], w[-1])  # type: ignore[arg-type]

    # -- backward ----------------------------------------------------------------------------

    def backward(
        self,
        x: torch.Tensor,
        grad_out: torch.Tensor,
        plan: TilePlan,
        needs_x: bool,
        needs_params: Sequence[bool],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """Recomputes the first projection(s) per tile and accumulates every gradient once.

        Per tile of n tokens the live intermediates peak at five (n, m) tensors (gated) or four
        (plain): the recomputed projection(s), the activation (reused in place as its own
        gradient), the activation's re-evaluation for its derivative, and that derivative.

        Args:
            x: (tokens, hidden), the forward input.
            grad_out: (tokens, output_size), gradient of the output.
            plan: the same tile split the forward used.
            needs_x: whether to return a gradient for x.
            needs_params: per entry of `self.params`, whether it needs a gradient.

        Returns:
            (dx of shape (tokens, hidden) in x's dtype or None, per-parameter gradients or None).
        """
        cd = self.compute_dtype(x)
        w = self._cast(cd)
        need_iter = iter(needs_params)
        scratch = Scratch()
        single = plan.num_tiles == 1
        slots: list[GradSlot | None] = [
            None if p is None else (GradSlot(p, cd, scratch, single) if next(need_iter) else None)
            for p in self._slots
        ]
        need_up = needs_x or any(sl is not None for sl in slots[:-2])
        dx = torch.empty_like(x) if needs_x else None
        kind = self._fused(x)
        tile = self._backward_tile if kind is None else self._backward_tile_fused

        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
            for start, stop in plan.bounds():
                # One call per tile: its temporaries die on return, before the next tile's exist.
                tile(
                    x[start:stop].to(cd),
                    grad_out[start:stop].to(cd),
                    w,
                    slots,
                    need_up,
                    None if dx is None else dx[start:stop],
                    kind,
                )
        return dx, self._results(slots, needs_params)

    def _backward_tile(
        self,
        xt: torch.Tensor,
        dyt: torch.Tensor,
        w: list[torch.Tensor | None],
        slots: list[GradSlot | None],
        need_up: bool,
        dxt: torch.Tensor | None,
        kind: str | None = None,
    ) -> None:
        """One tile's backward through PyTorch and the module's own activation."""
        s = self.structure
        cd = xt.dtype
        if s.kind is MLPKind.PLAIN:
            g, u, gu = F.linear(xt, w[0], w[1]), None, None  # type: ignore[arg-type]
        else:
            g, u, gu = self._gate_up(xt, w)

        a = self._act(g.clone() if s.act_in_place else g).to(cd)
        h = a if u is None else a * u  # the down projection's input
        self._down_grads(slots, dyt, h)
        if not need_up:
            return
        if u is None:
            del a, h
            dz = self._act_grad(g, torch.mm(dyt, w[-2]))  # type: ignore[arg-type]
            self._input_grads(slots, xt, w, dxt, dz)
            return
        dh = torch.mm(dyt, w[-2], out=h)  # type: ignore[arg-type]
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
            self._input_grads(slots, xt, w, dxt, gu)
        else:
            self._input_grads(slots, xt, w, dxt, dg, du)

    def _backward_tile_fused(
        self,
        xt: torch.Tensor,
        dyt: torch.Tensor,
        w: list[torch.Tensor | None],
        slots: list[GradSlot | None],
        need_up: bool,
        dxt: torch.Tensor | None,
        kind: str | None,
    ) -> None:
        """_backward_tile with the fused elementwise kernels (gated MLPs with an activation of
        `kind`): three (n, m) tensors at most."""
        assert kind is not None  # chosen by backward() only for a recognised activation
        g, u, gu = self._gate_up(xt, w)
        if not need_up:
            self._down_grads(slots, dyt, glu_kernels.glu_forward(g, u, kind, out=g))
            return
        dh = torch.mm(dyt, w[-2])  # type: ignore[arg-type]
        glu_kernels.glu_backward(g, u, dh, kind, h_out=dh)  # g <- dg, u <- du, dh <- h
        self._down_grads(slots, dyt, dh)
        del dh
        if gu is not None:  # dg and du were written over its halves: [dg | du] in its layout
            self._input_grads(slots, xt, w, dxt, gu)
        else:
            self._input_grads(slots, xt, w, dxt, g, u)

    @staticmethod
    def _down_grads(slots: list[GradSlot | None], dyt: torch.Tensor, h: torch.Tensor) -> None:
        """The down projection's weight (dy^T h) and bias gradients of a tile."""
        if slots[-2] is not None:
            slots[-2].add_mm(dyt.t(), h)
        if slots[-1] is not None:
            slots[-1].add_rows(dyt)

    def _input_grads(
        self,
        slots: list[GradSlot | None],
        xt: torch.Tensor,
        w: list[torch.Tensor | None],
        dxt: torch.Tensor | None,
        d1: torch.Tensor,
        d2: torch.Tensor | None = None,
    ) -> None:
        """The first projection(s)' gradients and dx of a tile, from d1 (the gradient of the
        first linear's output: dz, dg, or [dg | du] in a fused gate_up's layout) and d2 (du of
        a separate up projection)."""
        self._first_grads(slots[0], slots[1], d1, xt)
        if d2 is not None:
            self._first_grads(slots[2], slots[3], d2, xt)
        if dxt is not None:
            self._dx_into(dxt, d1, w[0], d2, None if d2 is None else w[2])  # type: ignore[arg-type]

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
        w_slot: GradSlot | None, b_slot: GradSlot | None, dz: torch.Tensor, xt: torch.Tensor
    ) -> None:
        if w_slot is not None:
            w_slot.add_mm(dz.t(), xt)
        if b_slot is not None:
            b_slot.add_rows(dz)

    @staticmethod
    def _dx_into(
        out: torch.Tensor,
        d1: torch.Tensor,
        w1: torch.Tensor,
        d2: torch.Tensor | None,
        w2: torch.Tensor | None,
    ) -> None:
        """out = d1 @ w1 (+ d2 @ w2), accumulated in the compute dtype, stored in out's dtype."""
        if out.dtype == d1.dtype:
            torch.mm(d1, w1, out=out)
            if d2 is not None:
                torch.addmm(out, d2, w2, out=out)  # type: ignore[arg-type]
            return
        t = torch.mm(d1, w1)
        if d2 is not None:
            torch.addmm(t, d2, w2, out=t)  # type: ignore[arg-type]
        out.copy_(t)

    def _results(
        self, slots: list[GradSlot | None], needs_params: Sequence[bool]
    ) -> list[torch.Tensor | None]:
        present = [sl for p, sl in zip(self._slots, slots) if p is not None]
        return [
            sl.result() if (sl is not None and need) else None
            for sl, need in zip(present, needs_params)
        ]
