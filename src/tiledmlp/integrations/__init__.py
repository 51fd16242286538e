"""Integrations: the only code that knows DDP, FSDP, DeepSpeed and TRL internals (one file per
engine or framework).

The engines' checks and backends are declared in tiledmlp/registrations.py, which the patching
layer imports on a tiled call's first need; every engine module imports its framework lazily,
so nothing here loads torch.distributed.fsdp or deepspeed until a distributed run needs it.
"""

from tiledmlp.integrations import deepspeed, fsdp, trl

__all__ = ["deepspeed", "fsdp", "trl"]
