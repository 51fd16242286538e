"""TileEngine: the one interface the tiled MLP's autograd Function and tiled_mlp() drive.

Two engines implement it: FastEngine (ops/mlp/fast.py: minimal recompute for a recognised MLP) and
GenericEngine (ops/mlp/generic.py: per-tile recompute of any token-wise module). The Function and the
functional entry point call only these members, never ask which engine they hold.

Invariant: an engine's forward keeps no autograd graph and no intermediates; its backward
recomputes from the very tensors the forward used (`weights`, kept by reference) over the same
tile plan, and returns each entry of `params` its gradient once, summed over tiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tiledmlp.ops.tiling.backend import ParamBackend
from tiledmlp.ops.tiling.tiles import TilePlan

__all__ = ["TileEngine"]


class TileEngine(Protocol):
    """Tiled forward and backward of one module call.

    Attributes:
        backend: how the module's parameters are made whole (ops/tiling/backend.py); the caller gathers
            `weights` around the forward and the backward.
        params: the tensors that receive gradients, in the order the autograd Function takes
            them as inputs and returns their gradients.
        weights: every tensor the computation reads (trainable or not), kept by reference.
        returns_tuple: known after `forward`: whether the module returns a tuple of outputs
            (else one tensor).
    """

    @property
    def backend(self) -> ParamBackend: ...

    @property
    def params(self) -> list[torch.Tensor]: ...

    @property
    def weights(self) -> list[torch.Tensor]: ...

    @property
    def returns_tuple(self) -> bool: ...

    def untiled_keeps(self, x: torch.Tensor) -> dict[int, bool]:
        """Per weight (by id), whether the untiled module's autograd would keep it by reference
        for its backward, for an input like x; weights missing from the result: not known."""
        ...

    def forward(
        self, x: torch.Tensor, plan: TilePlan, extras: Sequence[torch.Tensor]
    ) -> list[torch.Tensor | None]:
        """Runs the module tile by tile without keeping graphs.

        Args:
            x: (tokens, hidden).
            plan: the tile split (at least one tile).
            extras: per-token extra inputs, each (tokens, ...), split with x.

        Returns:
            The module's outputs, each (tokens, ...) flattened over tokens, None kept.
        """
        ...

    def output_slots(self) -> tuple[bool | None, ...]:
        """Per output of the module, known after `forward`: None where the module returned None
        (the autograd Function drops it), else whether the output keeps x's leading dims
        (True) or is flattened to (tokens, ...) (False, e.g. MoE router logits)."""
        ...

    def backward_needed(self, grad_outs: Sequence[torch.Tensor | None]) -> bool:
        """Whether a backward with these upstream gradients (one per tensor output) has work;
        False: the Function returns no gradient at all, without gathering or recomputing."""
        ...

    def backward(
        self,
        x: torch.Tensor,
        extras: Sequence[torch.Tensor],
        grad_outs: Sequence[torch.Tensor | None],
        plan: TilePlan,
        needs_x: bool,
        needs_extras: Sequence[bool],
        needs_params: Sequence[bool],
    ) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Recomputes each tile and sums its gradients, with no autograd graph kept.

        Args:
            x: (tokens, hidden), the forward input.
            extras: per-token extra inputs, each (tokens, ...).
            grad_outs: per output slot (None where the output is None or got no gradient),
                each (tokens, ...) flattened over tokens.
            plan: the same tile split the forward used.
            needs_x: whether to return a gradient for x.
            needs_extras: per extra input, whether it needs a gradient.
            needs_params: per entry of `params`, whether it needs a gradient.

        Returns:
            (dx of shape (tokens, hidden) or None, per-extra gradients or None, per-parameter
            gradients or None).
        """
        ...

    def recompute_tile(
        self, x_tile: torch.Tensor, extra_tiles: Sequence[torch.Tensor], i: int
    ) -> list[torch.Tensor | None]:
        """Tile i's outputs under autograd, for a graph of the backward (create_graph=True),
        with the forward's state; inputs stay part of the caller's graph.

        Args:
            x_tile: (n, hidden), part of the autograd graph.
            extra_tiles: the per-token extra inputs' rows of this tile.
            i: the tile's index in the plan.

        Returns:
            The module's outputs, each (n, ...), None kept.
        """
        ...
