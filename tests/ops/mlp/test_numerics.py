"""Faithful numerics and autograd behaviour: RNG replay, checkpointing, FlopCounterMode,
exactly-once gradients, micro-batch accumulation, tuple outputs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from tiledmlp import tiled_mlp
from tiledmlp.ops.tiling.tiles import split_even

from conftest import FAST_KINDS, assert_close_rel, assert_same_grads, grads_of, make_mlp
from generic_modules import DropoutMLP, TinyMoE


def test_dropout_grads_match_forward_masks() -> None:
    # Reference: the same module run tile by tile under ordinary autograd from the same seed
    # draws the same masks as the tiled forward; the tiled backward must replay them.
    torch.manual_seed(3)
    mlp = DropoutMLP(16, 24, p=0.4)
    x = torch.randn(2, 11, 16)
    dy = torch.randn(2, 11, 16)
    plan = split_even(22, 4)

    def manual(t: torch.Tensor) -> torch.Tensor:
        flat = t.reshape(-1, 16)
        outs = [mlp(flat[a:b].unsqueeze(0)).squeeze(0) for a, b in plan.bounds()]
        return torch.cat(outs).view(2, 11, 16)

    torch.manual_seed(42)
    ref = grads_of(manual, mlp, x.requires_grad_(), [dy])
    after_ref = torch.get_rng_state()
    torch.manual_seed(42)
    got = grads_of(lambda t: tiled_mlp(mlp, t, num_tiles=4), mlp, x, [dy])
    after_got = torch.get_rng_state()
    assert_same_grads(got, ref)
    # The forward consumed the stream like the reference; the backward's replay left it alone.
    assert torch.equal(after_ref, after_got)


def test_backward_leaves_global_rng_alone() -> None:
    mlp = DropoutMLP(16, 24)
    x = torch.randn(2, 8, 16, requires_grad=True)
    y = tiled_mlp(mlp, x, num_tiles=3)
    before = torch.get_rng_state()
    y.sum().backward()
    assert torch.equal(before, torch.get_rng_state())


class Block(torch.nn.Module):
    """norm -> MLP -> residual, the shape of a decoder layer's MLP half."""

    def __init__(self, mlp: torch.nn.Module, tiles: int | None) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(16)
        self.mlp = mlp
        self.tiles = tiles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out = self.mlp(h) if self.tiles is None else tiled_mlp(self.mlp, h, num_tiles=self.tiles)
        return x + out


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("kind", ["swiglu", "fused_bias", "plain", "normed"])
def test_checkpointing_parity(kind: str, reentrant: bool) -> None:
    mlp = make_mlp(kind)
    plain, tiled = Block(mlp, None), Block(mlp, 3)
    tiled.norm = plain.norm
    x = torch.randn(2, 10, 16, requires_grad=True)
    dy = torch.randn(2, 10, 16)
    ref = grads_of(plain, plain, x, [dy])
    got = grads_of(lambda t: checkpoint(tiled, t, use_reentrant=reentrant), plain, x, [dy])
    assert_same_grads(got, ref)


def _step_flops(fn, x: torch.Tensor, dy: torch.Tensor) -> int:
    fn(x)  # warm-up: the one-time structure probe (5 tokens) is not part of a step
    with FlopCounterMode(display=False) as fc:
        fn(x).backward(dy)
    return fc.get_total_flops()


def test_flop_counter_mode_runs_and_counts() -> None:
    # Peer bug: chunking a requires_grad x under no_grad without detach crashes FlopCounterMode.
    mlp = make_mlp("swiglu", 32, 64)
    x = torch.randn(2, 40, 32, requires_grad=True)
    dy = torch.randn(2, 40, 32)
    flops = _step_flops(lambda t: tiled_mlp(mlp, t, num_tiles=7), x, dy)
    u = 2 * 80 * 32 * 64
    assert flops == 11 * u


