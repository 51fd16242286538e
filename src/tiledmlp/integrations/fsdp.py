"""FSDP2 (fully_shard): what tiling needs from it, checked on every tiled call.

The FSDP unit must contain the whole MLP (the decoder layer, or the MLP module itself). If the
MLP's inner Linear layers are fully_shard-ed on their own, their weights are only gathered inside
their own forward, which the tiled op does not call layer by layer: the tiled gradients would not
reach the sharded parameters. That layout is refused with a clear error.

FSDP1 (FullyShardedDataParallel) refuses to run on a CPU-only machine ("FSDP needs a non-CPU
accelerator device"), so it is neither supported nor detected here; use FSDP2.
"""

from __future__ import annotations

from torch import nn

from tiledmlp.patching.checks import register_check

__all__ = ["check_mlp"]


def check_mlp(module: nn.Module) -> None:
    """Raises when the tiled MLP `module` has fully_shard-ed submodules of its own."""
    from torch.distributed.fsdp import FSDPModule

    inner = [n for n, m in module.named_modules() if m is not module and isinstance(m, FSDPModule)]
    if inner:
        raise ValueError(
            f"tiledmlp: inside the tiled {type(module).__name__}, {inner} are fully_shard-ed on "
            "their own; the tiled op needs the whole MLP in one FSDP unit (its weights gathered "
            "for the whole call). Apply fully_shard to the MLP module or to the decoder layer, "
            "not to the MLP's Linear layers."
        )


register_check(check_mlp)
