"""Integrations: the only code that knows DDP, FSDP and DeepSpeed internals (one file per engine).

Importing this package registers each engine's checks with the patching layer; every engine
module imports its framework lazily, so nothing here loads torch.distributed.fsdp or deepspeed
until a distributed run needs it.
"""

from tiledmlp.integrations import deepspeed, fsdp

__all__ = ["deepspeed", "fsdp"]
