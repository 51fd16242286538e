"""The operand rules of the fused GLU entry points: shapes, dtypes, layouts and aliasing.

Every operand is a 2-D (n, m) tensor with g's shape, dtype and device, floating point, with a
contiguous last dimension (rows may be strided: a column half of a fused (n, 2m) tensor is fine).
Each element is read and written by one kernel program, reads first, so a written tensor may be
exactly a read one, but written tensors must not overlap each other, themselves, or part of a
read one.

Invariant: `check_operands` and `check_aliasing` raise ValueError (one line: what was expected,
what was got, how to fix it) before any kernel or reference touches an operand; meta and fake
tensors (memory planning) have no storage and pass the aliasing rules.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["absent", "check_aliasing", "check_operands"]


def check_operands(fn: str, tensors: dict[str, torch.Tensor | None]) -> None:
    """Raises ValueError unless every given tensor is 2-D, floating point, like `tensors["g"]`
    in shape, dtype and device, with a contiguous last dimension; `fn` names the caller."""
    g = tensors["g"]
    assert g is not None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.dim() != 2:
            raise ValueError(
                f"{fn}: expected {name} to be 2-D (rows, columns), got shape {tuple(t.shape)}. "
                "Flatten the leading dimensions, e.g. t.view(-1, t.shape[-1])."
            )
        if t.shape != g.shape or t.dtype != g.dtype or t.device != g.device:
            raise ValueError(
                f"{fn}: expected {name} to match g (shape {tuple(g.shape)}, {g.dtype}, "
                f"{g.device}), got shape {tuple(t.shape)}, {t.dtype}, {t.device}. Cast or move "
                "the operands to one dtype and device."
            )
        if not t.dtype.is_floating_point:
            raise ValueError(f"{fn}: expected floating-point tensors, got {t.dtype}.")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(
                f"{fn}: expected {name}'s last dimension to be contiguous (stride 1), got "
                f"strides {t.stride()}. Rows may be strided (a column slice of a row-major "
                "tensor is fine); pass .contiguous() otherwise."
            )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) byte addresses of a non-empty 2-D tensor with unit column stride."""
    n, m = t.shape
    lo = t.data_ptr()
    return lo, lo + ((n - 1) * t.stride(0) + m) * t.element_size()


def _relation(a: torch.Tensor, b: torch.Tensor) -> Literal["same", "disjoint", "overlap"]:
    """Whether two equal-shape 2-D tensors (unit column stride) are the same view, share no
    element, or (conservatively) may share some."""
    if a.numel() == 0 or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return "disjoint"
    if a.data_ptr() == b.data_ptr() and (a.shape[0] == 1 or a.stride(0) == b.stride(0)):
        return "same"
    (a_lo, a_hi), (b_lo, b_hi) = _span(a), _span(b)
    if a_hi <= b_lo or b_hi <= a_lo:
        return "disjoint"
    s, m, isz = a.stride(0), a.shape[1], a.element_size()
    if s == b.stride(0) and s >= m and (b_lo - a_lo) % isz == 0:
        # Same row stride: a's columns sit at [0, m) mod s, b's at [d, d + m) mod s.
        d = ((b_lo - a_lo) // isz) % s
        if d >= m and d + m <= s:
            return "disjoint"  # e.g. the two halves of a fused (n, 2m) tensor
    return "overlap"


def check_aliasing(
    fn: str, written: dict[str, torch.Tensor | None], read: dict[str, torch.Tensor]
) -> None:
    """Each element is read and written by one program, reads first: a written tensor may be
    exactly a read one; written tensors must not overlap each other or themselves."""
    outs = [(k, t) for k, t in written.items() if t is not None]
    if any(absent(t) for _, t in outs):
        return  # meta / fake tensors (memory planning): no storage to share
    for name, t in outs:
        if t.shape[0] > 1 and t.shape[1] > 0 and t.stride(0) < t.shape[1]:
            raise ValueError(
                f"{fn}: expected {name}'s rows not to overlap (row stride >= {t.shape[1]}), got "
                f"strides {t.stride()}. Pass a tensor with distinct elements (e.g. .clone())."
            )
    for i, (name, t) in enumerate(outs):
        for other, o in outs[i + 1 :]:
            if _relation(t, o) != "disjoint":
                raise ValueError(
                    f"{fn}: expected {name} and {other} (both written) not to overlap, got "
                    "shared memory. Pass separate tensors (or disjoint column slices of one)."
                )
        for other, o in read.items():
            if _relation(t, o) == "overlap":
                raise ValueError(
                    f"{fn}: expected {name} (written) to be exactly {other} or not to overlap "
                    f"it, got a partial overlap. Pass the same view or a separate tensor."
                )


def absent(t: torch.Tensor) -> bool:
    """True for meta and fake tensors: shapes without values (as ops/tiling/probe.py's `absent`, not
    imported so that the GLU kernels' modules load with torch alone)."""
    if t.device.type == "meta":
        return True
    if type(t) is torch.Tensor:
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)
