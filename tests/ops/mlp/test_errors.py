"""Bad input gets a clear error naming what was expected and what was got."""

from __future__ import annotations

import pytest
import torch

from tiledmlp import TiledMLPConfig, tiled_mlp

from conftest import make_mlp
from generic_modules import ClosesOverParam, TokenMixer


@pytest.mark.parametrize("bad", [0, -2, 1.5, True, "many", None, "AUTO", "target"])
def test_bad_num_tiles(bad: object) -> None:
    with pytest.raises(
        ValueError,
        match=r"num_tiles must be a positive int, 'auto', 'arctic' or 'target:<GB>', got",
    ):
        tiled_mlp(make_mlp("swiglu"), torch.randn(4, 16), num_tiles=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["target:", "target:0", "target:-1", "target:nan", "target:x"])
def test_bad_target_budget(bad: str) -> None:
    with pytest.raises(ValueError, match=r"expected 'target:<GB>' with a positive number of GiB"):
        tiled_mlp(make_mlp("swiglu"), torch.randn(4, 16), num_tiles=bad)


@pytest.mark.parametrize("bad", [0, -1, 2.0, False])
def test_bad_tile_tokens(bad: object) -> None:
    with pytest.raises(ValueError, match="tile_tokens must be an integer >= 1"):
        tiled_mlp(make_mlp("swiglu"), torch.randn(4, 16), tile_tokens=bad)  # type: ignore[arg-type]


def test_num_tiles_and_tile_tokens_together() -> None:
    with pytest.raises(ValueError, match="either num_tiles or tile_tokens"):
        tiled_mlp(make_mlp("swiglu"), torch.randn(4, 16), num_tiles=2, tile_tokens=2)


@pytest.mark.parametrize("kind", ["swiglu", "fused", "plain"])
def test_wrong_hidden_size(kind: str) -> None:
    with pytest.raises(ValueError, match=r"last dimension is 12 but the MLP's hidden size is 16"):
        tiled_mlp(make_mlp(kind), torch.randn(2, 5, 12), num_tiles=2)


def test_wrong_hidden_size_generic_with_declared_size() -> None:
    mlp = make_mlp("normed")
    mlp.hidden_size = 16  # type: ignore[assignment]
    with pytest.raises(ValueError, match="hidden size is 16"):
        tiled_mlp(mlp, torch.randn(2, 5, 12), num_tiles=2)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.int32])
def test_non_floating_x(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="must be a floating-point tensor"):
        tiled_mlp(make_mlp("swiglu"), torch.zeros(2, 3, 16, dtype=dtype))


def test_not_a_tensor() -> None:
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor"):
        tiled_mlp(make_mlp("swiglu"), [[0.0] * 16])  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(16,), (1, 2, 3, 16)])
def test_bad_rank(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"\(batch, seq, hidden\) or \(tokens, hidden\)"):
        tiled_mlp(make_mlp("swiglu"), torch.randn(*shape))


def test_dtype_mismatch() -> None:
    with pytest.raises(TypeError, match=r"x has dtype torch\.float64 but the MLP.s parameters"):
        tiled_mlp(make_mlp("swiglu"), torch.randn(2, 3, 16, dtype=torch.float64), num_tiles=2)


def test_module_that_changes_token_count() -> None:
    with pytest.raises(ValueError, match="changed the number of tokens"):
        tiled_mlp(TokenMixer(16), torch.randn(2, 6, 16), num_tiles=3)


def test_module_that_hides_a_trainable_tensor() -> None:
    outside = torch.nn.Parameter(torch.randn(16))
    x = torch.randn(2, 6, 16, requires_grad=True)
    y = tiled_mlp(ClosesOverParam(16, outside), x, num_tiles=2)
    with pytest.raises(RuntimeError, match="not one of its parameters"):
        y.sum().backward()


def test_config_validation_and_unknown_keys() -> None:
    assert TiledMLPConfig(num_tiles=4).num_tiles == 4
    with pytest.raises(ValueError, match="num_tiles must be"):
        TiledMLPConfig(num_tiles=0)
    with pytest.raises(ValueError, match=r"unknown TiledMLPConfig keys \['shards'\]"):
        TiledMLPConfig.from_dict({"shards": 4})
    with pytest.raises(TypeError):
        TiledMLPConfig(4)  # type: ignore[misc]  # keyword-only


def test_config_stores_the_policy_and_spells_it_read_only() -> None:
    import dataclasses

    from tiledmlp import TilePolicy

    config = TiledMLPConfig(tile_tokens=128, kernels=False)
    assert [f.name for f in dataclasses.fields(config)] == ["policy", "kernels"]
    assert config.policy == TilePolicy("tokens", 128)
    assert config == TiledMLPConfig(policy=TilePolicy("tokens", 128), kernels=False)
    assert (config.num_tiles, config.tile_tokens) == ("auto", 128)
    assert repr(config) == "TiledMLPConfig(num_tiles='auto', tile_tokens=128, kernels=False)"
    assert dataclasses.replace(config, kernels=True).policy is config.policy
    with pytest.raises(AttributeError):
        config.num_tiles = 4  # type: ignore[misc]  # read-only
    with pytest.raises(ValueError, match="not both"):
        TiledMLPConfig(policy=TilePolicy.of(4), num_tiles=4)
    with pytest.raises(TypeError, match="policy must be a TilePolicy"):
        TiledMLPConfig(policy=4)  # type: ignore[arg-type]