def test_non_reentrant_checkpoint_does_not_rerun_the_mlp() -> None:
    # Under non-reentrant checkpointing the layer recompute stops before the tiled MLP.
    mlp = make_mlp("swiglu", 32, 64)
    plain, tiled = Block(mlp, None), Block(mlp, 4)
    plain.norm = tiled.norm = torch.nn.LayerNorm(32)
    x = torch.randn(2, 40, 32, requires_grad=True)
    dy = torch.randn(2, 40, 32)
    ck_plain = _step_flops(lambda t: checkpoint(plain, t, use_reentrant=False), x, dy)
    ck_tiled = _step_flops(lambda t: checkpoint(tiled, t, use_reentrant=False), x, dy)
    u = 2 * 80 * 32 * 64
    # Untiled: the recompute stops once down_proj's input exists, so 9U + gate and up (2U).
    assert ck_plain == 11 * u
    # Tiled: 11U with no MLP work at all in the layer recompute; a recompute that re-ran the
    # tiled forward would make it 14U.
    assert ck_tiled == ck_plain


@pytest.mark.parametrize("kind", [*FAST_KINDS, "normed"])
def test_each_parameter_gets_exactly_one_gradient(kind: str) -> None:
    # Peer bug: AccumulateGrad fires once per tile, which breaks DDP and ZeRO-1/2.
    mlp = make_mlp(kind)
    calls = {id(p): 0 for p in mlp.parameters()}
    handles = [
        p.register_post_accumulate_grad_hook(lambda q: calls.__setitem__(id(q), calls[id(q)] + 1))
        for p in mlp.parameters()
    ]
    x = torch.randn(2, 13, 16, requires_grad=True)
    tiled_mlp(mlp, x, num_tiles=5).pow(2).sum().backward()
    for h in handles:
        h.remove()
    assert set(calls.values()) == {1}, calls


@pytest.mark.parametrize("kind", ["swiglu", "plain", "normed"])
def test_micro_batch_accumulation_adds_to_existing_grad(kind: str) -> None:
    mlp = make_mlp(kind)
    xs = [torch.randn(2, 9, 16) for _ in range(2)]
    dys = [torch.randn(2, 9, 16) for _ in range(2)]
    for x, dy in zip(xs, dys):
        mlp(x).backward(dy)
    ref = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad(set_to_none=True)
    for x, dy in zip(xs, dys):
        tiled_mlp(mlp, x, num_tiles=4).backward(dy)
    for i, (p, r) in enumerate(zip(mlp.parameters(), ref)):
        assert_close_rel(p.grad, r, f"param[{i}].grad")


def test_moe_tuple_outputs_keep_router_logit_grads() -> None:
    # Peer bug: router-logit gradients (auxiliary loss) dropped by the tiled recompute.
    torch.manual_seed(5)
    moe = TinyMoE(16, 24)
    x = torch.randn(2, 9, 16, requires_grad=True)
    dy, dlogits = torch.randn(2, 9, 16), torch.randn(18, 3)
    ref = grads_of(moe, moe, x, [dy, dlogits])
    got = grads_of(lambda t: tiled_mlp(moe, t, num_tiles=4), moe, x, [dy, dlogits])
    assert got[0][1].shape == (18, 3)
    assert_same_grads(got, ref)
    # Only the auxiliary-loss path: the router weight still gets its gradient.
    got_aux = grads_of(lambda t: tiled_mlp(moe, t, num_tiles=4), moe, x, [None, dlogits])
    ref_aux = grads_of(moe, moe, x, [None, dlogits])
    assert_same_grads(got_aux, ref_aux)


def test_no_grad_forward_matches() -> None:
    mlp = make_mlp("swiglu")
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        y = tiled_mlp(mlp, x, num_tiles=4)
    assert y.grad_fn is None
    assert_close_rel(y, mlp(x).detach(), "output")


def test_module_hooks_route_to_generic_path() -> None:
    # A forward hook on a projection is part of the module's behaviour: the fast path would skip
    # it, so the module must take the generic path and the hook must fire per tile.
    mlp = make_mlp("swiglu")
    seen: list[int] = []
    mlp.up_proj.register_forward_hook(lambda m, i, o: seen.append(o.shape[-2]))
    x = torch.randn(2, 9, 16, requires_grad=True)
    y = tiled_mlp(mlp, x, num_tiles=3)
    assert seen == [6, 6, 6]
    y.sum().backward()
    assert len(seen) == 6  # forward tiles, then the backward's recompute
