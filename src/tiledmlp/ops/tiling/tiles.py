"""Tile plans: how a run of flattened tokens is cut into tiles.

Invariant: a plan's split sizes are computed once per call and used by the forward and the
backward alike; every size is positive and the sizes sum to the token count (an empty input has
an empty plan). Code never assumes it got the number of tiles it asked for: with more tiles
requested than tokens, the plan simply has one tile per token.

Note [The tile-loop contract]: a tiled op walks its tiles with `TilePlan.bounds()` (never with
offsets of its own from `sizes`), and its loop body branches on the tile's index only for the
first tile (which may allocate accumulators or output buffers, or keep its output): every later
tile of one size runs the same code on the same shapes. The planner relies on both: inside
`walking_tiles` (plan/sim/periodic_tiles.py) `bounds()` may stop yielding a size's tiles once,
on fake tensors, one of them is seen to repeat the tiles before it.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tiledmlp.ops.tiling.values import check_int

__all__ = [
    "TileCount",
    "TilePlan",
    "arctic_num_tiles",
    "split_by_tile_tokens",
    "split_even",
    "walking_tiles",
]

TileWalk = Callable[["TilePlan"], Iterator[tuple[int, int]]]
# the walk `TilePlan.bounds` hands its plan to inside `walking_tiles`; None: every tile in order
_WALK: contextvars.ContextVar[TileWalk | None] = contextvars.ContextVar("tile_walk", default=None)


@dataclass(frozen=True)
class TilePlan:
    """Explicit split of `num_tokens` flattened tokens into contiguous tiles.

    Attributes:
        sizes: tokens in each tile, in order; all positive.
    """

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.sizes and min(self.sizes) <= 0:
            raise ValueError(f"tile sizes must all be positive, got {self.sizes}")

    @property
    def num_tiles(self) -> int:
        return len(self.sizes)

    @property
    def num_tokens(self) -> int:
        return sum(self.sizes)

    @property
    def max_tile(self) -> int:
        return max(self.sizes, default=0)

    def bounds(self) -> Iterator[tuple[int, int]]:
        """Yields (start, stop) token offsets of each tile; inside `walking_tiles`, what its walk
        yields for this plan (Note [The tile-loop contract]). A graph torch.compile traces walks
        every tile: the planner's walk runs eagerly, and dynamo cannot read a context variable."""
        if torch.compiler.is_compiling():
            return self.every_tile()
        walk = _WALK.get()
        return self.every_tile() if walk is None else walk(self)

    def every_tile(self) -> Iterator[tuple[int, int]]:
        """Yields (start, stop) token offsets of every tile, in order."""
        start = 0
        for size in self.sizes:
            yield start, start + size
            start += size


@contextlib.contextmanager
def walking_tiles(walk: TileWalk) -> Iterator[None]:
    """Within the block (in this thread), `TilePlan.bounds()` returns `walk(plan)`: the
    planner's hook to cut repeated tiles on fake tensors (Note [The tile-loop contract])."""
    token = _WALK.set(walk)
    try:
        yield
    finally:
        _WALK.reset(token)


def split_even(num_tokens: int, num_tiles: int) -> TilePlan:
    """Splits tokens into at most `num_tiles` tiles whose sizes differ by at most one.

    Args:
        num_tokens: tokens to split (>= 0).
        num_tiles: tiles requested (>= 1). With fewer tokens than tiles, every token is a tile.

    Returns:
        The plan; larger tiles come first.
    """
    _check_count("num_tokens", num_tokens, minimum=0)
    _check_count("num_tiles", num_tiles, minimum=1)
    tiles = min(num_tiles, num_tokens)
    if tiles == 0:
        return TilePlan(())
    base, extra = divmod(num_tokens, tiles)
    return TilePlan((base + 1,) * extra + (base,) * (tiles - extra))


def split_by_tile_tokens(num_tokens: int, tile_tokens: int) -> TilePlan:
    """Splits tokens into tiles of `tile_tokens` tokens; the last tile holds the remainder."""
    _check_count("num_tokens", num_tokens, minimum=0)
    _check_count("tile_tokens", tile_tokens, minimum=1)
    full, rest = divmod(num_tokens, tile_tokens)
    return TilePlan((tile_tokens,) * full + ((rest,) if rest else ()))


def arctic_num_tiles(num_tokens: int, hidden_size: int) -> int:
    """The Arctic Long Sequence Training rule: ceil(tokens / hidden_size), at least one tile."""
    _check_count("num_tokens", num_tokens, minimum=0)
    _check_count("hidden_size", hidden_size, minimum=1)
    return max(1, math.ceil(num_tokens / hidden_size))


def _check_count(name: str, value: int, *, minimum: int) -> None:
    check_int(name, value, minimum=minimum)


@dataclass
class TileCount:
    """How many tiles the calls of one module ran (the caller owns it; tiled_mlp adds to it).

    Attributes:
        calls: calls counted.
        tiles: tiles over all calls (an untiled call counts as 1).
        last: tiles of the latest call.
    """

    calls: int = 0
    tiles: int = 0
    last: int = 0

    def add(self, tiles: int) -> None:
        self.calls += 1
        self.tiles += tiles
        self.last = tiles
