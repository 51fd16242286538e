"""The memory model of a recognised MLP: bytes a step needs beyond weights, inputs and outputs.

"auto" and "target:<GB>" tile policies size an MLP's tiles with it (tile_rules.py); the planner
reuses it. `assume_device` (ops/tiling/assumed.py) lets the planner resolve for an accelerator
on fake CPU tensors.

Invariant: the figures depend only on the structure's shapes, dtypes and device type, never on
free memory, so every rank with the same inputs gets the same answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiledmlp.ops.mlp.structure import MLPKind, MLPStructure
from tiledmlp.ops.tiling.assumed import assumed_type
from tiledmlp.ops.tiling.grads import fp32_epilogue

__all__ = [
    "ACCELERATOR_MAX_TILE_BYTES",
    "ACCELERATOR_MIN_TILE_TOKENS",
    "ACCELERATOR_SAVING",
    "GENERIC_WIDTH",
    "MemoryModel",
]

GENERIC_WIDTH = 4  # intermediate / hidden assumed for "target:<GB>" without a memory model
ACCELERATOR_MIN_TILE_TOKENS = 8192
ACCELERATOR_MAX_TILE_BYTES = 2 * 2**30
ACCELERATOR_SAVING = 0.9


@dataclass(frozen=True)
class MemoryModel:
    """Bytes a recognised MLP needs beyond weights, grads, input, output and their gradients.

    Coefficients count (tokens, intermediate) tensors alive at the peak; measured with the
    torch.profiler's memory events (tests/ops/mlp/test_memory.py holds them to it).
    """

    structure: MLPStructure
    compute_dtype: torch.dtype
    # The structure's parameters as the op uses them (weight, bias per linear, None where no
    # bias); default: read from the structure. The op passes the tensors it already holds, so a
    # parametrized weight (spectral_norm) is evaluated once per call, as in the untiled module.
    params: tuple[torch.Tensor | None, ...] | None = None

    def _params(self) -> list[torch.Tensor]:
        params = self.params if self.params is not None else self.structure.params()
        return [p for p in params if p is not None]

    # (tokens, intermediate) tensors above weights/grads/x/y/dy/dx at the peak of a step,
    # measured at long sequences (fp32, h256/m768): untiled SwiGLU 5.5, untiled plain 2.6;
    # tiled per tile 5 (gated) and 4 (plain), see fast.py.
    UNTILED_GATED = 5.5
    UNTILED_PLAIN = 2.5
    TILED_GATED = 5.0
    TILED_PLAIN = 4.0

    @property
    def _elem(self) -> int:
        return torch.empty((), dtype=self.compute_dtype).element_size()

    def untiled_bytes(self, tokens: int) -> float:
        c = self.UNTILED_PLAIN if self.structure.kind is MLPKind.PLAIN else self.UNTILED_GATED
        return c * tokens * self.structure.intermediate_size * self._elem

    def tiled_bytes(self, tile_tokens: int) -> float:
        c = self.TILED_PLAIN if self.structure.kind is MLPKind.PLAIN else self.TILED_GATED
        return c * tile_tokens * self.structure.intermediate_size * self._elem + self._acc_bytes()

    def _acc_bytes(self) -> float:
        """Extra bytes of grads.GradSlot: a float32 accumulator beside the final low-precision
        gradient for every parameter whose gradient is not summed in place, and one shared
        scratch in the compute dtype where the GEMM cannot accumulate in float32 (see
        grads.py)."""
        wide = (torch.float32, torch.float64)
        params = self._params()
        indirect = [p for p in params if not (p.dtype == self.compute_dtype and p.dtype in wide)]
        if not indirect:
            return 0.0
        acc = sum(4 * p.numel() for p in indirect if p.dtype not in wide)
        if fp32_epilogue(indirect[0].device, self.compute_dtype):
            return acc  # tile products accumulate in the GEMM: no scratch
        return acc + max(p.numel() for p in indirect) * self._elem

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._params())

    @property
    def on_accelerator(self) -> bool:
        """Whether the "auto" rule is the accelerator's (module docstring)."""
        assumed = assumed_type()
        if assumed is not None:
            return assumed != "cpu"
        params = self._params()
        return bool(params) and params[0].device.type not in ("cpu", "meta")

    def accelerator_tile_tokens(self, num_tokens: int) -> int:
        """The accelerator's "auto" tile size for `num_tokens` tokens (module docstring)."""
        fixed = self.tiled_bytes(0)
        per_token = self.tiled_bytes(1) - fixed
        reachable = self.untiled_bytes(num_tokens) - fixed
        keep = int((1 - ACCELERATOR_SAVING) * reachable // per_token) if per_token > 0 else 0
        cap = int(ACCELERATOR_MAX_TILE_BYTES // per_token) if per_token > 0 else keep
        return max(ACCELERATOR_MIN_TILE_TOKENS, min(keep, cap))

    def auto_tile_tokens(self) -> int:
        c = self.TILED_PLAIN if self.structure.kind is MLPKind.PLAIN else self.TILED_GATED
        per_token = c * self.structure.intermediate_size * self._elem
        return max(1, int(self.weight_bytes() // per_token))
