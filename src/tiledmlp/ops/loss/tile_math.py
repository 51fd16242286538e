"""Per-tile math of the LM-head losses: what one tile of logits contributes, and the gradient
with respect to those logits. The tile loop (ops/loss/tile_loop.py) forms the logits and their
log-softmax and turns that gradient into d(hidden), d(W) and d(bias); these classes are the
pluggable part (passes over a tile: Note [one float32 tensor per tile], ops/loss/tile_loop.py).

Invariant: values and gradients are computed in float32 (float64 for float64 inputs) and each
gradient entry is rounded once to the compute dtype; a row that does not count contributes
exactly zero to every value, also when its logits are not finite (padding positions may carry
NaN: selected away, never multiplied by zero), and its gradient follows torch's cross_entropy /
log_softmax: zero for finite logits, NaN where the logits are NaN.

Note: how it works, its costs and its choices are in
docs/how-it-works/module-notes.md#ops-loss-tile-math.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

__all__ = ["STATS", "CrossEntropyMath", "Factored", "LogprobMath", "TileLogits", "TileMath"]


class TileLogits:
    """One tile's logits as the math reads them.

    Attributes:
        lp: (n, V) log_softmax of the logits, float32 at least; `grad` may overwrite it.
        logits: (n, V) the logits zf it came from (compute dtype, or float32 with a
            temperature), or None when the math does not read them (TileMath.reads_logits);
            read only for lse, the argmax and mean_logits (the loop drops them before the
            gradient, `drop_logits`).
        y: (n,) int64 targets, 0 on rows that do not count.
        v: (n,) bool, the rows that count.
    """

    def __init__(
        self, lp: torch.Tensor, logits: torch.Tensor | None, y: torch.Tensor, v: torch.Tensor
    ):
        self.lp, self.logits, self.y, self.v = lp, logits, y, v
        self._lp_y: torch.Tensor | None = None
        self._max: tuple[torch.Tensor, torch.Tensor] | None = None
        self._lse: torch.Tensor | None = None

    @property
    def lp_y(self) -> torch.Tensor:
        """(n,) lp[y], gathered once (before `grad` overwrites lp)."""
        if self._lp_y is None:
            self._lp_y = self.lp.gather(1, self.y.unsqueeze(1)).squeeze(1)
        return self._lp_y

    def _row_max(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._max is None:
            assert self.logits is not None, "TileMath.reads_logits must be set to read them"
            values, index = torch.max(self.logits, dim=-1)  # the first maximum, as argmax
            self._max = values, index
        return self._max

    @property
    def argmax(self) -> torch.Tensor:
        """(n,) int64 argmax of the logits (the first maximum, as torch.argmax)."""
        return self._row_max()[1]

    @property
    def lse(self) -> torch.Tensor:
        """(n,) logsumexp of the logits: max - lp[argmax] (lp is close to 0 there, so this
        loses nothing to cancellation). Computed before `grad` overwrites lp."""
        if self._lse is None:
            values, index = self._row_max()
            lp_max = self.lp.gather(1, index.unsqueeze(1)).squeeze(1)
            self._lse = values.to(self.lp.dtype) - lp_max
        return self._lse

    def drop_logits(self, keep_lse: bool) -> None:
        """Lets go of the logits once the values are recorded (lse first, if still wanted)."""
        if keep_lse:
            _ = self.lse
        self.logits = None


class Factored(NamedTuple):
    """A tile's d/d(logits) as alpha * diag(v) @ p (see Note [the factored gradient]).

    Attributes:
        p: (n, V) softmax in the compute dtype, the targets' entries p[y] - 1; every entry
            rounded once.
        alpha: the constant coefficient of every counted row (the same for every tile).
    """

    p: torch.Tensor
    alpha: float


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.unsqueeze(1)


def _written(p: torch.Tensor, coef: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """p * coef (per row) in `dtype`, rounded once: in place when no cast is needed."""
    if p.dtype == dtype:
        return p.mul_(_rows(coef))
    return torch.mul(p, _rows(coef), out=torch.empty(p.shape, dtype=dtype, device=p.device))


class TileMath:
    """Base: per-tile values, and d(sum of values x upstream)/d(logits)."""

    #: outputs per token (written at the tile's rows), or None for summed scalars
    per_token: bool = False
    #: whether `values` or `grad` read TileLogits.logits (lse, argmax, their mean); if not,
    #: the loop lets go of the logits as soon as their log-softmax exists
    reads_logits: bool = False
    #: whether `grad` reads TileLogits.lse (formed before the loop drops the logits)
    needs_lse: bool = False

    def values(self, t: TileLogits, rows: slice) -> None:
        """Accumulates the tile's values (t.lp is not modified)."""
        raise NotImplementedError

    def grad(
        self,
        t: TileLogits,
        upstream: list[torch.Tensor | None] | None,
        scale: float,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """scale x d/d(zf) of the tile's values weighted by `upstream` (per-token outputs: one
        (n,) gradient per output, None for an output that got none; scalars: None, the scales
        are built in), as an (n, V) tensor of `dtype`, each entry rounded once. May overwrite
        t.lp."""
        raise NotImplementedError

    def factored(self, t: TileLogits, scale: float, dtype: torch.dtype) -> Factored | None:
        """The scalar maths' gradient as a Factored, where every counted row's coefficient is
        the same constant; None otherwise (then `grad`). May overwrite t.lp."""
        del t, scale, dtype
        return None

    def total(self) -> torch.Tensor:
        """The scalar output (scalar maths)."""
        raise NotImplementedError

    def outputs(self) -> tuple[torch.Tensor, ...]:
        """The per-token outputs (per-token maths)."""
        raise NotImplementedError


@dataclass
class CrossEntropyMath(TileMath):
    """Cross-entropy with label smoothing, class weights and z-loss (see the module docstring).

    Attributes:
        reduction: "mean", "sum" or "none".
        label_smoothing: eps in [0, 1].
        class_weight: (V,) float32 class weights u, or None (ones).
        z_loss: zeta >= 0.
        weight_total: sum of u[y] over counted rows (the "mean" denominator of the first terms).
        count: counted rows (the "mean" denominator of the z-loss).
        want_argmax: also record each row's argmax (predictions, accuracy).
    """

    reduction: str
    label_smoothing: float
    class_weight: torch.Tensor | None
    z_loss: float
    weight_total: float
    count: int
    vocab: int
    num_tokens: int
    device: torch.device
    dtype: torch.dtype
    want_argmax: bool = False
    loss_sum: torch.Tensor = field(init=False)
    z_sum: torch.Tensor = field(init=False)
    token_loss: torch.Tensor | None = field(init=False, default=None)
    token_z: torch.Tensor | None = field(init=False, default=None)
    argmax: torch.Tensor | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.per_token = self.reduction == "none"
        zeros = torch.zeros((), dtype=self.dtype, device=self.device)
        self.loss_sum, self.z_sum = zeros.clone(), zeros.clone()
        if self.per_token:
            self.token_loss = torch.zeros(self.num_tokens, dtype=self.dtype, device=self.device)
            if self.z_loss:
                self.token_z = torch.zeros_like(self.token_loss)
        if self.want_argmax:
            self.argmax = torch.zeros(self.num_tokens, dtype=torch.int64, device=self.device)
        eps = self.label_smoothing
        mean = self.reduction == "mean"
        # scales of the three terms (the "mean" denominators folded in for scalar reductions)
        s_w = 1.0 / self.weight_total if mean and self.weight_total else 1.0
        s_c = 1.0 / self.count if mean and self.count else 1.0
        self.a = (1.0 - eps) * s_w
        self.b = eps / self.vocab * s_w
        self.c = self.z_loss * s_c
        self.u_total = (
            float(self.vocab) if self.class_weight is None else float(self.class_weight.sum())
        )
        self.needs_lse = bool(self.z_loss)
        self.reads_logits = self.needs_lse or self.want_argmax

    def total(self) -> torch.Tensor:
        # torch's "mean" with nothing counted (or zero total class weight) is 0 / 0 = nan
        if self.reduction == "mean" and not (self.weight_total and self.count):
            return self.loss_sum / 0.0
        return self.loss_sum + self.z_sum

    def z_value(self) -> torch.Tensor:
        """The z-loss term inside the loss, reduced like it (per token for "none")."""
        if self.per_token:
            return self.token_z if self.token_z is not None else torch.zeros_like(self.token_loss)  # type: ignore[arg-type]
        return self.z_sum.clone()

    def outputs(self) -> tuple[torch.Tensor, ...]:
        assert self.token_loss is not None
        return (self.token_loss,)

    def _uy(self, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.class_weight is None:
            return v.to(self.dtype)
        return self.class_weight[y] * v.to(self.dtype)

    def values(self, t: TileLogits, rows: slice) -> None:
        y, v = t.y, t.v
        uy = self._uy(y, v)  # 0 on rows that do not count
        token = self.a * uy * -t.lp_y
        if self.label_smoothing:
            weighted = t.lp.sum(dim=-1) if self.class_weight is None else t.lp @ self.class_weight
            token = token - self.b * weighted
        # selected, not multiplied: a row that does not count may hold NaN logits (padding)
        zero = token.new_zeros(())
        token = torch.where(v, token, zero)
        z_term = None
        if self.z_loss:
            lse = t.lse
            z_term = torch.where(v, self.c * lse * lse, zero)
        if self.per_token:
            assert self.token_loss is not None
            self.token_loss[rows] = token if z_term is None else token + z_term
            if z_term is not None and self.token_z is not None:
                self.token_z[rows] = z_term
        else:
            self.loss_sum += token.sum()
            if z_term is not None:
                self.z_sum += z_term.sum()
        if self.argmax is not None:
            self.argmax[rows] = t.argmax

    def factored(self, t: TileLogits, scale: float, dtype: torch.dtype) -> Factored | None:
        # without class weights, smoothing or z-loss, a counted row's coefficient is a * scale
        if self.class_weight is not None or self.label_smoothing or self.z_loss:
            return None
        at_y = t.lp_y.exp() - 1.0  # from lp[y] before lp is overwritten
        lp = t.lp
        if lp.dtype == dtype:
            p = lp.exp_()
        else:  # exp and the cast in one pass
            p = torch.exp(lp, out=torch.empty(lp.shape, dtype=dtype, device=lp.device))
        p.scatter_(1, _rows(t.y), _rows(at_y.to(dtype)))
        return Factored(p, self.a * scale)

    def grad(
        self,
        t: TileLogits,
        upstream: list[torch.Tensor | None] | None,
        scale: float,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        y, v = t.y, t.v
        g = v.to(t.lp.dtype)
        if upstream is not None:
            up = upstream[0]
            g = g * (up.to(t.lp.dtype) if up is not None else 0.0)
        g = g * scale
        uy = g if self.class_weight is None else self.class_weight[y] * g
        coef = self.a * uy
        if self.label_smoothing:
            coef = coef + self.b * self.u_total * g
        if self.z_loss:
            coef = coef + 2.0 * self.c * t.lse * g
        # the target's entry, from lp[y] before lp is overwritten
        at_y = coef * t.lp_y.exp() - self.a * uy
        smooth = None
        if self.label_smoothing:
            smooth = self.b * g
            if self.class_weight is not None:
                at_y = at_y - smooth * self.class_weight[y]
            else:
                at_y = at_y - smooth
        p = t.lp.exp_()  # in place: lp is not needed again
        if smooth is None:
            dz = _written(p, coef, dtype)
        else:  # the smoothing term is dense: subtracted before the one rounding
            p.mul_(_rows(coef))
            u = self.class_weight
            p.sub_(_rows(smooth) if u is None else _rows(smooth) * u.unsqueeze(0))
            dz = p.to(dtype)
        return dz.scatter_(1, _rows(y), _rows(at_y.to(dtype)))


#: the statistics LogprobMath can record besides the differentiable outputs
STATS = ("log_sum_sq_probs", "mean_logits", "is_top1")


@dataclass
class LogprobMath(TileMath):
    """Per-token log-probabilities of the given tokens, optionally the entropy, and optionally
    statistics without gradient (`stats`, names from STATS; zero / False on rows that do not
    count)."""

    num_tokens: int
    device: torch.device
    dtype: torch.dtype
    entropy: bool = False
    stats: tuple[str, ...] = ()
    logprobs: torch.Tensor = field(init=False)
    entropies: torch.Tensor | None = field(init=False, default=None)
    recorded: dict[str, torch.Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.per_token = True
        self.logprobs = torch.zeros(self.num_tokens, dtype=self.dtype, device=self.device)
        if self.entropy:
            self.entropies = torch.zeros_like(self.logprobs)
        for name in self.stats:
            if name not in STATS:
                raise ValueError(f"unknown statistic {name!r}; expected one of {STATS}")
            dtype = torch.bool if name == "is_top1" else self.dtype
            self.recorded[name] = torch.zeros(self.num_tokens, dtype=dtype, device=self.device)
        self.reads_logits = "mean_logits" in self.stats or "is_top1" in self.stats

    def _record_stats(self, t: TileLogits, rows: slice) -> None:
        v = t.v
        zero = t.lp.new_zeros(())  # where, not a product: a padded row's logits may be NaN
        rec = self.recorded
        if "log_sum_sq_probs" in rec:
            sq = torch.logsumexp(t.lp * 2, dim=-1)
            rec["log_sum_sq_probs"][rows] = torch.where(v, sq, zero)
        if "mean_logits" in rec:
            assert t.logits is not None
            mean = t.logits.mean(dim=-1, dtype=t.lp.dtype)
            rec["mean_logits"][rows] = torch.where(v, mean, zero)
        if "is_top1" in rec:
            rec["is_top1"][rows] = (t.argmax == t.y) & v

    def outputs(self) -> tuple[torch.Tensor, ...]:
        if self.entropies is None:
            return (self.logprobs,)
        return (self.logprobs, self.entropies)

    @staticmethod
    def _entropy(lp: torch.Tensor) -> torch.Tensor:
        return -(lp.exp().mul_(lp).sum(dim=-1))

    def values(self, t: TileLogits, rows: slice) -> None:
        v = t.v
        zero = t.lp.new_zeros(())
        self.logprobs[rows] = torch.where(v, t.lp_y, zero)
        if self.entropies is not None:
            self.entropies[rows] = torch.where(v, self._entropy(t.lp), zero)
        if self.recorded:
            self._record_stats(t, rows)

    def grad(
        self,
        t: TileLogits,
        upstream: list[torch.Tensor | None] | None,
        scale: float,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        # d/dzf = g_lp * (e_y - p) - g_h * p * (lp + H)
        assert upstream is not None
        wide = t.lp.dtype
        vf = t.v.to(wide) * scale
        g_lp = vf * (0.0 if upstream[0] is None else upstream[0].to(wide))
        g_h = None
        if self.entropy and len(upstream) > 1 and upstream[1] is not None:
            g_h = upstream[1].to(wide) * vf
        if g_h is None:
            # the target's entry g_lp * (1 - p[y]), from lp[y] before lp is overwritten
            at_y = g_lp - g_lp * t.lp_y.exp()
            dz = _written(t.lp.exp_(), g_lp.neg(), dtype)
            return dz.scatter_(1, _rows(t.y), _rows(at_y.to(dtype)))
        ent = self._entropy(t.lp)
        lp = t.lp
        p = lp.exp()
        coef = lp.add_(_rows(ent)).mul_(_rows(g_h))  # (lp + H) * g_h, in place
        out = coef.add_(_rows(g_lp)).mul_(p).neg_()
        del p
        out.scatter_add_(1, _rows(t.y), _rows(g_lp))
        return out.to(dtype)
