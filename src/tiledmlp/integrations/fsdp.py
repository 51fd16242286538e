"""FSDP2 (fully_shard) and FSDP1 (FullyShardedDataParallel): what tiling needs from them,
checked on every tiled call.

The FSDP unit must contain the whole MLP (the decoder layer, or the MLP module itself): both
engines gather a unit's parameters for the unit's forward and backward, and the tiled op uses
the MLP's weights for the whole call. If the MLP's inner Linear layers are sharded as units of
their own, their weights are only gathered inside their own forward, which the tiled op does not
call layer by layer: the tiled gradients could not reach the sharded parameters. That layout is
refused with a clear error, for either engine.

FSDP1 runs on CPU only with an explicit `device_id=torch.device("cpu")` (without one, torch
refuses: "FSDP needs a non-CPU accelerator device"); flat parameters (`use_orig_params=False`)
and original parameters both work, since the tiled op takes the weights the unit exposes in its
forward as inputs of its autograd Function.
"""

from __future__ import annotations

from torch import nn

__all__ = ["check_mlp"]


def _sharded_units() -> tuple[type, ...]:
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return (FSDPModule, FullyShardedDataParallel)


def check_mlp(module: nn.Module) -> None:
    """Raises when the tiled MLP `module` has FSDP units (fully_shard or FSDP1) inside it."""
    units = _sharded_units()
    inner = [n for n, m in module.named_modules() if m is not module and isinstance(m, units)]
    if inner:
        raise ValueError(
            f"tiledmlp: inside the tiled {type(module).__name__}, {inner} are sharded by FSDP "
            "as units of their own; the tiled op needs the whole MLP in one FSDP unit (its "
            "weights gathered for the whole call). Apply fully_shard (or FSDP1's auto-wrap "
            "policy) to the MLP module or to the decoder layer, not to the MLP's Linear layers."
        )
