"""The intermediate chunks of a tile's backward (Note [intermediate chunks]): which ranges of
the intermediate dimension, and the weights and gradient slots of one range.

Note [intermediate chunks]:
Where the weight gradients are summed in float32 over several tiles (low-precision weights),
every accumulator lives from the first tile to the last at twice its gradient's bytes. To
pay for that, the backward walks each tile's intermediate units in chunks no wider than the
hidden size (rounded up to CHUNK_ALIGN units): the recomputed projections, the activation's
gradient and the down projection's input exist for one chunk at a time, i.e. about
3 * n * hidden elements per tile of n tokens (fused kernels) instead of
3 * n * intermediate. With an activation known to be elementwise (`is_elementwise`; any
other keeps whole rows), every unit is independent of the others except through the
GEMMs, so a chunk's work is the tile's work restricted to its units: rows of
the first projections' weights (and biases), columns of the down projection's weight
(whose accumulator is kept transposed so that those columns are contiguous rows), and a
part of dx, added to the earlier chunks' parts. The FLOPs are the tile's; the down
projection's bias gradient is added once per tile.

Invariant: the chunks of a tile cover [0, intermediate) once, in order.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tiledmlp.ops.mlp.glu import kernels as glu_kernels
from tiledmlp.ops.mlp.params import LinearParams, MLPParams
from tiledmlp.ops.mlp.structure import MLPKind, MLPStructure
from tiledmlp.ops.tiling.grads import GradSlot

__all__ = ["CHUNK_ALIGN", "chunk_params", "chunk_ranges", "is_elementwise"]

CHUNK_ALIGN = 64  # a chunk's width is rounded up to this many units


# Activations that act on each element alone (exact classes); with one of these or one of the
# fused kernels' (glu_kernels.activation_kind) the backward may split the intermediate dimension.
ELEMENTWISE = (
    nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.ELU, nn.SELU, nn.CELU, nn.GELU, nn.SiLU, nn.Mish,
    nn.Hardswish, nn.Hardsigmoid, nn.Sigmoid, nn.Tanh, nn.Softplus, nn.Identity,
)  # fmt: skip


def is_elementwise(act: object) -> bool:
    """Whether `act` is known to compute each output element from its own input element alone
    (a row-wise activation such as a softmax over the intermediate units is not)."""
    if glu_kernels.activation_kind(act) is not None:
        return True
    return (
        type(act) in ELEMENTWISE
        and isinstance(act, nn.Module)
        and "forward" not in vars(act)
        and not (act._forward_hooks or act._forward_pre_hooks)
    )


def chunk_ranges(intermediate: int, hidden: int) -> list[tuple[int, int]]:
    """[start, stop) ranges of the intermediate dimension, each at most about the hidden size
    wide (rounded up to CHUNK_ALIGN); one range when it is not wider."""
    count = -(-intermediate // max(hidden, 1))
    if count <= 1:
        return [(0, intermediate)]
    width = -(-intermediate // count)
    width = -(-width // CHUNK_ALIGN) * CHUNK_ALIGN
    return [(a, min(a + width, intermediate)) for a in range(0, intermediate, width)]


def chunk_params(
    structure: MLPStructure, params: MLPParams[Any], start: int, stop: int
) -> MLPParams[Any]:
    """The weights (or gradient slots) of intermediate units [start, stop): rows of the
    projections of x (a fused gate_up becomes a gate and an up projection), columns of the down
    projection, without its bias."""
    s = structure
    m = s.intermediate_size
    if s.kind is MLPKind.FUSED_GATED:
        gate_at, up_at = (0, m) if s.gate_first else (m, 0)
        sources: list[tuple[int, int]] = [(0, gate_at), (0, up_at)]  # (projection, offset)
    elif s.kind is MLPKind.GATED:
        sources = [(0, 0), (1, 0)]
    else:
        sources = [(0, 0)]

    def rows(t: Any, at: int) -> Any:
        if t is None:
            return None
        if isinstance(t, GradSlot):
            return t.part(at + start, at + stop)
        return t[at + start : at + stop]

    def pick(params: MLPParams[Any]) -> MLPParams[Any]:
        of_x = params.projections_of_x()
        lins = [LinearParams(rows(of_x[i].weight, at), rows(of_x[i].bias, at)) for i, at in sources]
        dw = params.down.weight
        if dw is None:
            down = None
        elif isinstance(dw, GradSlot):
            down = dw.part(start, stop)  # a transposed slot: columns of the weight
        else:
            down = dw[:, start:stop]
        return MLPParams(lins[0], lins[1] if len(lins) > 1 else None, LinearParams(down, None))

    return pick(params)
