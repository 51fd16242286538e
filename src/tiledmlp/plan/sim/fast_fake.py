"""FakeTensorMode whose dispatch-cache keys are built faster for the planner's tensors.

FakeTensorMode caches each op's output metadata under a key made from the op's arguments. Its key
for a tensor argument is a TensorMetadata flattened field by field through a generic recursion
(`_prep_args_for_hash`, TensorMetadata._flatten_into); that costs about a third of a planned step.
`PlannerFakeMode` appends the same values in the same order directly for the tensors a planned
step has (this mode's fake tensors: dense, strided, without symbolic sizes, no constant) and plain
scalars, and leaves every other argument to FakeTensorMode's own code.

Invariant: a key is element for element the one FakeTensorMode builds (tests/plan/test_fast_fake.py
compares them); with a torch whose TensorMetadata has other fields than `_FIELDS`, `fake_mode()`
is FakeTensorMode itself.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from typing import Any

import torch
from torch._prims_common import suggest_memory_format
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, TensorMetadata

__all__ = ["PlannerFakeMode", "fake_mode"]

# TensorMetadata's fields, in order, as _flatten_tensor appends them
_FIELDS = (
    "dtype", "shape", "stride", "device", "layout", "memory_format", "storage_offset",
    "storage_bytes", "requires_grad", "is_quantized", "is_conj", "is_neg", "is_inference",
    "is_sparse", "is_coalesced", "dense_dim", "sparse_dim",
)  # fmt: skip
_KNOWN = tuple(f.name for f in dataclasses.fields(TensorMetadata)) == _FIELDS

# arguments FakeTensorMode keys as (type, value): the ones this module keys the same way
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format)  # fmt: skip


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
    """FakeTensorMode with the cache keys of the module docstring."""

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
            if (
                kind is FakeTensor
                and arg.fake_mode is self
                and arg.constant is None
                and arg.layout is torch.strided
                and not arg._has_symbolic_sizes_strides
            ):
                _flatten_tensor(result, arg)
            elif kind in _PLAIN:
                result.append(kind)
                result.append(arg)
            elif kind is list or kind is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:  # FakeTensorMode's own key, or its reason not to cache
                super()._prep_args_for_hash(result, iter((arg,)), state, id_hashed_objects)


def fake_mode() -> FakeTensorMode:
    """The planner's fake mode: PlannerFakeMode where this torch's TensorMetadata is the one it
    knows, else FakeTensorMode."""
    _experts_on_fake_tensors()
    return PlannerFakeMode() if _KNOWN else FakeTensorMode()


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
