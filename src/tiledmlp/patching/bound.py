"""Forwards installed on module instances that copy and pickle with their module.

A patched forward is an instance attribute. A closure or a `types.MethodType` there breaks two
real uses: `pickle` / `torch.save` of the model (a local function cannot be pickled; a bound
method is re-read by name while the module is still being rebuilt), and `copy.deepcopy` when
the forward captures state of the original. `BoundForward` is a `functools.partial` of a
module-level function with the module as its first argument: pickle stores it by reference to
that function plus the module (cycles are handled by pickle's memo), and deepcopy rebinds it to
the copy. It advertises the signature of the forward it replaced, which callers such as the
Hugging Face Trainer inspect to pick the inputs they pass.

Invariant: a copy or an unpickled model's patched forwards run on that model, never on the
original, and see the same signature as the original forward.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["BoundForward", "bind"]


class BoundForward(functools.partial):  # type: ignore[type-arg]
    """fn(module, *args, **kwargs) as `module.forward`.

    Attributes (besides partial's func and args):
        replaced: a module-level function that returns, for the module, the forward this one
            replaced (its signature is advertised).
    """

    replaced: Callable[[nn.Module], Callable[..., Any]]

    @property
    def module(self) -> nn.Module:
        return self.args[0]  # type: ignore[no-any-return]

    @property
    def __self__(self) -> nn.Module:
        """The module, as a bound method's __self__ would be."""
        return self.module

    @property
    def __signature__(self) -> inspect.Signature:  # type: ignore[override]
        return inspect.signature(self.replaced(self.module))


def bind(
    fn: Callable[..., Any],
    module: nn.Module,
    replaced: Callable[[nn.Module], Callable[..., Any]],
) -> BoundForward:
    """`fn` bound to `module`, advertising the signature of `replaced(module)`."""
    bound = BoundForward(fn, module)
    bound.replaced = replaced
    return bound
