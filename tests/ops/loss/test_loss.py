"""tiled_cross_entropy: exact against the untiled LM head + cross-entropy; memory and FLOPs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from tiledmlp import tiled_cross_entropy
from tiledmlp.bench.memory import peak_bytes, tensor_bytes

from conftest import assert_close_rel


def reference(h, w, labels, *, bias=None, softcap=None, shift=False, reduction="mean"):
    """The untiled computation, as Hugging Face causal LMs do it."""
    z = F.linear(h, w, bias)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    if shift:
        labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1), reduction=reduction)


def run(fn, h, w, labels, bias, upstream=1.7, **kw):
    leaves = [t for t in (h, w, bias) if t is not None]
    loss = fn(h, w, labels, bias=bias, **kw)
    grads = torch.autograd.grad(loss * upstream, leaves)
    return loss.detach(), grads


CASES = {
    "batch2_uneven": dict(shape=(2, 13), tiles=4),
    "2d": dict(shape=(21,), tiles=5),
    "shift": dict(shape=(3, 9), tiles=4, shift=True),
    "softcap": dict(shape=(2, 11), tiles=3, softcap=2.5),
    "bias_sum": dict(shape=(2, 7), tiles=3, bias=True, reduction="sum"),
    "more_tiles_than_tokens": dict(shape=(1, 3), tiles=10),
    "tile_tokens": dict(shape=(2, 10), tile_tokens=6),
    "ignored_tile": dict(shape=(2, 12), tiles=4, ignore_first=8),
    "everything": dict(shape=(2, 15), tiles=4, shift=True, softcap=5.0, bias=True, ignore_first=6),
}


def make(case: dict, dtype=torch.float32, vocab=40, hidden=16):
    torch.manual_seed(0)
    h = torch.randn(*case["shape"], hidden, dtype=dtype, requires_grad=True)
    w = (torch.randn(vocab, hidden, dtype=dtype) * 0.5).requires_grad_()
    bias = torch.randn(vocab, dtype=dtype, requires_grad=True) if case.get("bias") else None
    labels = torch.randint(0, vocab, case["shape"])
    labels.view(-1)[: case.get("ignore_first", 0)] = -100
    return h, w, bias, labels


def policy(case: dict) -> dict:
    kw = {k: case[k] for k in ("shift", "softcap", "reduction") if k in case}
    if "tile_tokens" in case:
        kw["tile_tokens"] = case["tile_tokens"]
    else:
        kw["num_tiles"] = case["tiles"]
    return kw


@pytest.mark.parametrize("case", list(CASES))
def test_float32_parity(case: str) -> None:
    c = CASES[case]
    h, w, bias, labels = make(c)
    kw = policy(c)
    ref_kw = {k: v for k, v in kw.items() if k in ("shift", "softcap", "reduction")}
    loss, grads = run(tiled_cross_entropy, h, w, labels, bias, **kw)
    rloss, rgrads = run(reference, h, w, labels, bias, **ref_kw)
    assert torch.isfinite(loss)
    assert_close_rel(loss, rloss, "loss")
    for i, (g, r) in enumerate(zip(grads, rgrads)):
        assert_close_rel(g, r, f"grad[{i}]")


@pytest.mark.parametrize("case", ["batch2_uneven", "everything"])
def test_gradcheck_float64(case: str) -> None:
    h, w, bias, labels = make(CASES[case], dtype=torch.float64, vocab=7, hidden=4)
    kw = policy(CASES[case])
    inputs = tuple(t for t in (h, w, bias) if t is not None)

    def f(*ts):
        return tiled_cross_entropy(ts[0], ts[1], labels, bias=ts[2] if len(ts) > 2 else None, **kw)

    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7)


def test_fully_ignored_input_matches_torch_nan_loss_without_nan_grads() -> None:
    h, w, _, labels = make(CASES["batch2_uneven"])
    labels.fill_(-100)
    loss = tiled_cross_entropy(h, w, labels, num_tiles=3)
    assert torch.isnan(loss) and torch.isnan(reference(h, w, labels))
    loss.backward()
    assert torch.equal(h.grad, torch.zeros_like(h)) and torch.equal(w.grad, torch.zeros_like(w))
    s = tiled_cross_entropy(h, w, labels, num_tiles=3, reduction="sum")
    assert s.item() == 0.0


@pytest.mark.parametrize("autocast", [False, True])
def test_bf16_error_at_most_twice_untiled(autocast: bool) -> None:
    h, w, bias, labels = make(CASES["everything"], vocab=300, hidden=64)
    h64, w64, b64 = (t.detach().double().requires_grad_() for t in (h, w, bias))
    ref_loss, ref_grads = run(reference, h64, w64, labels, b64, shift=True, softcap=5.0)

    def low(fn, **kw):
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return run(fn, h, w, labels, bias, shift=True, softcap=5.0, **kw)
        hb, wb, bb = (t.detach().bfloat16().requires_grad_() for t in (h, w, bias))
        return run(fn, hb, wb, labels, bb, shift=True, softcap=5.0, **kw)

    tl, tg = low(tiled_cross_entropy, num_tiles=4)
    ul, ug = low(reference)
    assert tl.dtype == ul.dtype == torch.float32
    for name, t, u, r in zip(["loss", "h", "w", "b"], [tl, *tg], [ul, *ug], [ref_loss, *ref_grads]):
        assert t.dtype == u.dtype, name
        et, eu = (t.double() - r).abs().max().item(), (u.double() - r).abs().max().item()
        assert et <= 2 * eu + 1e-6, f"{name}: tiled error {et:.3e} > 2 x untiled {eu:.3e}"


def test_weight_grad_delivered_once() -> None:
    h, w, bias, labels = make(CASES["bias_sum"])
    calls = []
    for p in (w, bias):
        p.register_post_accumulate_grad_hook(lambda q: calls.append(q.shape))
    tiled_cross_entropy(h, w, labels, bias=bias, num_tiles=3).backward()
    assert len(calls) == 2


def _flops(fn) -> int:
    with FlopCounterMode(display=False) as fc:
        fn().backward()
    return fc.get_total_flops()


def test_flops_equal_untiled_and_beat_recompute_design() -> None:
    torch.manual_seed(0)
    n, v, hid = 1024, 3000, 64
    h = torch.randn(n, hid, requires_grad=True)
    w = torch.randn(v, hid, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    big_l = 2 * n * hid * v

    def recompute_design():
        # the alternative: per-tile checkpointing, which recomputes the logits in the backward
        parts = [
            checkpoint(
                lambda a, b: F.cross_entropy(F.linear(a, w), b, reduction="sum"),
                hh,
                ll,
                use_reentrant=False,
            )
            for hh, ll in zip(h.split(128), labels.split(128))
        ]
        return sum(parts) / n

    untiled = _flops(lambda: reference(h, w, labels))
    tiled = _flops(lambda: tiled_cross_entropy(h, w, labels, num_tiles=8))
    other = _flops(recompute_design)
    assert untiled == 3 * big_l and tiled == 3 * big_l and other == 4 * big_l
    assert tiled / untiled <= 1.01


@pytest.mark.slow
def test_memory_at_16k_tokens_vocab_32000_at_most_0_15x_untiled() -> None:
    torch.manual_seed(0)
    n, v, hid = 16384, 32000, 64  # the logits (n, v) are the memory; hid only the FLOPs
    h = torch.randn(n, hid, requires_grad=True)
    w = (torch.randn(v, hid) * 0.02).requires_grad_()
    labels = torch.randint(0, v, (n,))
    alive = tensor_bytes(h, w, labels)

    def measure(fn) -> int:
        peak = peak_bytes(lambda: fn().backward(), alive, torch.device("cpu"))
        h.grad = w.grad = None
        return peak

    untiled = measure(lambda: reference(h, w, labels))
    tiled = measure(lambda: tiled_cross_entropy(h, w, labels))
    assert tiled <= 0.15 * untiled, (
        f"tiled {tiled / 2**20:.0f} MiB vs untiled {untiled / 2**20:.0f} MiB"
    )


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"reduction": "avg"}, ValueError, "reduction must be"),
        ({"num_tiles": 0}, ValueError, "num_tiles must be"),
        ({"num_tiles": 2, "tile_tokens": 3}, ValueError, "either num_tiles or tile_tokens"),
        ({"softcap": -1.0}, ValueError, "softcap must be positive"),
        ({"num_tiles": "arctic"}, ValueError, "an MLP policy"),
        ({"num_tiles": "target:1"}, ValueError, "an MLP policy"),
        ({"label_smoothing": 1.5}, ValueError, r"label_smoothing must be in \[0, 1\]"),
        ({"z_loss": -1.0}, ValueError, "z_loss must be a coefficient >= 0"),
        ({"weight": torch.ones(3)}, ValueError, r"weight must be \(40,\) class weights"),
        ({"mask": torch.ones(21, dtype=torch.int64)}, ValueError, "mask must be a bool tensor"),
    ],
)
def test_bad_arguments(kwargs: dict, exc: type, match: str) -> None:
    h, w, _, labels = make(CASES["2d"])
    with pytest.raises(exc, match=match):
        tiled_cross_entropy(h, w, labels, **kwargs)


def test_bad_shapes_and_dtypes() -> None:
    h, w, _, labels = make(CASES["batch2_uneven"])
    with pytest.raises(ValueError, match=r"labels must have shape \(2, 13\)"):
        tiled_cross_entropy(h, w, labels[:, :5])
    with pytest.raises(TypeError, match="labels must be integer"):
        tiled_cross_entropy(h, w, labels.float())
    with pytest.raises(ValueError, match="lm_head_weight must be"):
        tiled_cross_entropy(h, w[:, :3], labels)
    with pytest.raises(ValueError, match=r"labels must be in \[0, 40\)"):
        tiled_cross_entropy(h, w, labels + 100)
    with pytest.raises(TypeError, match=r"hidden_states have dtype torch\.float64"):
        tiled_cross_entropy(h.double(), w, labels)
