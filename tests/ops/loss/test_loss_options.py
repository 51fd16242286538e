"""tiled_cross_entropy's options (label smoothing, class weights, reduction "none", z-loss, mask,
accuracy) and tiled_token_logprobs (RL log-probabilities and entropy with a temperature): parity
with the untiled PyTorch computation (fp32 tight, bf16 by the 2x rule), float64 gradcheck, FLOPs
(3L training, 4L per-token outputs, 1L evaluation) and memory."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from tiledmlp import tiled_cross_entropy, tiled_token_logprobs
from tiledmlp.bench.memory import peak_bytes, tensor_bytes

from conftest import assert_close_rel

N, H, V = 19, 8, 23


def leaves(dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g, dtype=dtype) * 0.7).requires_grad_()
    b = torch.randn(V, generator=g, dtype=dtype).requires_grad_()
    return h, w, b


def targets(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (N,), generator=g)
    labels[:3] = -100
    mask = torch.rand(N, generator=g) > 0.25
    class_weight = torch.rand(V, generator=g) + 0.5
    return labels, mask, class_weight


def reference_ce(h, w, b, labels, *, reduction, label_smoothing, weight, z_loss, mask, softcap):
    """The untiled computation: F.cross_entropy plus the z-loss, with the mask as ignore_index."""
    z = F.linear(h, w, b)
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    y = labels if mask is None else torch.where(mask, labels, -100)
    wt = None if weight is None else weight.to(z.dtype)
    loss = F.cross_entropy(z, y, weight=wt, reduction=reduction, label_smoothing=label_smoothing)
    counted = y != -100
    zl = z_loss * torch.where(counted, torch.logsumexp(z, -1) ** 2, 0)
    if reduction == "mean":
        zl = zl.sum() / counted.sum()
    elif reduction == "sum":
        zl = zl.sum()
    return loss + zl


def reference_logprobs(h, w, b, tokens, *, temperature, softcap, mask):
    z = F.linear(h, w, b)
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    lp = torch.log_softmax(z.to(torch.promote_types(z.dtype, torch.float32)) / temperature, -1)
    counted = (tokens != -100) & (mask if mask is not None else True)
    picked = lp.gather(1, torch.where(counted, tokens, 0).unsqueeze(1)).squeeze(1)
    entropy = -(lp.exp() * lp).sum(-1)
    return picked * counted, entropy * counted


OPTIONS = list(
    itertools.product(
        ["mean", "sum", "none"],  # reduction
        [0.0, 0.2],  # label_smoothing
        [False, True],  # class weights
        [0.0, 1e-2],  # z_loss
        [False, True],  # mask
    )
)


@pytest.mark.parametrize(("reduction", "smoothing", "weighted", "z", "masked"), OPTIONS)
def test_cross_entropy_options_match_untiled_fp32(reduction, smoothing, weighted, z, masked):
    h, w, b = leaves()
    labels, mask, cw = targets()
    kw = dict(
        reduction=reduction,
        label_smoothing=smoothing,
        weight=cw if weighted else None,
        z_loss=z,
        mask=mask if masked else None,
        softcap=3.0 if weighted else None,
    )
    ref = reference_ce(h, w, b, labels, **kw)
    ours = tiled_cross_entropy(h, w, labels, bias=b, num_tiles=4, **kw)
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    up = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    g_ref = torch.autograd.grad(ref, (h, w, b), up)
    g_ours = torch.autograd.grad(ours, (h, w, b), up)
    for r, o in zip(g_ref, g_ours):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-6)


# "mean" is the slower gradcheck (~12 s on 2 cores); "none" keeps a float64 gradcheck quick
@pytest.mark.parametrize("reduction", [pytest.param("mean", marks=pytest.mark.slow), "none"])
def test_cross_entropy_gradcheck_float64(reduction: str) -> None:
    h, w, b = leaves(torch.float64)
    labels, mask, cw = targets()

    def fn(h, w, b):
        return tiled_cross_entropy(
            h, w, labels, bias=b, num_tiles=3, reduction=reduction, label_smoothing=0.1,
            weight=cw.double(), z_loss=1e-2, mask=mask, softcap=4.0,
        )  # fmt: skip

    assert torch.autograd.gradcheck(fn, (h, w, b))


@pytest.mark.parametrize(("temperature", "softcap"), [(1.0, None), (0.6, 3.0)])
def test_token_logprobs_and_entropy_match_untiled(temperature: float, softcap) -> None:
    h, w, b = leaves()
    tokens, mask, _ = targets()
    ref_lp, ref_h = reference_logprobs(h, w, b, tokens, temperature=temperature, softcap=softcap,
                                       mask=mask)  # fmt: skip
    lp, ent = tiled_token_logprobs(h, w, tokens, bias=b, temperature=temperature, softcap=softcap,
                                   mask=mask, return_entropy=True, num_tiles=4)  # fmt: skip
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, ref_h, rtol=1e-5, atol=1e-6)
    g1, g2 = torch.randn(N), torch.randn(N)
    want = torch.autograd.grad((ref_lp * g1).sum() + (ref_h * g2).sum(), (h, w, b))
    got = torch.autograd.grad((lp * g1).sum() + (ent * g2).sum(), (h, w, b))
    for r, o in zip(want, got):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-6)
    # the log-probs alone (the entropy output unused) and a policy-gradient-style objective
    lp_only = tiled_token_logprobs(h, w, tokens, bias=b, temperature=temperature, softcap=softcap,
                                   mask=mask)  # fmt: skip
    advantages = torch.randn(N)
    got = torch.autograd.grad((lp_only.exp() * advantages).sum(), (h, w, b))
    ref_lp, _ = reference_logprobs(h, w, b, tokens, temperature=temperature, softcap=softcap,
                                   mask=mask)  # fmt: skip
    want = torch.autograd.grad((ref_lp.exp() * advantages).sum(), (h, w, b))
    for r, o in zip(want, got):
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-6)


def test_token_logprobs_gradcheck_float64() -> None:
    h, w, b = leaves(torch.float64)
    tokens, mask, _ = targets()

    def fn(h, w, b):
        lp, ent = tiled_token_logprobs(h, w, tokens, bias=b, temperature=0.7, softcap=5.0,
                                       mask=mask, return_entropy=True, num_tiles=3)  # fmt: skip
        return lp, ent

    assert torch.autograd.gradcheck(fn, (h, w, b))


def test_logprobs_shift_and_shapes() -> None:
    h, w, b = leaves()
    tokens = torch.randint(0, V, (N,))
    lp = tiled_token_logprobs(h.view(1, N, H), w, tokens.view(1, N), bias=b, shift=True)
    assert lp.shape == (1, N) and lp[0, -1] == 0
    direct = tiled_token_logprobs(h[:-1], w, tokens[1:], bias=b)
    torch.testing.assert_close(lp[0, :-1], direct)
    ce = tiled_cross_entropy(h[:-1], w, tokens[1:], bias=b, reduction="none")
    torch.testing.assert_close(-direct, ce)


@pytest.mark.parametrize("kind", ["ce_mean", "ce_none", "logprobs"])
def test_bf16_error_at_most_twice_untiled(kind: str) -> None:
    h, w, b = leaves(seed=3)
    labels, mask, _ = targets()
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (h, w, b))
    hb, wb, bb = (t.detach().bfloat16().requires_grad_() for t in (h, w, b))
    up = torch.randn(N, generator=torch.Generator().manual_seed(4))

    def ours(h, w, b):
        if kind == "logprobs":
            return tiled_token_logprobs(h, w, labels, bias=b, temperature=0.8, mask=mask)
        return tiled_cross_entropy(h, w, labels, bias=b, num_tiles=3, label_smoothing=0.1,
                                   z_loss=1e-3, mask=mask,
                                   reduction="none" if kind == "ce_none" else "mean")  # fmt: skip

    def ref(h, w, b):
        if kind == "logprobs":
            return reference_logprobs(h, w, b, labels, temperature=0.8, softcap=None, mask=mask)[0]
        return reference_ce(h, w, b, labels, reduction="none" if kind == "ce_none" else "mean",
                            label_smoothing=0.1, weight=None, z_loss=1e-3, mask=mask,
                            softcap=None)  # fmt: skip

    def run(fn, *leaves_):
        out = fn(*leaves_)
        grads = torch.autograd.grad(out, leaves_, up if out.dim() else None)
        return [out.detach(), *grads]

    exact = run(ref, h64, w64, b64)
    tiled, untiled = run(ours, hb, wb, bb), run(ref, hb, wb, bb)
    for name, t, u, r in zip(["value", "h", "w", "b"], tiled, untiled, exact):
        et, eu = (t.double() - r).abs().max().item(), (u.double() - r).abs().max().item()
        assert et <= 2 * eu + 1e-6, f"{name}: tiled error {et:.3e} > 2 x untiled {eu:.3e}"


def test_accuracy_predictions_and_z_loss_value() -> None:
    h, w, b = leaves()
    labels, mask, _ = targets()
    out = tiled_cross_entropy(h, w, labels, bias=b, z_loss=1e-2, mask=mask, return_aux=True)
    z = F.linear(h, w, b)
    counted = (labels != -100) & mask
    assert torch.equal(out.predictions, z.argmax(-1))
    want = ((z.argmax(-1) == labels) & counted).sum() / counted.sum()
    torch.testing.assert_close(out.accuracy, want.float())
    zl = (1e-2 * torch.logsumexp(z, -1)[counted] ** 2).mean()
    torch.testing.assert_close(out.z_loss, zl.detach())
    assert not out.z_loss.requires_grad and not out.accuracy.requires_grad
    plain = tiled_cross_entropy(h, w, labels, bias=b, mask=mask)
    torch.testing.assert_close(out.loss - out.z_loss, plain)


def test_narrow_label_dtypes_and_softcap_zero() -> None:
    h, w, b = leaves()
    labels = torch.randint(0, V, (N,))
    ref = tiled_cross_entropy(h, w, labels, bias=b)
    for dtype in (torch.uint8, torch.int32, torch.int16):
        torch.testing.assert_close(tiled_cross_entropy(h, w, labels.to(dtype), bias=b), ref)
    torch.testing.assert_close(tiled_cross_entropy(h, w, labels, bias=b, softcap=0), ref)
    torch.testing.assert_close(
        tiled_token_logprobs(h, w, labels.to(torch.uint8), bias=b, softcap=0),
        tiled_token_logprobs(h, w, labels, bias=b),
    )


@pytest.mark.parametrize(
    ("scale", "softcap", "reduction", "bias"),
    [(0.25, None, "mean", False), (3.0, 2.0, "mean", True), (-0.5, None, "none", True)],
)
def test_logit_scale_matches_scaled_logits(scale, softcap, reduction, bias) -> None:
    """logit_scale multiplies the logits before soft-capping (Cohere, Granite): values and every
    gradient as F.cross_entropy of scale * (h @ W.T + b), capped, over uneven tiles; a
    non-finite scale is refused."""
    h, w, b = leaves()
    labels, _, _ = targets()
    b = b if bias else None
    up = torch.randn(N) if reduction == "none" else None
    got = tiled_cross_entropy(
        h, w, labels, bias=b, num_tiles=4, softcap=softcap, logit_scale=scale,
        reduction=reduction,
    )  # fmt: skip
    inputs = [t for t in (h, w, b) if t is not None]
    grads = torch.autograd.grad(got, inputs, up)
    z = F.linear(h, w, b) * scale
    if softcap:
        z = torch.tanh(z / softcap) * softcap
    ref = F.cross_entropy(z.float(), labels, reduction=reduction)
    ref_grads = torch.autograd.grad(ref, inputs, up)
    assert_close_rel(got.detach(), ref.detach(), "loss")
    for name, a, r in zip(("d hidden", "d weight", "d bias"), grads, ref_grads):
        assert_close_rel(a, r, name)
    with pytest.raises(ValueError, match="logit_scale must be a finite number"):
        tiled_cross_entropy(h, w, labels, logit_scale=float("nan"))


def _flops(fn, backward: bool) -> int:
    with FlopCounterMode(display=False) as fc:
        out = fn()
        if backward:
            out.sum().backward()
    return fc.get_total_flops()


def test_flops_3l_training_4l_per_token_1l_evaluation() -> None:
    torch.manual_seed(0)
    n, v, hid = 512, 1000, 32
    h = torch.randn(n, hid, requires_grad=True)
    w = torch.randn(v, hid, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    big_l = 2 * n * hid * v
    opts = dict(num_tiles=4, label_smoothing=0.1, z_loss=1e-4)
    assert _flops(lambda: tiled_cross_entropy(h, w, labels, **opts), True) == 3 * big_l
    none = dict(opts, reduction="none")
    assert _flops(lambda: tiled_cross_entropy(h, w, labels, **none), True) == 4 * big_l
    lp = _flops(lambda: tiled_token_logprobs(h, w, labels, num_tiles=4, return_entropy=True)[0],
                True)  # fmt: skip
    assert lp == 4 * big_l
    with torch.no_grad():  # evaluation: one pass, no gradient work
        assert _flops(lambda: tiled_cross_entropy(h, w, labels, **opts), False) == big_l
        assert _flops(lambda: tiled_token_logprobs(h, w, labels, num_tiles=4), False) == big_l
    frozen_h, frozen_w = h.detach(), w.detach()  # grad mode on, nothing requires a gradient
    assert _flops(lambda: tiled_cross_entropy(frozen_h, frozen_w, labels, **opts), False) == big_l


def entropy_of(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, tiles: int) -> torch.Tensor:
    return tiled_token_logprobs(h, w, labels, num_tiles=tiles, return_entropy=True)[1]


@pytest.mark.slow  # memory timelines
def test_memory_is_one_tile_of_logits_for_every_output() -> None:
    # Beyond the inputs and two copies of their gradients (d(W)'s float32 accumulator and the
    # result), forward + backward holds about one tile of float32 logits (measured: 1.37 tiles
    # for each output below); a tile kept from one iteration to the next would make it 2.4.
    # Per-token outputs keep nothing of (tokens x vocab) size between forward and backward.
    torch.manual_seed(0)
    n, v, hid, tiles = 2048, 8000, 64, 16
    h = torch.randn(n, hid, requires_grad=True)
    w = (torch.randn(v, hid) * 0.05).requires_grad_()
    labels = torch.randint(0, v, (n,))
    alive = tensor_bytes(h, w, labels)
    tile_bytes = n // tiles * v * 4

    def beyond_grads(fn) -> float:
        peak = peak_bytes(lambda: fn().sum().backward(), alive, torch.device("cpu"))
        h.grad = w.grad = None
        return (peak - alive - 2 * tensor_bytes(h, w)) / tile_bytes

    outputs = {
        "mean": lambda: tiled_cross_entropy(h, w, labels, num_tiles=tiles, label_smoothing=0.1),
        "none": lambda: tiled_cross_entropy(h, w, labels, reduction="none", num_tiles=tiles),
        "logprobs": lambda: tiled_token_logprobs(h, w, labels, num_tiles=tiles),
        "entropy": lambda: entropy_of(h, w, labels, tiles),
    }
    for name, fn in outputs.items():
        assert beyond_grads(fn) < 2.0, name
    untiled = beyond_grads(lambda: F.cross_entropy(F.linear(h, w), labels, reduction="none"))
    assert untiled > 2 * tiles  # the reference keeps (tokens x vocab) tensors


@pytest.mark.slow  # a benchmark run
def test_loss_bench_designs_and_their_flops(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from benchmarks.loss_step import main

    main(["--tokens", "256", "--vocab", "300", "--hidden", "16", "--repeats", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    records = {r["design"]: r for r in map(json.loads, lines)}
    flops = {name: r["flops_over_L"] for name, r in records.items()}
    assert flops == {"tiled": 3, "tiled_eval": 1, "logprobs": 4, "recompute": 4, "untiled": 3}
    assert all(r["time_ms"] > 0 and r["peak_mib"] > 0 for r in records.values())


@pytest.mark.gpu
def test_cuda_bf16_options_and_logprobs_within_twice_untiled() -> None:
    # The same 2x rule on the GPU's bf16 matmuls, every option at once; and Liger's fused loss
    # (when installed) agrees with ours as closely as with the untiled computation.
    g = torch.Generator().manual_seed(5)
    n, hid, v = 4096, 256, 32000
    h = torch.randn(n, hid, generator=g)
    w = torch.randn(v, hid, generator=g) * 0.05
    labels = torch.randint(0, v, (n,), generator=g)
    mask = torch.rand(n, generator=g) > 0.1
    dev = torch.device("cuda")
    h64, w64 = (t.to(dev, torch.float64).requires_grad_() for t in (h, w))
    hb, wb = (t.to(dev, torch.bfloat16).requires_grad_() for t in (h, w))
    labels, mask = labels.to(dev), mask.to(dev)
    kw = dict(reduction="mean", label_smoothing=0.1, weight=None, z_loss=1e-4, mask=mask,
              softcap=30.0)  # fmt: skip

    def ours(h, w):
        return tiled_cross_entropy(h, w, labels, num_tiles=8, **kw)

    def ref(h, w):
        return reference_ce(h, w, None, labels, **kw)

    def run(fn, h, w):
        out = fn(h, w)
        return [out.detach(), *torch.autograd.grad(out, (h, w))]

    exact, tiled, untiled = run(ref, h64, w64), run(ours, hb, wb), run(ref, hb, wb)
    for name, t, u, r in zip(["loss", "h", "w"], tiled, untiled, exact):
        et, eu = (t.double() - r).abs().max().item(), (u.double() - r).abs().max().item()
        assert et <= 2 * eu + 1e-6, f"{name}: tiled error {et:.3e} > 2 x untiled {eu:.3e}"
    lp = tiled_token_logprobs(hb, wb, labels, temperature=0.9, mask=mask)
    ref_lp, _ = reference_logprobs(h64, w64, None, labels, temperature=0.9, softcap=None,
                                   mask=mask)  # fmt: skip
    low_lp, _ = reference_logprobs(hb, wb, None, labels, temperature=0.9, softcap=None,
                                   mask=mask)  # fmt: skip
    et = (lp.double() - ref_lp).abs().max().item()
    eu = (low_lp.double() - ref_lp).abs().max().item()
    assert et <= 2 * eu + 1e-6
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return
    plain = tiled_cross_entropy(hb, wb, labels).double()
    liger = LigerFusedLinearCrossEntropyLoss()(wb, hb, labels)
    liger = (liger[0] if isinstance(liger, tuple) else liger).double()
    exact_plain = F.cross_entropy(F.linear(h64, w64), labels)
    assert (plain - exact_plain).abs() <= 2 * (liger - exact_plain).abs() + 1e-4
