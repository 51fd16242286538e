"""Named parameters of a recognised MLP: a weight and an optional bias per projection.

The same shape holds the module's tensors, their casts to the compute dtype, and the fast
engine's gradient accumulators, so each projection is reached by name (first, up, down), never
by a position in a flat list.

Invariant: `flat()` lists weight, bias per projection in the order first, up, down (None where a
projection has no bias, or where a slot holds nothing), the order of MLPStructure.params();
`of` reads each of the module's tensors exactly once (a parametrized weight, e.g. spectral norm
in training, runs its parametrization once per call, as in the untiled module).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.nn.functional as F

from tiledmlp.ops.mlp.structure import MLPKind, MLPStructure

__all__ = ["LinearParams", "MLPParams"]

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True)
class LinearParams(Generic[T]):
    """One projection's weight and bias (None: the projection has no bias)."""

    weight: T
    bias: T | None

    def map(self, f: Callable[[T], U]) -> LinearParams[U]:
        """f applied to the weight and, where there is one, the bias (weight first)."""
        return LinearParams(f(self.weight), None if self.bias is None else f(self.bias))

    def __call__(self: LinearParams[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T (+ bias): the projection applied to x of shape (n, in_features)."""
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class MLPParams(Generic[T]):
    """The projections of a recognised MLP.

    Attributes:
        first: the first projection of x: gate (gated), gate_up (fused gated) or fc1 (plain).
        up: the separate up projection of a gated MLP; None for fused gated and plain MLPs.
        down: the output projection.
    """

    first: LinearParams[T]
    up: LinearParams[T] | None
    down: LinearParams[T]

    @staticmethod
    def of(structure: MLPStructure) -> MLPParams[torch.Tensor]:
        """The module's weights and biases, each read once."""
        lins = [LinearParams(lin.weight, lin.bias) for lin in structure.linears]
        if structure.kind is MLPKind.GATED:
            first, up, down = lins
            return MLPParams(first, up, down)
        first, down = lins
        return MLPParams(first, None, down)

    def projections_of_x(self) -> list[LinearParams[T]]:
        """The projections that read x: [first] or, for a gated MLP, [first, up]."""
        return [self.first] if self.up is None else [self.first, self.up]

    def map(self, f: Callable[[T], U]) -> MLPParams[U]:
        """f applied to every tensor, in the order of `flat()`."""
        first = self.first.map(f)
        up = None if self.up is None else self.up.map(f)
        return MLPParams(first, up, self.down.map(f))

    def flat(self) -> list[T | None]:
        """Weight, bias per projection: first, up (when there is one), down."""
        return [t for lin in (*self.projections_of_x(), self.down) for t in (lin.weight, lin.bias)]
