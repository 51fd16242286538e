"""transformers' checkpoint offload on fake tensors, and the host bytes each offloader keeps.

`activation_checkpointing_enable(offload=True)` runs each checkpointed layer inside
`torch.autograd.graph.save_on_cpu(pin_memory=True)`: what the non-reentrant checkpoint saves
outside its own hooks (the layer's positional input, its hidden states) is copied into a new
pinned host tensor, so the device tensor is released once nothing else holds it, and unpacked
at the layer's recompute with `.to(device)`: a new device tensor. On fake tensors the host copy
is a meta tensor (host memory is not device memory) and the unpacked one a new tensor on the
simulated device: the same device storages, created and released at the same moments. Where
the stack offloads with tiledmlp's offloader, that one replaces transformers' (Note [One
offloader]) and nothing here runs.

Invariant: `host_offload` applies only to layers whose checkpoint function is transformers'
offloading one; `offloaded_bytes` is what either offloader holds on the host at the end of the
forward (tests/plan/test_native_offload_plan.py counts both on real steps).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tiledmlp.ops.offloading.host_memory import offload_bytes
from tiledmlp.patching.features.activation_offloading import transformers_offload_plain

__all__ = ["HostCheckpoint", "checkpointed_layers", "host_offload", "offloaded_bytes"]


class HostCheckpoint:
    """A layer's checkpoint function: `plain` (torch's non-reentrant checkpoint) inside
    save_on_cpu's pack and unpack, the host copy on the meta device (module docstring)."""

    def __init__(self, plain: Any) -> None:
        self.plain = plain

    def __call__(self, function: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.saved_tensors_hooks(_to_host, _to_device):
            return self.plain(function, *args, **kwargs)


def _to_host(t: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
    return t.device, torch.empty(t.shape, dtype=t.dtype, device="meta")


def _to_device(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    device, host = packed
    return torch.empty(host.shape, dtype=host.dtype, device=device)


def host_offload(model: nn.Module) -> int:
    """Replaces transformers' offloading checkpoint function of each of `model`'s layers by
    HostCheckpoint around the same plain checkpoint; returns how many layers it replaced."""
    n = 0
    for m in model.modules():
        plain = transformers_offload_plain(m.__dict__.get("_gradient_checkpointing_func"))
        if plain is not None:
            m._gradient_checkpointing_func = HostCheckpoint(plain)  # type: ignore[assignment]
            n += 1
    return n


def checkpointed_layers(layers: int, every_n_layers: int) -> int:
    """How many of `layers` decoder layers are checkpointed with `every_n_layers` (0, N, 2N,
    ...: transformers' choice)."""
    return len(range(0, layers, every_n_layers))


def offloaded_bytes(
    layers: int, tokens: int, hidden: int, element_size: int, *, every_n_layers: int, ours: bool
) -> int:
    """Host bytes of the checkpointed layers' inputs one step keeps: tiledmlp's offloader
    (`ours`) keeps every checkpointed layer's but the last's (ops/offloading/host_memory.py),
    transformers' save_on_cpu every one's, the last included."""
    n = checkpointed_layers(layers, every_n_layers)
    if ours:
        return offload_bytes(n, tokens, hidden, element_size)
    return n * tokens * hidden * element_size
