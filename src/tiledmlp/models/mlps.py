"""Reference MLP modules for tests and benchmarks, built without transformers.

Invariant: these are plain nn.Modules whose forward is the textbook formula for their shape, with
the child names Llama-family models use (gate_proj, up_proj, down_proj, act_fn), so they are
recognised by structure exactly like the Hugging Face classes.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["FusedGatedMLP", "GatedMLP", "PlainMLP"]


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU with act=nn.SiLU(), GeGLU with GELU."""

    def __init__(
        self, hidden: int, intermediate: int, *, bias: bool = False, act: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act_fn = act if act is not None else nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class FusedGatedMLP(nn.Module):
    """Phi-3 style: gate and up as one projection, split with chunk(2, -1)."""

    def __init__(
        self, hidden: int, intermediate: int, *, bias: bool = False, act: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.activation_fn = act if act is not None else nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.activation_fn(gate))


class PlainMLP(nn.Module):
    """fc2(act(fc1(x))), GPT-NeoX / BERT style."""

    def __init__(
        self, hidden: int, intermediate: int, *, bias: bool = True, act: nn.Module | None = None
    ) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, intermediate, bias=bias)
        self.fc2 = nn.Linear(intermediate, hidden, bias=bias)
        self.act = act if act is not None else nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
