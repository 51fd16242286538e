"""Running a module on stand-in tensors, so that a probe neither depends on nor changes its state.

Structure recognition and token-wise detection decide what a module computes by running it. Run
at the module's own weights, the answer depends on their values: with a zero-initialised output
projection every candidate formula gives 0, with equal gate and up weights gate and up are
interchangeable, and the wrong answer would stay cached after training moves the weights. Run in
training mode, forwards that update buffers (spectral_norm's power iteration, running statistics)
would change the module. `stand_ins` swaps every floating-point parameter for an independent
random tensor of the same shape, dtype and device, and every buffer for a clone, for the duration
of a block; the module's own tensors are put back untouched afterwards.

Invariant: inside the block no parameter or buffer of the module is read or written; afterwards
the module holds exactly the tensor objects it held before (same values, same versions).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["StandIns", "absent", "stand_ins"]


def _random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Independent values on the scale of a default init: N(0, 1/fan_in) for matrices (so a
    projection's outputs are O(1)), N(0, 0.25) for vectors (biases, norm weights)."""
    fan_in = t.shape[-1] if t.dim() >= 2 and t.shape[-1] > 0 else 4
    r = torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32)
    r = r.mul_(1.0 / math.sqrt(fan_in)).to(t.dtype)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(r, requires_grad=t.requires_grad)
    return r


class StandIns:
    """Independent random stand-ins for a module's floating-point parameters, drawn once.

    Non-floating parameters (quantised storage), meta and fake tensors are left in place: they
    cannot be drawn at random, and a forward does not write them. Tied parameters stay tied.

    Args:
        module: the module to probe (its whole subtree).
        seed: the stand-ins' seed (a fixed seed makes a probe repeatable).
        random_params: False to keep the module's own parameters and only clone its buffers
            (a cheap first probe; random stand-ins cost one copy of the parameters).
    """

    def __init__(self, module: nn.Module, seed: int = 0, random_params: bool = True) -> None:
        self.module = module
        self._params: dict[int, torch.Tensor] = {}
        gens: dict[torch.device, torch.Generator] = {}
        for p in module.parameters() if random_params else ():
            if not p.is_floating_point() or absent(p) or id(p) in self._params:
                continue
            gen = gens.get(p.device)
            if gen is None:
                gen = gens[p.device] = torch.Generator(device=p.device).manual_seed(seed)
            self._params[id(p)] = _random_like(p, gen)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        """Within the block the module runs on the stand-in parameters and on fresh clones of
        its buffers (each block starts from the module's own buffer values, so a forward that
        updates buffers sees the same state in every block)."""
        swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
        clones: dict[int, torch.Tensor] = {}
        try:
            for sub in self.module.modules():
                params: dict[str, Any] = sub._parameters
                for name, p in list(params.items()):
                    if p is not None and id(p) in self._params:
                        swapped.append((params, name, p))
                        params[name] = self._params[id(p)]
                buffers: dict[str, Any] = sub._buffers
                for name, b in list(buffers.items()):
                    if b is None or absent(b):
                        continue
                    clone = clones.get(id(b))
                    if clone is None:
                        clone = clones[id(b)] = b.detach().clone()
                    swapped.append((buffers, name, b))
                    buffers[name] = clone
            yield
        finally:
            for table, name, t in reversed(swapped):
                table[name] = t


@contextlib.contextmanager
def stand_ins(module: nn.Module, seed: int = 0, random_params: bool = True) -> Iterator[None]:
    """Within the block, `module`'s floating-point parameters are independent random tensors
    (unless random_params is False) and its buffers are clones (see StandIns)."""
    with StandIns(module, seed, random_params).applied():
        yield


def absent(t: torch.Tensor) -> bool:
    """True for meta and fake tensors: shapes without values."""
    return t.device.type == "meta" or _is_fake(t)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
