"""Integrations: the only code that knows DDP, FSDP, DeepSpeed and TRL internals (one file per
engine or framework).

Importing this package registers each engine's checks with the patching layer; every engine
module imports its framework lazily, so nothing here loads torch.distributed.fsdp or deepspeed
until a distributed run needs it.
"""

from tiledmlp.integrations import deepspeed, fsdp, trl

__all__ = ["deepspeed", "fsdp", "trl"]
