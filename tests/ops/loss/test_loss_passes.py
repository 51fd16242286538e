"""The tiled loss's cost beyond FLOPs, counted (never timed): memory traffic over (tokens x
vocab) tensors, dispatched ops, device syncs and tile counts; and the factored gradient's bf16
error against the untiled loss's."""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tiledmlp import tiled_cross_entropy
from tiledmlp.bench.flops import count_flops
from tiledmlp.ops.loss.inputs import loss_plan
from tiledmlp.ops.tiling.policy import TilePolicy

_SPARSE = ("aten.gather", "aten.scatter_", "aten.scatter", "aten.scatter_add_")


class _Traffic(TorchDispatchMode):
    """Per non-view op: its tensor inputs' and outputs' bytes, split into (rows x vocab)-shaped
    tensors and the rest (gather / scatter: the index and the values moved, not the whole
    tensor they index); also the ops run and the device syncs (_local_scalar_dense)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.logit_bytes = 0
        self.ops: collections.Counter[str] = collections.Counter()
        self.made: set[tuple[tuple[int, ...], torch.dtype]] = set()  # outputs' shapes, dtypes
        self.logit_ops: set[str] = set()  # ops that read or wrote a (rows x vocab) tensor

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket)
        if name.startswith("prim.") or func.is_view or name in ("aten.detach", "aten.alias"):
            return out
        self.ops[name] += 1
        self.made |= {
            (tuple(t.shape), t.dtype) for t in tree_leaves(out) if isinstance(t, torch.Tensor)
        }
        if name in _SPARSE:
            tensors = [a for a in args[2:] if isinstance(a, torch.Tensor)]
        else:
            tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        for t in tensors:
            if t.dim() == 2 and t.shape[-1] == self.vocab and t.shape[0] != self.vocab:
                self.logit_bytes += t.numel() * t.element_size()
                self.logit_ops.add(name)
        return out


def _untiled(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
    """What Hugging Face causal LMs do: logits in the compute dtype, upcast, cross-entropy."""
    return F.cross_entropy((h @ w.t()).float(), y, reduction=reduction)


def _count(
    loss_fn: Callable[..., torch.Tensor], n: int, hidden: int, vocab: int, **kw: Any
) -> _Traffic:
    with FakeTensorMode():
        h = torch.randn(n, hidden, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
        y = torch.randint(0, vocab, (n,))
        with _Traffic(vocab) as traffic:
            loss_fn(h, w, y, **kw).backward()
    return traffic


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tiled_loss_moves_less_logit_memory_than_untiled(reduction: str) -> None:
    # An 8B-shaped head (hidden 4096, vocab 128256, bf16) at 32K tokens on fake tensors. The
    # untiled loss writes and reads (tokens x vocab) tensors 12 times over in fp32 units (logits,
    # their upcast, log_softmax, nll_loss's dense gradient, log_softmax's backward, the cast
    # back); the tiles 8 times (the logits, the upcast log_softmax makes, its output, exp
    # written in bf16 with the targets' entries over it, the two GEMMs reading it). The tile
    # loop used to make 13 (a float32 copy of the logits, logsumexp, then sub, exp and mul in
    # place and a separate cast), not counting logsumexp's own temporary.
    n, hidden, vocab = 32768, 4096, 128256
    tiled = _count(tiled_cross_entropy, n, hidden, vocab, reduction=reduction)
    untiled = _count(_untiled, n, hidden, vocab, reduction=reduction)
    unit = n * vocab * 4
    assert untiled.logit_bytes / unit == pytest.approx(12.06, abs=0.01)
    assert tiled.logit_bytes / unit == pytest.approx(8.0, abs=0.01)
    # whole (rows x vocab) passes: the GEMMs, the log-softmax with its upcast, exp (the cast
    # fused); no logsumexp, no in-place passes (the targets' gathers and scatters touch one
    # entry per row)
    assert tiled.logit_ops == {
        "aten.mm",
        "aten._to_copy",
        "aten._log_softmax",
        "aten.exp",
        "aten.empty",
    }


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tiled_loss_flops_equal_untiled(reduction: str) -> None:
    # 3L either way (L = 2 x tokens x hidden x vocab): the gradient is formed in the forward, the
    # logits are never recomputed. Ignored rows are counted too (they cost the same GEMMs).
    torch.manual_seed(0)
    n, hidden, vocab = 96, 16, 50
    h = torch.randn(n, hidden, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, vocab, (n,))
    y[::7] = -100
    L = 2 * n * hidden * vocab
    for tiles in (1, 5):

        def step(tiles: int = tiles) -> None:
            tiled_cross_entropy(h, w, y, num_tiles=tiles, reduction=reduction).backward()

        tiled = count_flops(step)
        assert tiled == 3 * L
    assert count_flops(lambda: _untiled(h, w, y, reduction).backward()) == 3 * L


def test_auto_loss_tiles() -> None:
    # a byte tokenizer's vocabulary: the whole 16K-token input is one tile (its float32 logits
    # are 16 MiB), where tiles of hidden * elem / 4 tokens would make 64 tiles of 256 tokens
    assert loss_plan(16384, 512, 258, 2, TilePolicy()).num_tiles == 1
    assert loss_plan(1 << 20, 512, 258, 2, TilePolicy()).num_tiles == 5  # tiles up to 260K tokens
    # an 8B-shaped head: tiles whose float32 logits are the LM-head weight's size, as before
    assert loss_plan(32768, 4096, 128256, 2, TilePolicy()).num_tiles == 16
    assert loss_plan(16384, 4096, 128256, 2, TilePolicy()).num_tiles == 8
    # a 32K vocabulary at hidden 2048: the 256 MiB floor sets 2048-token tiles, not 1024
    assert loss_plan(32768, 2048, 32000, 2, TilePolicy()).num_tiles == 16
    # an explicit count is kept
    assert loss_plan(16384, 512, 258, 2, TilePolicy.of(64)).num_tiles == 64


def test_auto_small_vocab_runs_as_one_tile_without_an_accumulator() -> None:
    # the small preset's head at 16K tokens: "auto" runs the same ops as one tile, and one tile
    # makes no float32 gradient buffer for the weight (no weight-sized add per tile)
    auto = _count(tiled_cross_entropy, 16384, 512, 258, reduction="sum")
    one = _count(tiled_cross_entropy, 16384, 512, 258, reduction="sum", num_tiles=1)
    many = _count(tiled_cross_entropy, 16384, 512, 258, reduction="sum", num_tiles=64)
    assert auto.ops == one.ops
    assert sum(auto.ops.values()) < 60 < 20 * 64 < sum(many.ops.values())
    # the weight's gradient is the GEMM's product: no float32 buffer of its shape
    assert ((258, 512), torch.float32) not in one.made
    assert ((258, 512), torch.float32) in many.made


@pytest.mark.parametrize("reduction,syncs", [("sum", 1), ("mean", 2)])
def test_device_syncs_per_call(reduction: str, syncs: int) -> None:
    # "sum" (what the Trainer's num_items_in_batch asks for) reads one value on the host: the
    # labels' range check; "mean" also the count of counted tokens
    torch.manual_seed(0)
    h = torch.randn(64, 8, requires_grad=True)
    w = torch.randn(30, 8, requires_grad=True)
    y = torch.randint(0, 30, (64,))
    with _Traffic(30) as traffic:
        tiled_cross_entropy(h, w, y, num_tiles=4, reduction=reduction).backward()
    assert traffic.ops["aten._local_scalar_dense"] == syncs


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("tiles", [1, 4])
@pytest.mark.parametrize("autocast", [False, True])
def test_factored_gradient_bf16_error_at_most_twice_untiled(
    reduction: str, tiles: int, autocast: bool
) -> None:
    # the plain cross-entropy's path (no soft-cap, bias, smoothing, class weights or z-loss)
    torch.manual_seed(0)
    n, hidden, vocab = 60, 64, 300
    h = torch.randn(n, hidden, requires_grad=True)
    w = (torch.randn(vocab, hidden) * 0.3).requires_grad_()
    y = torch.randint(0, vocab, (n,))
    y[:9] = -100

    def grads(fn: Callable[..., torch.Tensor], hh: torch.Tensor, ww: torch.Tensor, **kw: Any):
        loss = fn(hh, ww, y, reduction=reduction, **kw)
        return [loss.detach(), *torch.autograd.grad(loss * 1.7, (hh, ww))]

    h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
    ref = grads(lambda a, b, c, reduction: F.cross_entropy(a @ b.t(), c, reduction=reduction),
                h64, w64)  # fmt: skip

    def low(fn: Callable[..., torch.Tensor], **kw: Any):
        if autocast:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return grads(fn, h, w, **kw)
        hb, wb = (t.detach().bfloat16().requires_grad_() for t in (h, w))
        return grads(fn, hb, wb, **kw)

    ours = low(tiled_cross_entropy, num_tiles=tiles)
    theirs = low(_untiled)
    for name, t, u, r in zip(["loss", "h", "w"], ours, theirs, ref):
        assert t.dtype == u.dtype, name
        et, eu = (t.double() - r).abs().max().item(), (u.double() - r).abs().max().item()
        assert et <= 2 * eu + 1e-6, f"{name}: tiled error {et:.3e} > 2 x untiled {eu:.3e}"
