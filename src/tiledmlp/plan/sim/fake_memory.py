"""Peak tensor memory without allocating it: run the step on fake tensors and track storages.

A TorchDispatchMode sees every op; each output's storage is counted once when it first appears
and released when the last tensor using it dies (weakref finalizers), so views, in-place ops,
autograd's saved tensors and accumulated .grad are all accounted like on a real device. Under
torch._subclasses.FakeTensorMode nothing is allocated: a 131072-token, hidden-4096 step is
estimated on the CPU in seconds.

Invariant: the result counts the tensors alive before the step (given by the caller) plus the
largest amount of new storage alive at once during it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tiledmlp.plan.sim.written_out import written_out

__all__ = ["StorageTracker", "fake_peak_bytes"]

_DEVICE = torch.ops.prim.device.default


class StorageTracker(TorchDispatchMode):
    """Tracks live bytes of storages created while active."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage key -> [nbytes, live tensor count]
        # id of a weak reference -> (it, its storage's key), kept until its tensor dies
        self._watchers: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        for t in known:
            self._refs[self._key(t)] = [0, 1 << 30]  # counted by the caller; never released

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return int(t.untyped_storage()._cdata)

    def _release(self, key: int) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._refs[key]

    def _track(self, t: torch.Tensor) -> None:
        key = self._key(t)
        entry = self._refs.get(key)
        if entry is None:
            nbytes = t.untyped_storage().nbytes()
            self._refs[key] = entry = [nbytes, 0]
            self._created(key, nbytes)
            self.live += nbytes
            if self.live > self.peak:
                self.peak = self.live
        entry[1] += 1
        # a plain weak reference with a callback (kept until it fires): the release happens
        # when the tensor dies, as with weakref.finalize, at a fraction of its cost per op
        # (by the reference's id: references to one tensor compare equal)
        ref = weakref.ref(t, self._on_death)
        self._watchers[id(ref)] = (ref, key)

    def _created(self, key: int, nbytes: int) -> None:
        """A storage of `nbytes` first seen under `key` (subclasses record it)."""

    def _on_death(self, ref: weakref.ref[torch.Tensor]) -> None:
        self._release(self._watchers.pop(id(ref))[1])

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return self._dispatch(func, args, kwargs)

    def _dispatch(self, func: Any, args: Any, kwargs: Any) -> Any:
        """The op run and its outputs tracked. A plain method: subclasses call it directly, not
        through `__torch_dispatch__`, which TorchDispatchMode wraps in a guard against dynamo
        (a cost per op and per wrapped call)."""
        if func is _DEVICE:  # a `.device` query (most dispatches on fake tensors): no storage
            t = args[0]
            if isinstance(t, FakeTensor) and not t.fake_mode.in_kernel_invocation:
                return t.fake_device  # FakeTensor's own answer, without its dispatch
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        out = written_out(func, args, kwargs)  # a GEMM into its `out=` buffer: no storage
        if out is None:
            out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):  # most ops: one tensor, no tree to flatten
            self._track(out)
            return out
        seen: set[int] = set()
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                self._track(t)
        return out


def fake_peak_bytes(step: Callable[[], object], alive: list[torch.Tensor]) -> int:
    """Peak bytes of `step` (run it under FakeTensorMode yourself), counting `alive` tensors."""
    seen: dict[int, int] = {}
    for t in alive:
        seen[int(t.untyped_storage()._cdata)] = t.untyped_storage().nbytes()
    tracker = StorageTracker(alive)
    with tracker:
        step()
    return sum(seen.values()) + tracker.peak
