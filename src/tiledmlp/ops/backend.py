"""How a training engine's parameter sharding reaches the op: a small object passed in.

The op never inspects engines itself. An engine that partitions parameters across ranks
(DeepSpeed ZeRO-3) supplies a backend whose `gathered(params)` makes the full parameters present
for a block of work (the tiled forward, then the tiled backward), and which says that the
child modules' hooks are the engine's own parameter fetching (so the fast path may bypass them).

Invariant: the default backend does nothing; with any backend, every rank gathers the same
parameters in the same order (once per tiled call in the forward and once in the backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

__all__ = ["LOCAL", "ParamBackend"]


class ParamBackend:
    """Default: parameters are always whole and local; child hooks are user behaviour."""

    #: Child modules' forward hooks belong to the engine (parameter fetching), not to the model.
    engine_hooks: bool = False

    def gathered(self, params: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[object]:
        """A context in which `params` hold their full values."""
        del params
        return contextlib.nullcontext()

    def gathered_for_backward(
        self, params: Sequence[torch.Tensor]
    ) -> contextlib.AbstractContextManager[object]:
        """Like gathered(), for the backward: the engine may keep a parameter whole until
        autograd has accumulated the gradient the backward returns for it."""
        return self.gathered(params)


LOCAL = ParamBackend()
