"""Tiled LM-head losses: a long sequence's logits never exist at once.

`tiled_cross_entropy` is torch.nn.functional.cross_entropy of the LM head's logits (label
smoothing, class weights, ignore_index, reductions "mean" / "sum" / "none", as there) plus a
z-loss, an explicit token mask, token accuracy and predictions; `tiled_token_logprobs` gives the
per-token log-probabilities of given tokens and the entropy, with a temperature, for RL
fine-tuning; `tiled_token_stats` adds a logit scale and the statistics RL trainers log. Both run one tile loop (ops/loss/tile_loop.py) with per-tile math (ops/loss/tile_math.py).

Cost, with L = 2 * tokens * hidden * vocab: a loss reduced by "mean" or "sum" costs 3L FLOPs per
training step (the untiled cost: its gradient is formed in the forward); per-token outputs cost
4L (the backward recomputes each tile's logits, since every token has its own upstream
gradient); without gradients 1L. Memory: one tile of logits at a time.

Invariants: the numerics follow the untiled path (logits and soft-capping in the compute dtype,
the softmax in float32); "mean" divides by the counted tokens of the whole input (by the sum of
their class weights with `weight`, as torch does); a token that is ignored or masked out
contributes exactly zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from tiledmlp.ops.loss import operator
from tiledmlp.ops.loss.inputs import (
    HeadInput,
    check_inputs,
    loss_plan,
    shift_labels,
    targets_of,
)
from tiledmlp.ops.loss.scoring import Scoring, cross_entropy_math
from tiledmlp.ops.loss.tile_loop import HeadRun, run_head
from tiledmlp.ops.loss.tile_math import STATS, CrossEntropyMath, LogprobMath
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.ops.tiling.state import AutocastState
from tiledmlp.ops.tiling.values import check_positive_number

__all__ = [
    "CrossEntropyOutput",
    "TokenStats",
    "shift_labels",
    "tiled_cross_entropy",
    "tiled_token_logprobs",
    "tiled_token_stats",
]


class CrossEntropyOutput(NamedTuple):
    """What tiled_cross_entropy(..., return_aux=True) returns.

    Attributes:
        loss: the loss (as without return_aux), z-loss included.
        z_loss: the z-loss term inside `loss`, reduced like it, without gradient (for logging).
        accuracy: fraction of counted tokens whose argmax logit is the label (float32 scalar;
            nan with none counted), without gradient.
        predictions: the argmax token of every position, labels' shape (int64).
    """

    loss: torch.Tensor
    z_loss: torch.Tensor
    accuracy: torch.Tensor
    predictions: torch.Tensor


def tiled_cross_entropy(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    num_tiles: int | str | TilePolicy = "auto",
    tile_tokens: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    shift: bool = False,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    label_smoothing: float = 0.0,
    weight: torch.Tensor | None = None,
    z_loss: float = 0.0,
    mask: torch.Tensor | None = None,
    return_aux: bool = False,
) -> Any:
    """Cross-entropy of the LM head's logits without materialising more than one tile of them.

    Equals F.cross_entropy((hidden_states @ lm_head_weight.T + bias).float(), labels,
    weight=weight, ignore_index=ignore_index, reduction=reduction,
    label_smoothing=label_smoothing) (soft-capping applied to the logits first), plus
    z_loss * logsumexp(logits)**2 per counted token (reduced the same way; "mean" over counted
    tokens), with exact gradients for hidden_states, lm_head_weight and bias. The logits are
    logit_scale * (hidden_states @ lm_head_weight.T + bias), soft-capped after the scale (the
    order of Cohere's and Granite's scaled heads).

    Args:
        hidden_states: (batch, seq, hidden) or (tokens, hidden), floating point.
        lm_head_weight: (vocab, hidden).
        labels: (batch, seq) or (tokens,) class indices of any integer dtype (int64, int32,
            uint8, ...); ignore_index marks tokens without a target.
        bias: (vocab,) or None.
        num_tiles: a positive int, "auto" (tiles of hidden * elem / 4 tokens: their float32
            logits are about the size of the LM-head weight), or a TilePolicy of either.
        tile_tokens: tokens per tile, instead of num_tiles.
        ignore_index: label value that contributes nothing.
        reduction: "mean" over the counted tokens of the whole input (weighted by their class
            weights with `weight`; nan when nothing counts, as in torch), "sum", or "none"
            (one loss per position, labels' shape, 0 where not counted; its backward recomputes
            the logits: 4L instead of 3L FLOPs).
        shift: causal-LM shifting: position t is scored against labels[..., t + 1] and the last
            position of each sequence is ignored (what Hugging Face causal LMs do); `mask` is
            shifted with the labels.
        softcap: final-logit soft-capping, logits = tanh(logits / softcap) * softcap (Gemma 2);
            None or 0 for none.
        logit_scale: multiplies the logits before soft-capping, in the compute dtype (Cohere's
            logit_scale; 1 / logits_scaling for Granite and MiniCPM3); 1.0 for none.
        label_smoothing: in [0, 1], as in F.cross_entropy.
        weight: (vocab,) class weights, as in F.cross_entropy.
        z_loss: coefficient of the z-loss (PaLM: 1e-4), >= 0.
        mask: bool, labels' shape: False drops a token (as if its label were ignore_index).
        return_aux: return a CrossEntropyOutput (loss, z_loss, accuracy, predictions).

    Returns:
        The loss (float32; a scalar, or labels' shape for "none"), or a CrossEntropyOutput.

    Raises:
        TypeError / ValueError: wrong dtypes, shapes, reduction, option values or tile policy.
    """
    scoring = Scoring(reduction, label_smoothing, z_loss, return_aux)
    _check_logit_scale(logit_scale, "tiled_cross_entropy")
    request = CrossEntropyRequest(
        hidden_states=hidden_states, lm_head_weight=lm_head_weight, labels=labels, bias=bias,
        policy=TilePolicy.of(num_tiles, tile_tokens), scoring=scoring,
        ignore_index=ignore_index, shift=shift, softcap=softcap, logit_scale=logit_scale,
        weight=weight, mask=mask,
    )  # fmt: skip
    if torch.compiler.is_compiling():
        return _compiled_cross_entropy(request)
    return _eager_cross_entropy(request)


@dataclass(frozen=True, kw_only=True)
class CrossEntropyRequest:
    """One tiled_cross_entropy call as its eager and compiled paths take it: the tensors, the
    tile policy built and the options checked (tiled_cross_entropy's Args say what each is).

    Attributes:
        hidden_states: (batch, seq, hidden) or (tokens, hidden).
        lm_head_weight: (vocab, hidden).
        labels: (batch, seq) or (tokens,) class indices.
        bias: (vocab,) or None.
        policy: the loss's tile policy.
        scoring: the reduction and the terms of the loss.
        ignore_index: the label value that contributes nothing.
        shift: causal-LM shifting of the labels (and mask).
        softcap: final-logit soft-capping, None or 0 for none.
        logit_scale: multiplies the logits before soft-capping.
        weight: (vocab,) class weights, or None.
        mask: bool, labels' shape (False drops a token), or None.
    """

    hidden_states: torch.Tensor
    lm_head_weight: torch.Tensor
    labels: torch.Tensor
    bias: torch.Tensor | None
    policy: TilePolicy
    scoring: Scoring
    ignore_index: int
    shift: bool
    softcap: float | None
    logit_scale: float
    weight: torch.Tensor | None
    mask: torch.Tensor | None


def _eager_cross_entropy(r: CrossEntropyRequest) -> Any:
    """tiled_cross_entropy through the tile loop's autograd Functions (module docstring)."""
    reduction, return_aux = r.scoring.reduction, r.scoring.return_aux
    labels, weight = r.labels, r.weight
    check_inputs(r.hidden_states, r.lm_head_weight, labels, r.bias, r.softcap, r.mask, "labels")
    vocab = r.lm_head_weight.shape[0]
    _check_class_weight(weight, vocab)
    targets, counted = targets_of(
        labels, r.mask, r.shift, r.ignore_index, vocab, "tiled_cross_entropy"
    )
    head = HeadInput.of(r.hidden_states, r.lm_head_weight, r.policy)
    math_ = cross_entropy_math(r.scoring, head, targets, counted, weight, vocab)
    run = HeadRun(
        head.plan, targets, counted, r.softcap or None, 1.0, head.autocast, math_,
        float(r.logit_scale),
    )  # fmt: skip
    loss = run_head(head.hidden, run, r.lm_head_weight, r.bias)
    if reduction == "none":
        loss = loss.view(labels.shape)
    if not return_aux:
        return loss
    return _with_aux(loss, math_, targets, counted, labels.shape)


# See Note [compiled loss]
_eager_cross_entropy = torch.compiler.disable(_eager_cross_entropy)

# Note [compiled loss]
# ~~~~~~~~~~~~~~~~~~~~
# Under torch.compile, a loss reduced by "mean" or "sum" without return_aux is one call of the
# custom operator tiledmlp::lm_head_loss (ops/loss/operator.py): the labels' checks and the "mean"
# count read values, which only the operator's own (eager) body may do. Per-token reductions
# and return_aux run the eager function as one graph break; dynamo never resumes inside it.


def _compiled_cross_entropy(r: CrossEntropyRequest) -> Any:
    """tiled_cross_entropy as traced by torch.compile (Note [compiled loss])."""
    scoring, labels, mask, weight, w = r.scoring, r.labels, r.mask, r.weight, r.lm_head_weight
    if scoring.reduction == "none" or scoring.return_aux:
        return _eager_cross_entropy(r)
    check_inputs(r.hidden_states, w, labels, r.bias, r.softcap, mask, "labels")
    vocab = w.shape[0]
    _check_class_weight(weight, vocab)
    hidden = r.hidden_states.reshape(-1, r.hidden_states.shape[-1])
    autocast = AutocastState.capture(hidden.device.type)
    cd = autocast.compute_dtype(hidden.dtype, w.dtype) or hidden.dtype
    elem = _ELEMENT_SIZES.get(cd, 4)
    plan = loss_plan(hidden.shape[0], hidden.shape[1], vocab, elem, r.policy)
    grad = torch.is_grad_enabled()
    needs = [grad and t is not None and t.requires_grad for t in (hidden, w, r.bias)]
    loss, *_ = operator.lm_head_loss(
        hidden, w, r.bias, labels.reshape(-1),
        None if mask is None else mask.reshape(-1), weight, list(plan.sizes), r.ignore_index,
        scoring.reduction, shift_rows(r.shift, labels), float(r.softcap or 0.0),
        float(r.logit_scale), float(scoring.label_smoothing), float(scoring.z_loss),
        autocast.dtype if autocast.compute_dtype(hidden.dtype, w.dtype) else None,
        needs,
    )  # fmt: skip
    return loss


_ELEMENT_SIZES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2, torch.float64: 8}


def shift_rows(shift: bool, labels: torch.Tensor) -> int:
    """The shift as the operator takes it: 0 for none, else the sequence length (labels are
    flattened before the operator sees them; each sequence's last position is then ignored)."""
    return labels.shape[-1] if shift else 0


def _check_logit_scale(logit_scale: Any, op: str) -> None:
    if isinstance(logit_scale, bool) or not (
        isinstance(logit_scale, int | float) and math.isfinite(logit_scale)
    ):
        raise ValueError(f"{op}: logit_scale must be a finite number, got {logit_scale!r}")


def _check_class_weight(weight: torch.Tensor | None, vocab: int) -> None:
    if weight is not None and (weight.dim() != 1 or weight.shape[0] != vocab):
        raise ValueError(
            f"tiled_cross_entropy: weight must be ({vocab},) class weights, got "
            f"{tuple(weight.shape)}"
        )


def _with_aux(
    loss: torch.Tensor,
    math_: CrossEntropyMath,
    targets: torch.Tensor,
    counted: torch.Tensor,
    shape: torch.Size,
) -> CrossEntropyOutput:
    """The CrossEntropyOutput of a finished run (labels' `shape` for per-token outputs)."""
    assert math_.argmax is not None
    count = math_.count
    correct = (math_.argmax == targets) & counted
    accuracy = correct.sum().to(torch.float32) / count if count else torch.tensor(float("nan"))
    z_value = math_.z_value()
    return CrossEntropyOutput(
        loss,
        z_value.view(shape) if math_.reduction == "none" else z_value,
        accuracy.to(loss.device),
        math_.argmax.view(shape),
    )


def tiled_token_logprobs(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    return_entropy: bool = False,
    shift: bool = False,
    mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_tiles: int | str | TilePolicy = "auto",
    tile_tokens: int | None = None,
) -> Any:
    """Per-token log-probabilities of given tokens (and the entropy) under the LM head, without
    the (tokens x vocab) logits ever existing: what GRPO / PPO trainers need for the policy and
    reference log-probs and the entropy bonus.

    logprob[t] = log_softmax(logits[t] / temperature)[tokens[t]] and entropy[t] =
    -sum_c p_c log p_c of the same distribution, where logits = hidden_states @ W.T + bias
    (soft-capped first if asked). Differentiable with respect to hidden_states, lm_head_weight
    and bias; the backward recomputes each tile's logits (4L FLOPs in all, 1L without grads).

    Args:
        hidden_states: (batch, seq, hidden) or (tokens, hidden), floating point.
        lm_head_weight: (vocab, hidden).
        tokens: (batch, seq) or (tokens,) token ids of any integer dtype.
        bias: (vocab,) or None.
        temperature: > 0; the logits are divided by it (as samplers do).
        softcap: final-logit soft-capping before the temperature; None or 0 for none.
        return_entropy: also return the per-token entropy.
        shift: score position t against tokens[..., t + 1] (causal LM; the last position gets
            0), `mask` shifted with the tokens.
        mask: bool, tokens' shape: False gives that position 0 and no gradient.
        ignore_index: token value treated as masked out.
        num_tiles: the tile policy, as for tiled_cross_entropy.
        tile_tokens: tokens per tile instead of num_tiles, as for tiled_cross_entropy.

    Returns:
        logprobs (float32, tokens' shape), or (logprobs, entropy) with return_entropy.
    """
    out = _token_head(
        hidden_states, lm_head_weight, tokens, bias, temperature, softcap, 1.0, return_entropy,
        (), shift, mask, ignore_index, TilePolicy.of(num_tiles, tile_tokens),
        "tiled_token_logprobs",
    )  # fmt: skip
    if return_entropy:
        return out.log_probs, out.entropy
    return out.log_probs


class TokenStats(NamedTuple):
    """What tiled_token_stats returns (tokens' shape each; None where not asked).

    Attributes:
        log_probs: log-probability of each token (float32, differentiable).
        entropy: entropy of each position's distribution (float32, differentiable).
        log_sum_sq_probs: log(sum_c p_c**2) of each position's distribution, no gradient.
        mean_logits: mean over the vocabulary of the scaled, capped, tempered logits, no
            gradient.
        is_top1: whether the token is the distribution's first argmax (bool), no gradient.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None


def tiled_token_stats(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    tokens: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    entropy: bool = False,
    stats: tuple[str, ...] = (),
    shift: bool = False,
    mask: torch.Tensor | None = None,
    ignore_index: int = -100,
    num_tiles: int | str | TilePolicy = "auto",
    tile_tokens: int | None = None,
) -> TokenStats:
    """tiled_token_logprobs with a logit scale and the statistics RL trainers log.

    The logits are logit_scale * (hidden_states @ W.T + bias), soft-capped, divided by the
    temperature (the order of Cohere / Granite-style scaled heads and of samplers). Positions
    that do not count (ignore_index, mask, the last one under `shift`) are 0 / False in every
    output. Costs as tiled_token_logprobs: the statistics are read from the same tile of
    logits, the backward recomputes each tile (4L FLOPs in all, 1L without gradients).

    The arguments shared with tiled_token_logprobs (hidden_states, lm_head_weight, tokens,
    bias, temperature, softcap, shift, mask, ignore_index, num_tiles, tile_tokens) mean the same.

    Args:
        logit_scale: multiplies the logits before soft-capping; 1.0 for none.
        entropy: also return the per-token entropy (differentiable).
        stats: any of "log_sum_sq_probs", "mean_logits", "is_top1" (no gradient).

    Returns:
        A TokenStats.
    """
    _check_logit_scale(logit_scale, "tiled_token_stats")
    return _token_head(
        hidden_states, lm_head_weight, tokens, bias, temperature, softcap, float(logit_scale),
        entropy, tuple(stats), shift, mask, ignore_index, TilePolicy.of(num_tiles, tile_tokens),
        "tiled_token_stats",
    )  # fmt: skip


def _token_head(
    hidden_states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    tokens: torch.Tensor,
    bias: torch.Tensor | None,
    temperature: float,
    softcap: float | None,
    scale: float,
    entropy: bool,
    stats: tuple[str, ...],
    shift: bool,
    mask: torch.Tensor | None,
    ignore_index: int,
    policy: TilePolicy,
    op: str,
) -> TokenStats:
    check_positive_number("temperature", temperature)
    unknown = [n for n in stats if n not in STATS]
    if unknown:
        raise ValueError(f"{op}: unknown statistic(s) {unknown}; expected any of {STATS}")
    check_inputs(hidden_states, lm_head_weight, tokens, bias, softcap, mask, "tokens")
    vocab = lm_head_weight.shape[0]
    targets, counted = targets_of(tokens, mask, shift, ignore_index, vocab, op)
    head = HeadInput.of(hidden_states, lm_head_weight, policy)
    hidden = head.hidden
    math_ = LogprobMath(hidden.shape[0], hidden.device, head.wide, entropy=entropy, stats=stats)
    run = HeadRun(
        head.plan, targets, counted, softcap or None, float(temperature), head.autocast, math_,
        scale,
    )  # fmt: skip
    out = run_head(hidden, run, lm_head_weight, bias)
    log_probs, ent = (out[0], out[1]) if entropy else (out, None)
    shape = tokens.shape
    rec = {name: t.view(shape) for name, t in math_.recorded.items()}
    return TokenStats(
        log_probs.view(shape),
        None if ent is None else ent.view(shape),
        rec.get("log_sum_sq_probs"),
        rec.get("mean_logits"),
        rec.get("is_top1"),
    )
