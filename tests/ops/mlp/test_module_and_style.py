"""The TiledMLP wrapper and odd memory layouts (ruff and mypy run in .ci/run)."""

from __future__ import annotations

import pytest
import torch

from tiledmlp import TiledMLP, TiledMLPConfig, tiled_mlp

from conftest import assert_same_grads, grads_of, make_mlp


@pytest.mark.parametrize("kind", ["swiglu", "fused", "normed"])
def test_tiled_mlp_module_matches(kind: str) -> None:
    mlp = make_mlp(kind)
    wrapped = TiledMLP(mlp, TiledMLPConfig(num_tiles=3))
    x = torch.randn(2, 7, 16, requires_grad=True)
    dy = torch.randn(2, 7, 16)
    assert_same_grads(grads_of(wrapped, mlp, x, [dy]), grads_of(mlp, mlp, x, [dy]))
    assert "num_tiles=3" in repr(wrapped)


def test_non_contiguous_input_and_expanded_upstream_grad() -> None:
    mlp = make_mlp("swiglu_bias")
    base = torch.randn(7, 2, 16)
    x = base.transpose(0, 1)  # (2, 7, 16), not contiguous
    assert not x.is_contiguous()
    ref = grads_of(mlp, mlp, x.requires_grad_(), [torch.ones(2, 7, 16).expand(2, 7, 16)])
    got = grads_of(
        lambda t: tiled_mlp(mlp, t.transpose(0, 1).contiguous().transpose(0, 1), num_tiles=4),
        mlp,
        x,
        [torch.ones(1, 1, 16).expand(2, 7, 16)],  # stride-0 gradient, as from y.sum()
    )
    assert_same_grads(got, ref)
