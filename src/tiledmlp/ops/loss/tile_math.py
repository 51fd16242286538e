"""Per-tile math of the LM-head losses: what one tile of float32 logits contributes, and the
gradient with respect to those logits. The tile loop (ops/loss/tile_loop.py) forms the logits and turns
that gradient into d(hidden), d(W) and d(bias); these classes are the pluggable part.

Notation per tile: zf (n x V) the float32 logits (after soft-capping and temperature), lse their
logsumexp per row, p = softmax(zf), y the targets, v the rows that count (not ignore_index, not
masked out), u the class weights (ones without them), U = sum(u), V the vocabulary.

Cross-entropy, as torch.nn.functional.cross_entropy (label smoothing eps, class weights u):
    token loss = (1 - eps) * u[y] * (lse - zf[y]) + (eps / V) * sum_c u_c * (lse - zf_c)
                 + zeta * lse**2                      (z-loss, PaLM; zeta = 0 by default)
    reduction "mean" divides the first two terms by sum(u[y]) over counted rows (torch's rule) and
    the z-loss by the number of counted rows; "sum" adds; "none" keeps each row (0 if not counted).
    d(token loss)/d zf = p * ((1-eps) u[y] + (eps/V) U + 2 zeta lse) - (1-eps) u[y] e_y - (eps/V) u
Log-probabilities of given tokens and the entropy (RL):
    logprob = zf[y] - lse,  d/dzf = e_y - p
    entropy = lse - sum_c p_c zf_c,  d/dzf = -p * (zf - lse + entropy)
  and, recorded without gradient (RL trainers' metrics and weights):
    log_sum_sq_probs = log(sum_c p_c**2) = logsumexp(2 zf) - 2 lse
    mean_logits = mean_c zf_c
    is_top1 = (argmax_c zf_c == y)   (the first maximum, as torch.argmax)

Invariant: values and gradients are float32 (float64 for float64 inputs); a row that does not
count contributes exactly zero to every value, also when its logits are not finite (padding
positions may carry NaN: selected away, never multiplied by zero), and its gradient follows
torch's cross_entropy / log_softmax: zero for finite logits, NaN where the logits are NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["STATS", "CrossEntropyMath", "LogprobMath", "TileMath"]


class TileMath:
    """Base: per-tile values, and d(sum of values x upstream)/d(logits)."""

    #: outputs per token (written at the tile's rows), or None for summed scalars
    per_token: bool = False

    def values(
        self, zf: torch.Tensor, lse: torch.Tensor, y: torch.Tensor, v: torch.Tensor, rows: slice
    ) -> None:
        """Accumulates the tile's values (zf is not modified)."""
        raise NotImplementedError

    def grad(
        self,
        zf: torch.Tensor,
        lse: torch.Tensor,
        y: torch.Tensor,
        v: torch.Tensor,
        upstream: list[torch.Tensor | None] | None,
    ) -> torch.Tensor:
        """d/d(zf) of the tile's values weighted by `upstream` (per-token outputs: one (n,)
        gradient per output, None for an output that got none; scalars: None, the scales are
        built in). May overwrite zf and return it."""
        raise NotImplementedError

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

    def values(
        self, zf: torch.Tensor, lse: torch.Tensor, y: torch.Tensor, v: torch.Tensor, rows: slice
    ) -> None:
        uy = self._uy(y, v)  # 0 on rows that do not count
        nll = lse - zf.gather(1, y.unsqueeze(1)).squeeze(1)
        token = self.a * uy * nll
        if self.label_smoothing:
            weighted = zf.sum(dim=-1) if self.class_weight is None else zf @ self.class_weight
            token = token + self.b * (lse * self.u_total - weighted)
        # selected, not multiplied: a row that does not count may hold NaN logits (padding)
        zero = token.new_zeros(())
        token = torch.where(v, token, zero)
        z_term = torch.where(v, self.c * lse * lse, zero) if self.z_loss else None
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
            self.argmax[rows] = zf.argmax(dim=-1)

    def grad(
        self,
        zf: torch.Tensor,
        lse: torch.Tensor,
        y: torch.Tensor,
        v: torch.Tensor,
        upstream: list[torch.Tensor | None] | None,
    ) -> torch.Tensor:
        g = v.to(self.dtype)
        if upstream is not None:
            up = upstream[0]
            g = g * (up.to(self.dtype) if up is not None else 0.0)
        uy = g if self.class_weight is None else self.class_weight[y] * g
        coef = self.a * uy
        if self.label_smoothing:
            coef = coef + self.b * self.u_total * g
        if self.z_loss:
            coef = coef + 2.0 * self.c * lse * g
        p = zf.sub_(lse.unsqueeze(1)).exp_()
        p.mul_(coef.unsqueeze(1))
        p.scatter_add_(1, y.unsqueeze(1), (-self.a * uy).unsqueeze(1))
        if self.label_smoothing:
            if self.class_weight is None:
                p.sub_((self.b * g).unsqueeze(1))
            else:
                p.sub_((self.b * g).unsqueeze(1) * self.class_weight.unsqueeze(0))
        return p


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

    def _record_stats(
        self, zf: torch.Tensor, lse: torch.Tensor, y: torch.Tensor, v: torch.Tensor, rows: slice
    ) -> None:
        zero = lse.new_zeros(())  # where, not a product: a padded row's logits may be NaN
        rec = self.recorded
        if "log_sum_sq_probs" in rec:
            sq = torch.logsumexp(zf * 2, dim=-1) - 2 * lse
            rec["log_sum_sq_probs"][rows] = torch.where(v, sq, zero)
        if "mean_logits" in rec:
            rec["mean_logits"][rows] = torch.where(v, zf.mean(dim=-1), zero)
        if "is_top1" in rec:
            rec["is_top1"][rows] = (zf.argmax(dim=-1) == y) & v

    def outputs(self) -> tuple[torch.Tensor, ...]:
        if self.entropies is None:
            return (self.logprobs,)
        return (self.logprobs, self.entropies)

    def _entropy(self, zf: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        p = (zf - lse.unsqueeze(1)).exp_()
        return lse - p.mul_(zf).sum(dim=-1)

    def values(
        self, zf: torch.Tensor, lse: torch.Tensor, y: torch.Tensor, v: torch.Tensor, rows: slice
    ) -> None:
        zero = lse.new_zeros(())
        self.logprobs[rows] = torch.where(v, zf.gather(1, y.unsqueeze(1)).squeeze(1) - lse, zero)
        if self.entropies is not None:
            self.entropies[rows] = torch.where(v, self._entropy(zf, lse), zero)
        if self.recorded:
            self._record_stats(zf, lse, y, v, rows)

    def grad(
        self,
        zf: torch.Tensor,
        lse: torch.Tensor,
        y: torch.Tensor,
        v: torch.Tensor,
        upstream: list[torch.Tensor | None] | None,
    ) -> torch.Tensor:
        # d/dzf = g_lp * (e_y - p) - g_h * p * (log p + H), built in place: two (n x V) tensors
        assert upstream is not None
        vf = v.to(self.dtype)
        g_lp = vf * (0.0 if upstream[0] is None else upstream[0].to(self.dtype))
        g_h = None
        if self.entropy and len(upstream) > 1 and upstream[1] is not None:
            g_h = upstream[1].to(self.dtype) * vf
        ent = self._entropy(zf, lse) if g_h is not None else None
        logp = zf.sub_(lse.unsqueeze(1))  # in place: zf is not needed again
        p = logp.exp()
        if g_h is not None and ent is not None:
            coef = logp.add_(ent.unsqueeze(1)).mul_(g_h.unsqueeze(1))  # (log p + H) * g_h
            out = coef.add_(g_lp.unsqueeze(1)).mul_(p).neg_()
            del p
        else:
            del logp
            out = p.mul_(g_lp.neg().unsqueeze(1))
        out.scatter_add_(1, y.unsqueeze(1), g_lp.unsqueeze(1))
        return out
