"""Per-parameter gradient accumulators for tiled backward passes.

Invariant: each parameter's gradient is summed over tiles in ONE buffer and handed to autograd
once. When the parameter (or the compute dtype) is lower precision than float32, the buffer is
float32 and rounding to the parameter dtype happens once, at the end, never once per tile. Where
the backend supports a float32 output for low-precision GEMM inputs (CUDA:
`torch.addmm(acc32, a, b, out_dtype=torch.float32, out=acc32)`), each tile's product is
accumulated in float32 inside the GEMM (no rounding of the tile's product, no scratch buffer);
elsewhere (the CPU) the tile's product is formed in the compute dtype in a shared scratch and
added to the float32 buffer. The planner's fake CPU tensors stand for an accelerator's inside
`assume_device` (ops/tiling/assumed.py): the answer is then the accelerator's. Each accumulator
is released as soon as its gradient is formed.

A caller that walks a weight in row blocks (`GradSlot.part`) adds each block's product into
those rows of the one buffer; a slot built `transposed` stores the transpose of its parameter's
gradient, so that blocks of the parameter's columns are row blocks of the buffer (contiguous),
and forms the gradient in the parameter's layout at the end.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

from tiledmlp.ops.tiling.assumed import assumed_type

__all__ = ["GradPart", "GradSlot", "Scratch", "fp32_epilogue"]

_WIDE = (torch.float32, torch.float64)
_EPILOGUE: dict[tuple[str, torch.dtype], bool] = {}


def fp32_epilogue(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether GEMMs on `device` with inputs of `dtype` can accumulate into a float32 output
    (`torch.addmm(..., out_dtype=torch.float32)`). Probed once per device type and dtype on a
    2x2 product whose exact result is known; any failure means no (the scratch path is used).
    Depends only on the device type, the dtype and the installed torch, so ranks agree.

    The probe runs on real tensors with every dispatch mode set aside: called under
    FakeTensorMode (the planner), it answers for the device itself, as an eager call would, and
    no fake or meta kernel sees it (nor do FLOP counters or memory trackers).
    """
    assumed = assumed_type()
    if assumed is not None and assumed != "cpu" and device.type == "cpu":
        return _accelerator_epilogue(dtype)
    key = (device.type, dtype)
    known = _EPILOGUE.get(key)
    if known is not None:
        return known
    ok = False
    if dtype in (torch.bfloat16, torch.float16) and device.type != "meta":
        with _disable_current_modes():
            ok = _probe(device, dtype)
    _EPILOGUE[key] = ok
    return ok


def _accelerator_epilogue(dtype: torch.dtype) -> bool:
    """fp32_epilogue for an assumed accelerator (a planned GPU step on fake CPU tensors): a
    visible CUDA device is probed; otherwise the answer is whether this torch has the float32-
    output overloads (`aten::mm.dtype`, `aten::addmm.dtype_out`), which CUDA implements for
    half and bfloat16 inputs (an H200 step under torch 2.11 holds no scratch:
    benchmarks/results/gpu/2026-11-26T0339-h200/plan-measure-steps.jsonl)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.is_available():
        return fp32_epilogue(torch.device("cuda"), dtype)
    return (
        "dtype" in torch.ops.aten.mm.overloads() and "dtype_out" in torch.ops.aten.addmm.overloads()
    )


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    try:
        a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=dtype, device=device)
        acc = torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
        want = torch.tensor([[14.0, 20.0], [30.0, 44.0]], device=device)
        return acc.dtype == torch.float32 and bool(torch.equal(acc, want))
    except Exception:  # no kernel, a torch that rejects the overload, a device not usable here
        return False


class Scratch:
    """One flat buffer shared by all slots for tile GEMM results in a low compute dtype.

    Slots use it strictly one after another (GEMM into it, then add it to the accumulator), so
    a single buffer of the largest parameter's size serves every parameter.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def view(self, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = shape.numel()
        buf = self._buf
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = torch.empty(numel, dtype=dtype, device=device)
            self._buf = buf
        return buf[:numel].view(shape)


