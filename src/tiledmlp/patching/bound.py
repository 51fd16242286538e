"""Forwards installed on module instances that copy and pickle with their module.

A patched forward is an instance attribute. A closure or a `types.MethodType` there breaks two
real uses: `pickle` / `torch.save` of the model (a local function cannot be pickled; a bound
method is re-read by name while the module is still being rebuilt), and `copy.deepcopy` when
the forward captures state of the original. `BoundForward` calls a module-level function with
the module as its first argument: pickle stores it by reference to that function plus the module
(cycles are handled by pickle's memo), and deepcopy rebinds it to the copy. It advertises the
signature of the forward it replaced, which callers such as the Hugging Face Trainer inspect to
pick the inputs they pass.

It holds its module weakly (See Note [No reference cycle]).

Invariant: a copy or an unpickled model's patched forwards run on that model, never on the
original, and see the same signature as the original forward; a patched module that nothing else
references is freed at once, as the unpatched one is.
"""

from __future__ import annotations

import copy
import inspect
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["BoundForward", "bind"]

# Note [No reference cycle]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# The forward is stored in the module's own __dict__; a strong reference back to the module
# would make a cycle (module -> forward -> module) that only Python's cyclic garbage collector
# breaks, at a time of its choosing. Until it runs, a dropped patched model keeps its weights
# (on a GPU: its device memory) allocated, where an unpatched one is freed at once; a process that
# builds one model after another (a sweep, a reference model, a benchmark) then holds several.
# Holding the module through a weak reference keeps the lifetime that of the module.


class BoundForward:
    """fn(module, *args, **kwargs) as `module.forward`, the module held weakly.

    Attributes:
        func: the module-level function called.
        replaced: a module-level function that returns, for the module, the forward this one
            replaced (its signature is advertised).
    """

    def __init__(
        self,
        func: Callable[..., Any],
        module: nn.Module,
        replaced: Callable[[nn.Module], Callable[..., Any]],
    ) -> None:
        self.func = func
        self.replaced = replaced
        self._module = weakref.ref(module)

    @property
    def module(self) -> nn.Module:
        module = self._module()
        if module is None:
            raise ReferenceError(
                f"tiledmlp: the module whose forward this is ({self.func.__name__}) was freed; "
                "call the module (keep a reference to it), not its forward alone"
            )
        return module

    @property
    def args(self) -> tuple[nn.Module]:
        """(module,), as the arguments bound before the caller's."""
        return (self.module,)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(self.module, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        return (bind, (self.func, self.module, self.replaced))

    def __deepcopy__(self, memo: dict[int, Any]) -> BoundForward:
        return bind(self.func, copy.deepcopy(self.module, memo), self.replaced)

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
    return BoundForward(fn, module, replaced)
