"""Gradient parity of tiled_mlp against the untiled module.

float64 gradcheck; float32 parity of output, x.grad and every parameter grad (rtol 1e-5, atol
1e-5 x the reference's largest magnitude) over the hard cases; random shapes with hypothesis.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.func import functional_call

from tiledmlp import tiled_mlp
from tiledmlp.ops import MLPKind, recognise

from conftest import FAST_KINDS, assert_same_grads, grads_of, make_mlp
from generic_modules import NormedMLP, lora_wrapped

GENERIC_KINDS = ["normed", "lora"]


def build(kind: str, hidden: int = 16, intermediate: int = 24) -> torch.nn.Module:
    if kind == "normed":
        torch.manual_seed(99)
        return NormedMLP(hidden, intermediate)
    if kind == "lora":
        return lora_wrapped(hidden, intermediate)
    return make_mlp(kind, hidden, intermediate)


def test_fast_kinds_are_recognised() -> None:
    expected = {
        "swiglu": MLPKind.GATED,
        "swiglu_bias": MLPKind.GATED,
        "geglu": MLPKind.GATED,
        "fused": MLPKind.FUSED_GATED,
        "fused_bias": MLPKind.FUSED_GATED,
        "plain": MLPKind.PLAIN,
        "plain_nobias": MLPKind.PLAIN,
        "relu_inplace": MLPKind.PLAIN,
    }
    for kind, want in expected.items():
        s = recognise(build(kind))
        assert s is not None and s.kind is want, kind
    for kind in GENERIC_KINDS:
        assert recognise(build(kind)) is None, kind


@pytest.mark.parametrize("kind", FAST_KINDS + GENERIC_KINDS)
def test_gradcheck_float64(kind: str) -> None:
    mlp = build(kind, 6, 10).double()
    names = [n for n, p in mlp.named_parameters() if p.requires_grad]
    params = tuple(
        p.detach().clone().requires_grad_() for n, p in mlp.named_parameters() if n in names
    )
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)

    def f(x: torch.Tensor, *ps: torch.Tensor) -> torch.Tensor:
        return _tiled_with(mlp, names, ps, x)

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


def _tiled_with(
    mlp: torch.nn.Module, names: list[str], ps: tuple[torch.Tensor, ...], x: torch.Tensor
) -> torch.Tensor:
    return functional_call(
        _Tiled(mlp, 3), {f"mlp.{n}": p for n, p in zip(names, ps)}, (x,), strict=False
    )


class _Tiled(torch.nn.Module):
    def __init__(self, mlp: torch.nn.Module, tiles: int) -> None:
        super().__init__()
        self.mlp = mlp
        self.tiles = tiles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tiled_mlp(self.mlp, x, num_tiles=self.tiles)


CASES = {
    # name: (input shape, tile policy kwargs)
    "3d_batch2_uneven": ((2, 13, 16), {"num_tiles": 4}),
    "3d_batch3_seq1": ((3, 1, 16), {"num_tiles": 2}),
    "2d_uneven": ((13, 16), {"num_tiles": 3}),
    "one_tile": ((2, 7, 16), {"num_tiles": 1}),
    "more_tiles_than_tokens": ((2, 3, 16), {"num_tiles": 40}),
    "tile_tokens": ((2, 11, 16), {"tile_tokens": 5}),
    "nine_rows_four_tiles": ((9, 16), {"num_tiles": 4}),
    "zero_tokens_3d": ((2, 0, 16), {"num_tiles": 4}),
    "zero_tokens_2d": ((0, 16), {"num_tiles": 4}),
    "arctic": ((2, 20, 16), {"num_tiles": "arctic"}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kind", FAST_KINDS + GENERIC_KINDS)
def test_float32_parity(kind: str, case: str) -> None:
    shape, policy = CASES[case]
    mlp = build(kind)
    x = torch.randn(*shape, requires_grad=True)
    dy = torch.randn(*shape[:-1], 16)  # non-uniform upstream gradient
    ref = grads_of(mlp, mlp, x, [dy])
    got = grads_of(lambda t: tiled_mlp(mlp, t, **policy), mlp, x, [dy])
    assert_same_grads(got, ref)


@pytest.mark.parametrize("kind", FAST_KINDS + GENERIC_KINDS)
def test_input_without_grad_still_trains_weights(kind: str) -> None:
    mlp = build(kind)
    x = torch.randn(2, 9, 16)  # e.g. frozen embeddings: x.requires_grad is False
    dy = torch.randn(2, 9, 16)
    ref = grads_of(mlp, mlp, x, [dy])
    got = grads_of(lambda t: tiled_mlp(mlp, t, num_tiles=4), mlp, x, [dy])
    assert all(g is not None for g in got[2] if g is not None) and any(
        g is not None for g in got[2]
    )
    assert_same_grads(got, ref)


@pytest.mark.parametrize("kind", ["swiglu", "fused_bias", "plain", "normed"])
def test_frozen_weights_get_no_grad(kind: str) -> None:
    mlp = build(kind)
    params = list(mlp.parameters())
    params[0].requires_grad_(False)
    x = torch.randn(2, 9, 16, requires_grad=True)
    dy = torch.randn(2, 9, 16)
    ref = grads_of(mlp, mlp, x, [dy])
    got = grads_of(lambda t: tiled_mlp(mlp, t, num_tiles=3), mlp, x, [dy])
    assert got[2][0] is None
    assert_same_grads(got, ref)


def test_lora_base_gets_no_grad_adapters_exact() -> None:
    mlp = build("lora")
    x = torch.randn(2, 10, 16, requires_grad=True)
    dy = torch.randn(2, 10, 16)
    got = grads_of(lambda t: tiled_mlp(mlp, t, num_tiles=4), mlp, x, [dy])
    ref = grads_of(mlp, mlp, x, [dy])
    names = [n for n, _ in mlp.named_parameters()]
    for name, g in zip(names, got[2]):
        assert (g is not None) == ("lora_" in name), name
    assert_same_grads(got, ref)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from([*FAST_KINDS, "normed"]),
    batch=st.integers(0, 3),
    seq=st.integers(0, 17),
    tiles=st.integers(1, 20),
    three_d=st.booleans(),
    hidden=st.sampled_from([4, 8, 12]),
    intermediate=st.sampled_from([4, 10, 32]),
)
def test_random_shapes_match_untiled(
    kind: str, batch: int, seq: int, tiles: int, three_d: bool, hidden: int, intermediate: int
) -> None:
    mlp = build(kind, hidden, intermediate)
    shape = (batch, seq, hidden) if three_d else (batch * seq, hidden)
    x = torch.randn(*shape, requires_grad=True)
    dy = torch.randn(*shape)
    ref = grads_of(mlp, mlp, x, [dy])
    got = grads_of(lambda t: tiled_mlp(mlp, t, num_tiles=tiles), mlp, x, [dy])
    assert_same_grads(got, ref)
