"""How a training engine's parameter sharding reaches the op: a small object passed in.

The op never inspects engines itself. An engine that partitions parameters across ranks
(DeepSpeed ZeRO-3) supplies a backend whose `gathered(params)` makes the full parameters present
for a block of work (the tiled forward, then the tiled backward), and which says that the
child modules' hooks are the engine's own parameter fetching (so the fast path may bypass them).

The generic path calls the module's own forward per tile; under an engine whose child hooks
fetch and release parameters, those calls run with the children's forward hooks switched off
(`children_hooks_off`), inside the backend's gather of all the module's parameters.

Invariant: the default backend does nothing; with any backend, every rank gathers the same
parameters in the same order (once per tiled call in the forward and once in the backward).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence

import torch
from torch import nn

__all__ = ["LOCAL", "ParamBackend", "children_hooks_off"]

_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")


@contextlib.contextmanager
def children_hooks_off(module: nn.Module) -> Iterator[None]:
    """Runs with the forward (pre-)hooks of `module`'s descendants removed, then restores them
    (the module's own hooks are untouched: they run around the tiled call, once)."""
    saved = []
    for child in module.modules():
        if child is module:
            continue
        for name in _HOOK_DICTS:
            hooks = child.__dict__.get(name)
            if hooks:
                saved.append((child, name, hooks))
                child.__dict__[name] = OrderedDict()
    try:
        yield
    finally:
        for child, name, hooks in saved:
            child.__dict__[name] = hooks


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

    def calling(self, module: nn.Module) -> contextlib.AbstractContextManager[object]:
        """A context for calling `module`'s own forward from inside the tiled op (generic path):
        with engine hooks, the children's hooks are switched off (the backend has gathered the
        parameters already, and the engine must not fetch or release them per tile)."""
        return children_hooks_off(module) if self.engine_hooks else contextlib.nullcontext()


LOCAL = ParamBackend()
