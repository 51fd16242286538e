"""Tile math: explicit split sizes, never assuming the requested count."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tiledmlp.ops.tiling.tiles import TilePlan, arctic_num_tiles, split_by_tile_tokens, split_even


def test_nine_rows_four_tiles_gives_four_tiles() -> None:
    # torch.chunk(9 rows, 4) returns 3 chunks; code that assumes 4 mis-flags the last tile.
    assert len(torch.chunk(torch.empty(9), 4)) == 3
    assert split_even(9, 4).sizes == (3, 2, 2, 2)


def test_more_tiles_than_tokens() -> None:
    assert split_even(3, 8).sizes == (1, 1, 1)


def test_zero_tokens() -> None:
    plan = split_even(0, 4)
    assert plan.sizes == () and plan.num_tokens == 0 and plan.max_tile == 0


def test_tile_tokens_remainder_last() -> None:
    assert split_by_tile_tokens(10, 4).sizes == (4, 4, 2)
    assert split_by_tile_tokens(8, 4).sizes == (4, 4)


def test_arctic_rule() -> None:
    assert arctic_num_tiles(8192, 4096) == 2
    assert arctic_num_tiles(8193, 4096) == 3
    assert arctic_num_tiles(10, 4096) == 1
    assert arctic_num_tiles(0, 4096) == 1


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_counts_rejected(bad: object) -> None:
    with pytest.raises(ValueError, match="num_tiles must be an int"):
        split_even(4, bad)  # type: ignore[arg-type]


def test_plan_rejects_empty_tiles() -> None:
    with pytest.raises(ValueError, match="positive"):
        TilePlan((2, 0))


@given(st.integers(0, 5000), st.integers(1, 300))
def test_split_even_properties(tokens: int, tiles: int) -> None:
    plan = split_even(tokens, tiles)
    assert plan.num_tokens == tokens
    assert plan.num_tiles == min(tokens, tiles)
    if plan.sizes:
        assert max(plan.sizes) - min(plan.sizes) <= 1
    bounds = list(plan.bounds())
    assert [b - a for a, b in bounds] == list(plan.sizes)
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(len(bounds) - 1))


@given(st.integers(0, 5000), st.integers(1, 700))
def test_split_by_tile_tokens_properties(tokens: int, tile: int) -> None:
    plan = split_by_tile_tokens(tokens, tile)
    assert plan.num_tokens == tokens
    assert all(s == tile for s in plan.sizes[:-1])
    assert all(0 < s <= tile for s in plan.sizes)


def test_a_walk_is_what_bounds_yields_inside_its_block_in_its_thread_only() -> None:
    """walking_tiles: the planner's hook (Note [The tile-loop contract]) is scoped to the block
    and the thread; outside them bounds() walks every tile."""
    import threading

    from tiledmlp.ops.tiling.tiles import walking_tiles

    plan = split_even(10, 4)
    every = [(0, 3), (3, 6), (6, 8), (8, 10)]

    def first_only(p: TilePlan) -> Iterator[tuple[int, int]]:
        return iter(list(p.every_tile())[:1])

    seen: list[list[tuple[int, int]]] = []
    with walking_tiles(first_only):
        assert list(plan.bounds()) == [(0, 3)]
        other = threading.Thread(target=lambda: seen.append(list(plan.bounds())))
        other.start()
        other.join()
        with walking_tiles(lambda p: iter(())):
            assert list(plan.bounds()) == []
        assert list(plan.bounds()) == [(0, 3)]
    assert seen == [every]
    assert list(plan.bounds()) == every
    with pytest.raises(RuntimeError), walking_tiles(first_only):
        raise RuntimeError("a step that fails")
    assert list(plan.bounds()) == every
