"""FakeTensorMode whose dispatch-cache keys and hits are served faster for the planner's tensors.

FakeTensorMode caches each op's output metadata under a key made from the op's arguments, built
through generic recursions; on a hit it builds the output through generic code. For the tensors
a planned step has (this mode's fake tensors: dense, strided, without symbolic sizes, no
constant) and plain scalars, `PlannerFakeMode` appends the same key values in the same order
directly, builds a hit's output directly, and runs the meta kernels of the view ops a planned
step calls most, the matrix products, and the elementwise ops and reductions at a cache miss
directly, as FakeTensorMode's uncached dispatch ends by doing (Note [Views run directly]). What
each path costs and skips: docs/how-it-works/planner.md, "The fake mode".

Invariant: a key is element for element the one FakeTensorMode builds, and an output from a hit
or from a meta kernel run directly is attribute for attribute the one it builds
(tests/plan/sim/test_fast_fake.py compares them); with a torch whose TensorMetadata has other fields
than `_FIELDS`, or whose FakeTensor sets other attributes than `_ATTRIBUTES`, `fake_mode()` is
FakeTensorMode itself.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import sys
from typing import Any

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorMode,
    TensorMetadata,
    in_kernel_invocation_manager,
)

__all__ = ["PlannerFakeMode", "fake_mode"]

# TensorMetadata's fields, in order, as _flatten_tensor appends them
_FIELDS = (
    "dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset",
    "storage_bytes", "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference",
    "is_sparse", "is_coalesced", "dense_dim", "sparse_dim",
)  # fmt: skip
_KNOWN = tuple(f.name for f in dataclasses.fields(TensorMetadata)) == _FIELDS

# the attributes FakeTensor's constructor sets (its memo fields through descriptors, each as three)
_MEMOS = ("nonzero_memo", "item_memo", "unique_memo", "unique_consecutive_memo", "nested_int_memo")
_ATTRIBUTES = frozenset(
    ("_fake_device", "fake_mode", "constant", "pytype", "dispatch_keys", "real_tensor",
     *(f"_{memo}{end}" for memo in _MEMOS for end in ("", "_vc", "_epoch")))
)  # fmt: skip
# those of a tensor built from a cache entry: all None but its device and mode
_BLANK = dict.fromkeys(_ATTRIBUTES - {"_fake_device", "fake_mode"})

_aten = torch.ops.aten
# the view ops a planned step calls most, run on their meta kernels (Note [Views run directly])
_VIEWS = frozenset((
    _aten.slice.Tensor, _aten.t.default, _aten.transpose.int, _aten.unsqueeze.default,
    _aten.expand.default, _aten.squeeze.dim, _aten.alias.default, _aten.detach.default,
    _aten.as_strided.default, _aten._unsafe_view.default,
))  # fmt: skip
# matrix products, run on their meta kernels at every call (Note [Views run directly])
_PRODUCTS = frozenset((_aten.mm.default, _aten.bmm.default))
# elementwise ops and reductions, run on their meta kernels at a cache miss (the same note)
_COMPUTED = _PRODUCTS | frozenset((
    _aten.mul.Tensor, _aten.add.Tensor, _aten.pow.Tensor_Scalar, _aten.neg.default,
    _aten.mean.dim, _aten.rsqrt.default, _aten.sum.dim_IntList, _aten.mul.Scalar,
    _aten.div.Scalar, _aten.div.Tensor, _aten.sub.Tensor, _aten.silu.default, _aten.exp.default,
    _aten.sigmoid.default, _aten.tanh.default,
))  # fmt: skip

_SIZES = (list, tuple, torch.Size)  # the containers a list of ints arrives in

# arguments FakeTensorMode keys as (type, value): the ones this module keys the same way
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format)  # fmt: skip


def _plain_rest(args: Any) -> bool:
    """Whether every argument after the first is an int, None, or a list or tuple of ints."""
    for a in args[1:]:
        kind = type(a)
        if kind is int or a is None:
            continue
        if kind in _SIZES and all(type(d) is int for d in a):
            continue
        return False
    return True


def _flatten_tensor(result: list[object], t: torch.Tensor) -> None:
    """TensorMetadata(t)._flatten_into(result, ...) for a dense strided tensor with concrete
    sizes: its fields in order, the shape and stride as tuples are (type, length, then type and
    value per element)."""
    shape, stride = t.shape, t.stride()
    if len(shape) in (4, 5):
        suggested = suggest_memory_format(t)
        memory_format = suggested if t.is_contiguous(memory_format=suggested) else None
    else:  # suggest_memory_format's answer for any other rank: a channels-last layout has 4 or 5
        memory_format = torch.contiguous_format if t.is_contiguous() else None
    result.append(t.dtype)
    result.append(torch.Size)
    result.append(f"length_{len(shape)}")
    for d in shape:
        result.append(int)
        result.append(d)
    result.append(tuple)
    result.append(f"length_{len(stride)}")
    for d in stride:
        result.append(int)
        result.append(d)
    result += (
        t.device,
        torch.strided,
        memory_format,
        t.storage_offset(),
        t.untyped_storage().nbytes(),
        t.requires_grad,
        t.is_quantized,
        t.is_conj(),
        t.is_neg(),
        t.is_inference(),
        False,  # is_sparse
        None,  # is_coalesced
        None,  # dense_dim
        None,  # sparse_dim
    )


class PlannerFakeMode(FakeTensorMode):
    """FakeTensorMode with the cache keys and hits of the module docstring, entered without
    Dynamo's guard (see Note [Dispatch without Dynamo's guard])."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(  # type: ignore[override]
        self, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> object:
        """FakeTensorMode's: the op dispatched on fake tensors (its own check that the mode is
        not entered twice kept; no call count, which only its tests read)."""
        if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
            raise AssertionError(f"FakeTensorMode should not be set when dispatching {func}")
        return self.dispatch(func, types, args, kwargs or {})

    def dispatch(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> object:
        """FakeTensorMode.dispatch for an op its cache serves, without the debug log it writes
        (inside a context that disables dispatch) where debug logging is off; its own code for
        the rest."""
        if (
            func in fake_tensor._DISPATCH_META_HANDLERS
            or func in fake_tensor._DISPATCH_HANDLE_DIRECTLY
            or not self.cache_enabled
            or fake_tensor.log.isEnabledFor(logging.DEBUG)
        ):
            return super().dispatch(func, types, args, kwargs or {})
        if func in _VIEWS and not kwargs and self._plain(args[0]) and _plain_rest(args):
            return self._view(func, args)
        if func in _PRODUCTS and not kwargs and self._same_device(args):
            return self._computed(func, args)
        return self._cached_dispatch_impl(func, types, args, kwargs or {})

    def _dispatch_impl(self, func: Any, types: Any, args: Any, kwargs: Any) -> FakeTensor | None:
        """FakeTensorMode's uncached dispatch (a cache miss); an op of _COMPUTED on plain fake
        tensors of one device runs its meta kernel directly (Note [Views run directly])."""
        if func in _COMPUTED and not kwargs and self._same_device(args):
            return self._computed(func, args)
        return super()._dispatch_impl(func, types, args, kwargs)

    def _same_device(self, args: Any) -> bool:
        """Whether every tensor argument is a plain fake tensor (_plain) of at least one
        dimension on the first's device, and every other argument a plain scalar or a list or
        tuple of ints."""
        device = None
        for a in args:
            kind = type(a)
            if kind is FakeTensor:
                if not self._plain(a) or a.dim() == 0:
                    return False
                if device is None:
                    device = a.fake_device
                elif a.fake_device != device:
                    return False
            elif kind in _SIZES:
                if not all(type(d) is int for d in a):
                    return False
            elif kind not in (int, float, bool, type(None)):
                return False
        return device is not None

    def _computed(self, func: Any, args: Any) -> FakeTensor:
        """An op of _COMPUTED on plain fake tensors of one device: its meta kernel run on them,
        its output a new fake tensor on their device (Note [Views run directly])."""
        device = next(a for a in args if type(a) is FakeTensor).fake_device
        return self._on_meta(func, args, device)

    def _view(self, func: Any, args: Any) -> FakeTensor:
        """A view op of _VIEWS on a plain fake tensor: its meta kernel run on the input, its
        output a fake tensor on the input's device (Note [Views run directly])."""
        return self._on_meta(func, args, args[0].fake_device)

    def _on_meta(self, func: Any, args: Any, device: torch.device) -> FakeTensor:
        """`func`'s meta kernel run on the fake tensors of `args`, its output a fake tensor on
        `device`: where FakeTensorMode's uncached dispatch ends."""
        with in_kernel_invocation_manager(self):
            out = func(*args)
        return _fake_tensor(self, out, device)

    def _plain(self, t: object) -> bool:
        """Whether `t` is one of this mode's dense strided fake tensors with concrete sizes and
        no constant (the tensors a planned step has)."""
        return (
            type(t) is FakeTensor
            and t.fake_mode is self
            and t.constant is None
            and t.layout is torch.strided
            and not t._has_symbolic_sizes_strides
        )

    def _prep_args_for_hash(
        self, result: list[object], args: Any, state: Any, id_hashed_objects: list[object]
    ) -> None:
        if isinstance(args, dict):
            super()._prep_args_for_hash(result, args, state, id_hashed_objects)
            return
        if isinstance(args, (list, tuple)):
            result.append(type(args))
            result.append(f"length_{len(args)}")
        for arg in args:
            kind = type(arg)
            if kind is FakeTensor and self._plain(arg):
                _flatten_tensor(result, arg)
            elif kind in _PLAIN:
                result.append(kind)
                result.append(arg)
            elif kind is list or kind is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:  # FakeTensorMode's own key, or its reason not to cache
                super()._prep_args_for_hash(result, iter((arg,)), state, id_hashed_objects)

    def _get_output_tensor_from_cache_entry(
        self, state: Any, entry: Any, key: Any, func: Any, args: Any
    ) -> FakeTensor | None:
        """FakeTensorMode's output for a cache hit, built directly (module docstring) for a new
        strided tensor or a view on concrete sizes; FakeTensorMode's own code for the rest (an
        in-place op's argument, a constant, symbolic sizes, a conjugate or negative view)."""
        meta = entry.metadata
        if (
            entry.inplace_idx is not None
            or meta is None
            or self.shape_env is not None
            or meta.layout is not torch.strided
            or meta.is_conj
            or meta.is_neg
            or meta.device.type == "meta"
        ):
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        viewed = isinstance(func, torch._ops.OpOverload) and func.is_view
        storage = args[entry.view_idx].untyped_storage() if viewed else None
        with in_kernel_invocation_manager(self):
            empty = torch.empty_strided(
                meta.shape, meta.stride, dtype=meta.dtype, device="meta",
                requires_grad=meta.requires_grad,
            )  # fmt: skip
            if storage is not None:  # a view: on the storage of the argument it views
                empty.set_(storage, meta.storage_offset, meta.shape, meta.stride)
        return _fake_tensor(self, empty, meta.device)


# Note [Views run directly]
# A view op of _VIEWS on a plain fake tensor (its other arguments ints, None, or lists of ints)
# runs its C++ meta kernel on the input, as FakeTensorMode's uncached dispatch ends by doing,
# and its output is wrapped as _fake_tensor wraps any: the kernel computes the view's sizes,
# strides and offset on the input's storage exactly as the op does on a real tensor.
# FakeTensorMode's own dispatch reaches the same tensor through its cache (a key, a lookup,
# and at every new shape a miss through its Python decompositions): a slice under the fake mode
# took 66 µs at a hit and 931 µs at a miss, 38 and 45 µs run directly. A matrix product
# (_PRODUCTS) on plain fake tensors of one device runs its meta kernel the same way, a new
# tensor on their device: 35 µs, against 74 at a hit. An elementwise op or a reduction
# (_COMPUTED) runs its meta kernel only at a cache miss, where FakeTensorMode would decompose
# it into prims in Python (a slice and a multiplication at a new shape: 0.4 ms instead of 2.0);
# at a hit the cache is faster than its kernel, which asks the fake tensors' device through
# Python. The test builds every such output of planned steps both ways. `aten.view` is not
# among them: FakeTensorMode runs torch._refs' view, which keeps the input's stride on a
# dimension of size 1 where the C++ kernel recomputes it (the same storage and sizes, another
# stride).


# Note [Dispatch without Dynamo's guard]
# TorchDispatchMode wraps each subclass's __torch_dispatch__ in Dynamo's disable (so that a
# torch.compile in progress does not trace into it): a few microseconds an op, on every op of a
# planned step, twice (the tracker's, then the fake mode's). The planner runs its fake steps
# outside any compilation, so its modes (this one, phase_tracker.py's tracker) leave it out.


def _fake_tensor(mode: FakeTensorMode, elem: torch.Tensor, device: torch.device) -> FakeTensor:
    """FakeTensor(mode, elem, device) for a meta `elem`, without the constructor's checks of
    arguments it does not get here: the same subclass, dispatch keys and attributes."""
    device = FakeTensor._normalize_fake_device(device)
    out = torch.Tensor._make_subclass(
        FakeTensor, elem, elem.requires_grad, dispatch_device=True, device_for_backend_keys=device
    )
    if not mode._allow_unsafe_data_ptr_access:
        torch._C._set_throw_on_mutable_data_ptr(out)
    else:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(out)
    attributes = out.__dict__
    attributes.update(_BLANK)
    attributes["_fake_device"] = device
    attributes["fake_mode"] = mode
    return out  # type: ignore[return-value]


@functools.cache
def _built_alike() -> bool:
    """Whether this torch's FakeTensor constructor sets exactly the attributes _fake_tensor
    sets, all None but the device and the mode (not in FakeTensor's debug mode); asked once."""
    with FakeTensorMode() as mode:
        t = torch.empty(2)
    attributes = dict(t.__dict__)
    same = set(attributes) == _ATTRIBUTES and attributes.pop("fake_mode") is mode
    attributes.pop("_fake_device", None)
    return same and all(v is None for v in attributes.values())


def fake_mode() -> FakeTensorMode:
    """The planner's fake mode: PlannerFakeMode where this torch's TensorMetadata and
    FakeTensor's attributes are the ones it knows, else FakeTensorMode."""
    _experts_on_fake_tensors()
    return PlannerFakeMode() if _KNOWN and _built_alike() else FakeTensorMode()


def _experts_on_fake_tensors() -> None:
    """Lets transformers' stacked experts run on fake tensors of any dtype. Its grouped_mm
    experts forward has static shapes whatever the routing (every token's top-k (token, expert)
    pairs, sorted by expert, in one grouped matmul), so a fake step allocates what a real one
    does; but torch's fake kernel of grouped_mm takes bfloat16 only, where the CPU kernel also
    takes float32. On fake tensors transformers' own fallback (a custom op with a fake kernel,
    the same shapes in and out) stands in; real tensors are left to transformers' choice."""
    if "transformers" not in sys.modules:  # no model of transformers' to plan
        return
    try:
        moe = importlib.import_module("transformers.integrations.moe")
    except ImportError:  # a transformers without stacked experts
        return
    can_use = getattr(moe, "_can_use_grouped_mm", None)
    if can_use is None or getattr(can_use, "_tiledmlp_fake", False):
        return

    def _can_use_grouped_mm(input: Any, weight: Any, offs: Any) -> bool:
        return not isinstance(weight, FakeTensor) and bool(can_use(input, weight, offs))

    _can_use_grouped_mm._tiledmlp_fake = True  # type: ignore[attr-defined]
    setattr(moe, "_can_use_grouped_mm", _can_use_grouped_mm)  # noqa: B010