class GradSlot:
    """Accumulates the gradient of one parameter over tiles.

    Args:
        param: the parameter (its shape and dtype define the returned gradient).
        compute_dtype: dtype the tile GEMMs run in.
        scratch: shared buffer for low-precision tile results.
        single: the caller adds exactly one product (a one-tile plan): it is kept as the GEMM
            returns it, rounded once like the untiled module's, with no float32 buffer.
        transposed: the buffer holds the transpose of the (2-D) gradient, so that `part`
            blocks are blocks of the parameter's columns; `result` still has the parameter's
            shape and layout.
    """

    def __init__(
        self,
        param: torch.Tensor,
        compute_dtype: torch.dtype,
        scratch: Scratch,
        single: bool = False,
        transposed: bool = False,
    ) -> None:
        self.param = param
        self.compute_dtype = compute_dtype
        self.direct = GradSlot.sums_in_place(param, compute_dtype, single)
        self.epilogue = not self.direct and fp32_epilogue(param.device, compute_dtype)
        self.scratch = scratch
        self.transposed = transposed
        self.acc: torch.Tensor | None = None

    @staticmethod
    def sums_in_place(param: torch.Tensor, compute_dtype: torch.dtype, single: bool) -> bool:
        """Whether the gradient is summed in a buffer of its own dtype, which becomes the result
        (one product, or a float32/float64 parameter computed in its own dtype); False: a
        float32 buffer beside the final gradient."""
        return single or (param.dtype == compute_dtype and param.dtype in _WIDE)

    def _shape(self) -> torch.Size:
        shape = self.param.shape
        return torch.Size((shape[1], shape[0])) if self.transposed else shape

    def _acc(self) -> torch.Tensor:
        if self.acc is None:
            dtype = self.param.dtype if self.param.dtype in _WIDE else torch.float32
            self.acc = torch.zeros(self._shape(), dtype=dtype, device=self.param.device)
        return self.acc

    def part(self, start: int, stop: int) -> GradPart:
        """The slot of rows [start, stop) of the buffer: the parameter's rows, or its columns
        for a transposed slot."""
        return GradPart(self, start, stop)

    def add_mm(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Adds a @ b (both in the compute dtype) to the gradient."""
        if self.transposed:
            a, b = b.t(), a.t()
        if self.direct:
            if self.acc is None:
                self.acc = torch.mm(a, b)
            else:
                torch.addmm(self.acc, a, b, out=self.acc)
            return
        if self.epilogue:
            if self.acc is None:
                self.acc = torch.mm(a, b, out_dtype=torch.float32)
            else:
                torch.addmm(self.acc, a, b, out_dtype=torch.float32, out=self.acc)
            return
        tile = self.scratch.view(self._shape(), self.compute_dtype, self.param.device)
        torch.mm(a, b, out=tile)
        self._acc().add_(tile)

    def add_rows(self, t: torch.Tensor) -> None:
        """Adds t.sum(0) (a bias gradient over a tile's tokens) to the gradient."""
        if self.direct:
            s = t.sum(0)
            if self.acc is None:
                self.acc = s
            else:
                self.acc.add_(s)
            return
        self._acc().add_(t.sum(0, dtype=torch.float32))

    def add(self, t: torch.Tensor) -> None:
        """Adds a whole tile gradient (generic path)."""
        if self.direct and self.acc is None:
            self.acc = t
        else:
            self._acc().add_(t)

    def result(self) -> torch.Tensor | None:
        """The summed gradient in the parameter's dtype; None if no tile contributed (as with
        the untiled module, whose graph would not reach the parameter). The slot lets go of its
        accumulator, so a float32 buffer dies as soon as its gradient exists."""
        acc, self.acc = self.acc, None
        if acc is None:
            return None
        if self.transposed:  # one pass: transpose and round into the parameter's layout
            out = torch.empty(self.param.shape, dtype=self.param.dtype, device=acc.device)
            return out.copy_(acc.t())
        return acc if acc.dtype == self.param.dtype else acc.to(self.param.dtype)


class GradPart:
    """Rows [start, stop) of a GradSlot's buffer, accumulated like a slot of their own: the
    products land in the slot's one buffer (allocated zero-filled on first use), so the slot's
    `result` sums every part and every tile.

    Args:
        slot: the parameter's slot.
        start, stop: the rows of its buffer (the parameter's rows, or its columns for a
            transposed slot).
    """

    def __init__(self, slot: GradSlot, start: int, stop: int) -> None:
        self.slot = slot
        self.start = start
        self.stop = stop

    def _rows(self) -> torch.Tensor:
        return self.slot._acc()[self.start : self.stop]

    def add_mm(self, a: torch.Tensor, b: torch.Tensor) -> None:
        """Adds a @ b (the gradient of the part's rows or columns, in the compute dtype)."""
        s = self.slot
        if s.transposed:
            a, b = b.t(), a.t()
        rows = self._rows()  # one view passed as input and output: the GEMM adds in place
        if s.direct:
            torch.addmm(rows, a, b, out=rows)
        elif s.epilogue:
            torch.addmm(rows, a, b, out_dtype=torch.float32, out=rows)
        else:
            tile = s.scratch.view(rows.shape, s.compute_dtype, rows.device)
            torch.mm(a, b, out=tile)
            rows.add_(tile)

    def add_rows(self, t: torch.Tensor) -> None:
        """Adds t.sum(0) (the bias gradient of the part's entries over a tile's tokens)."""
        rows = self._rows()
        rows.add_(t.sum(0, dtype=rows.dtype))
