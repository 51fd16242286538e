"""Property tests of the tiled LM-head losses against torch: random shapes (one token, a
vocabulary of one, more tiles than tokens, 2-D and 3-D inputs) x every option x dtypes x ignore
patterns (none, all, some, the first or last positions), with NaN in rows that do not count (as
padding positions may carry). Values and gradients must match torch's, NaN pattern included:
float32 and float64 to rounding, bfloat16 by the 2x rule (error against float64 at most twice the
untiled bfloat16 computation's, plus one bfloat16 rounding of the largest value: on a handful of
numbers a single rounding is luck, not error growth).

Examples are derandomised (the same cases on every run) and capped so that the file takes a few
seconds.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiledmlp import tiled_cross_entropy, tiled_token_logprobs
from tiledmlp.ops.loss.cross_entropy import shift_labels

SETTINGS = settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
DTYPES = (torch.float32, torch.float64, torch.bfloat16)
PATTERNS = ("none", "all", "some", "first", "last")


@st.composite
def shapes_and_targets(draw: Any) -> dict[str, Any]:
    """Leaves, labels, mask, tile policy and a seed; NaN written into rows that do not count."""
    lead = draw(st.sampled_from([(1,), (2,), (5,), (9,), (1, 1), (1, 4), (2, 3), (3, 5)]))
    hidden = draw(st.integers(1, 5))
    vocab = draw(st.integers(1, 7))
    dtype = draw(st.sampled_from(DTYPES))
    tokens = 1
    for d in lead:
        tokens *= d
    policy: dict[str, Any] = draw(
        st.sampled_from(["tiles", "tile_tokens", "auto"]).flatmap(
            lambda kind: {
                "tiles": st.integers(1, tokens + 3).map(lambda k: {"num_tiles": k}),
                "tile_tokens": st.integers(1, tokens + 2).map(lambda k: {"tile_tokens": k}),
                "auto": st.just({"num_tiles": "auto"}),
            }[kind]
        )
    )
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, lead, generator=g)
    pattern = draw(st.sampled_from(PATTERNS))
    flat = labels.view(-1)
    if pattern == "all":
        flat.fill_(-100)
    elif pattern == "some":
        flat[torch.rand(tokens, generator=g) < 0.4] = -100
    elif pattern == "first":
        labels[..., 0] = -100
    elif pattern == "last":
        labels[..., -1] = -100
    mask = torch.rand(lead, generator=g) > 0.3 if draw(st.booleans()) else None
    shift = draw(st.booleans())
    h = torch.randn(*lead, hidden, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) * 0.8
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if draw(st.booleans()) else None
    counted = _counted(labels, mask, shift)
    nan_rows = draw(st.booleans()) and bool((~counted).any())
    if nan_rows:
        h[~counted] = float("nan")  # rows without a target: padding carrying NaN
    return dict(h=h, w=w, b=b, labels=labels, mask=mask, shift=shift, dtype=dtype,
                policy=policy, seed=seed)  # fmt: skip


def _counted(labels: torch.Tensor, mask: torch.Tensor | None, shift: bool) -> torch.Tensor:
    y = shift_labels(labels) if shift else labels
    counted = y != -100
    if mask is not None:
        m = torch.cat([mask[..., 1:], torch.zeros_like(mask[..., :1])], -1) if shift else mask
        counted = counted & m
    return counted


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, softcap: float | None):
    z = F.linear(h, w, b)
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    return z.to(torch.promote_types(z.dtype, torch.float32))


def reference_ce(h, w, b, case: dict[str, Any], opts: dict[str, Any]) -> torch.Tensor:
    """torch: F.cross_entropy of the untiled logits (plus the z-loss), the mask and the shift
    applied to the labels."""
    labels, counted = case["labels"], _counted(case["labels"], case["mask"], case["shift"])
    y = torch.where(counted, shift_labels(labels) if case["shift"] else labels, -100)
    z = _logits(h.reshape(-1, h.shape[-1]), w, b, opts["softcap"]).div(1.0)
    weight = opts["weight"]
    loss = F.cross_entropy(
        z, y.reshape(-1), weight=None if weight is None else weight.to(z.dtype),
        reduction=opts["reduction"], label_smoothing=opts["label_smoothing"],
    )  # fmt: skip
    if opts["z_loss"]:
        c = counted.reshape(-1)
        zl = opts["z_loss"] * torch.where(c, torch.logsumexp(z, -1) ** 2, 0)
        if opts["reduction"] == "mean":
            zl = zl.sum() / c.sum()
        elif opts["reduction"] == "sum":
            zl = zl.sum()
        loss = loss + zl
    return loss.view(labels.shape) if opts["reduction"] == "none" else loss


def reference_logprobs(h, w, b, case: dict[str, Any], opts: dict[str, Any]):
    tokens, counted = case["labels"], _counted(case["labels"], case["mask"], case["shift"])
    y = shift_labels(tokens) if case["shift"] else tokens
    z = _logits(h.reshape(-1, h.shape[-1]), w, b, opts["softcap"]) / opts["temperature"]
    lp = torch.log_softmax(z, -1)
    c = counted.reshape(-1)
    picked = lp.gather(1, torch.where(c, y.reshape(-1), 0).unsqueeze(1)).squeeze(1)
    entropy = -(lp.exp() * lp).sum(-1)
    zero = lp.new_zeros(())
    return (
        torch.where(c, picked, zero).view(tokens.shape),
        torch.where(c, entropy, zero).view(tokens.shape),
    )


def _run(fn, leaves: list[torch.Tensor], upstream: list[torch.Tensor]) -> list[torch.Tensor]:
    """Outputs and the gradients of sum(output x upstream) for every leaf."""
    outs = fn(*leaves)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    total = sum((o.double() * u).sum() for o, u in zip(outs, upstream))
    grads = torch.autograd.grad(total, leaves)
    return [o.detach() for o in outs] + list(grads)


def _leaves(case: dict[str, Any], dtype: torch.dtype) -> list[torch.Tensor]:
    ts = [case["h"], case["w"]] + ([case["b"]] if case["b"] is not None else [])
    return [t.detach().to(dtype).requires_grad_() for t in ts]


def _compare(case: dict[str, Any], ours, ref, n_out: int, what: str) -> None:
    g = torch.Generator().manual_seed(case["seed"] + 1)
    dtype = case["dtype"]
    probe = ref(*_leaves(case, torch.float64))
    probe = list(probe) if isinstance(probe, tuple) else [probe]
    upstream = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in probe]
    names = [f"output {i}" for i in range(n_out)] + ["d hidden", "d weight", "d bias"]
    if dtype == torch.bfloat16:
        exact = _run(ref, _leaves(case, torch.float64), upstream)
        tiled = _run(ours, _leaves(case, dtype), upstream)
        untiled = _run(ref, _leaves(case, dtype), upstream)
        for name, t, u, r in zip(names, tiled, untiled, exact):
            _same_nans(t, u, f"{what} {name} (bf16 vs untiled bf16)")
            keep = ~torch.isnan(r)
            if not keep.any():
                continue
            et = (t.double() - r)[keep].abs().max().item()
            eu = (u.double() - r)[keep].abs().max().item()
            # On a handful of numbers one bfloat16 rounding (2**-8 relative) more or less is
            # luck, not error growth: allowed on top of the 2x rule.
            ulp = 2.0**-8 * r[keep].abs().max().item()
            assert et <= 2 * eu + ulp, f"{what} {name}: tiled error {et:.3e} > 2 x {eu:.3e}"
        return
    got = _run(ours, _leaves(case, dtype), upstream)
    want = _run(ref, _leaves(case, dtype), upstream)
    rtol = 1e-4 if dtype == torch.float32 else 1e-9
    for name, o, r in zip(names, got, want):
        _same_nans(o, r, f"{what} {name}")
        keep = ~torch.isnan(r)
        scale = r[keep].abs().max().item() if keep.any() else 0.0
        torch.testing.assert_close(
            o[keep], r[keep], rtol=rtol, atol=rtol * max(scale, 1e-3),
            msg=lambda m, name=name: f"{what} {name}: {m}",
        )  # fmt: skip


def _same_nans(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(torch.isnan(got), torch.isnan(want)), (
        f"{what}: NaN at {torch.isnan(got).nonzero().tolist()}, torch has NaN at "
        f"{torch.isnan(want).nonzero().tolist()}"
    )


@SETTINGS
@given(
    case=shapes_and_targets(),
    reduction=st.sampled_from(["mean", "sum", "none"]),
    label_smoothing=st.sampled_from([0.0, 0.15]),
    weighted=st.booleans(),
    z_loss=st.sampled_from([0.0, 1e-2]),
    softcap=st.sampled_from([None, 2.0]),
)
def test_tiled_cross_entropy_matches_torch(
    case: dict[str, Any],
    reduction: str,
    label_smoothing: float,
    weighted: bool,
    z_loss: float,
    softcap: float | None,
) -> None:
    vocab = case["w"].shape[0]
    weight = (
        torch.rand(vocab, generator=torch.Generator().manual_seed(case["seed"])) + 0.5
        if weighted
        else None
    )
    opts = dict(reduction=reduction, label_smoothing=label_smoothing, weight=weight,
                z_loss=z_loss, softcap=softcap)  # fmt: skip
    with_bias = case["b"] is not None

    def ours(h, w, b=None):
        return tiled_cross_entropy(
            h, w, case["labels"], bias=b, reduction=reduction, label_smoothing=label_smoothing,
            weight=None if weight is None else weight.to(torch.promote_types(h.dtype,
                                                                             torch.float32)),
            z_loss=z_loss, mask=case["mask"], shift=case["shift"], softcap=softcap,
            **case["policy"],
        )  # fmt: skip

    def ref(h, w, b=None):
        return reference_ce(h, w, b, case, opts)

    _compare(case, ours, ref, 1, f"cross-entropy {opts | {'bias': with_bias}}")


@SETTINGS
@given(
    case=shapes_and_targets(),
    temperature=st.sampled_from([1.0, 0.7]),
    softcap=st.sampled_from([None, 2.0]),
    entropy=st.booleans(),
)
def test_tiled_token_logprobs_match_torch(
    case: dict[str, Any], temperature: float, softcap: float | None, entropy: bool
) -> None:
    opts = dict(temperature=temperature, softcap=softcap)

    def ours(h, w, b=None):
        return tiled_token_logprobs(
            h, w, case["labels"], bias=b, temperature=temperature, softcap=softcap,
            return_entropy=entropy, shift=case["shift"], mask=case["mask"], **case["policy"],
        )  # fmt: skip

    def ref(h, w, b=None):
        lp, ent = reference_logprobs(h, w, b, case, opts)
        return (lp, ent) if entropy else lp

    _compare(case, ours, ref, 2 if entropy else 1, f"log-probs {opts | {'entropy': entropy}}")


def test_nan_in_an_ignored_row_gives_torch_values_and_nan_pattern() -> None:
    # The case found by hand: padding positions carry NaN, their labels are ignored. torch's
    # loss is the finite loss of the counted rows; its gradient is NaN in the NaN row of
    # d(hidden) and throughout d(weight) and d(bias) (log_softmax's backward multiplies the
    # NaN probabilities by a zero upstream gradient).
    g = torch.Generator().manual_seed(0)
    h = torch.randn(6, 4, generator=g)
    h[2] = float("nan")
    w = torch.randn(5, 4, generator=g)
    b = torch.randn(5, generator=g)
    labels = torch.randint(0, 5, (6,), generator=g)
    labels[2] = -100
    for reduction in ("mean", "sum", "none"):
        leaves = [t.clone().requires_grad_() for t in (h, w, b)]
        ref = F.cross_entropy(F.linear(*leaves), labels, reduction=reduction)
        ref_grads = torch.autograd.grad(ref.sum(), leaves)
        leaves = [t.clone().requires_grad_() for t in (h, w, b)]
        ours = tiled_cross_entropy(leaves[0], leaves[1], labels, bias=leaves[2],
                                   reduction=reduction, num_tiles=2)  # fmt: skip
        grads = torch.autograd.grad(ours.sum(), leaves)
        assert not torch.isnan(ours).any(), f"{reduction}: {ours}"
        torch.testing.assert_close(ours, ref.detach())
        for got, want in zip(grads, ref_grads):
            _same_nans(got, want, reduction)
