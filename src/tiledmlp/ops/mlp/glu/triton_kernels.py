"""The fused GLU Triton kernels: h = act(g) * u, and its backward in place, in one pass each.

Each program handles one row and a block of up to 1024 columns of (n, m) operands whose rows may
be strided: the forward reads g and u and writes h; the backward reads g, u and dh and writes
dg over g and du over u (and h, when asked, over dh). Cost: elementwise, no GEMM; forward reads
2 and writes 1 (n, m) tensor, backward reads 3 and writes 2 (3 with h), allocating nothing.

Invariant: the kernels evaluate the formulas of ops/mlp/glu/reference.py, operation for operation,
in float32 registers, and round once to the tensors' dtype. Triton is imported only when the
kernels are first built (`compiled_kernels`): importing this module imports torch alone.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch

from tiledmlp.ops.mlp.glu.activation import check_act

__all__ = [
    "KERNEL_DTYPES",
    "compiled_kernels",
    "interpreting",
    "launch",
    "launch_config",
    "triton_imports",
]

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ACT_CODE = {"silu": 0, "gelu_tanh": 1, "gelu": 2}  # the kernels' ACT constexpr
_MAX_BLOCK = 1024  # columns per program

# Bound by compiled_kernels() on first use, read by the kernels below as module globals:
# triton.language (the interpreter patches the `tl` it finds in a kernel's globals) and the
# jit-decorated helpers _act_and_grad_tile and _store_tile.
tl: Any = None
_act_tile: Any = None
_store: Any = None


def _env_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


@functools.cache
def triton_imports() -> bool:
    """Whether Triton is installed and imports (imports it when installed)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install: the references run instead
        return False
    return True


@dataclass(frozen=True)
class _Kernels:
    forward: Any
    backward: Any
    interpret: bool


_BUILT: _Kernels | None = None


def interpreting() -> bool:
    """Whether the kernels run (or, not built yet, will run) under Triton's interpreter:
    Triton's own TRITON_INTERPRET=1, read once, when the kernels are built."""
    return _BUILT.interpret if _BUILT is not None else _env_interpret()


def compiled_kernels() -> _Kernels:
    """The kernels as Triton functions (forward, backward), decorated on first use (triton.jit
    picks interpreted or compiled then); also for ahead-of-time compilation
    (ops/mlp/glu/compile.py). Imports Triton."""
    global _BUILT, _act_tile, _store, tl
    if _BUILT is not None:
        return _BUILT
    import triton
    import triton.language

    tl = triton.language
    _act_tile = triton.jit(_act_and_grad_tile)
    _store = triton.jit(_store_tile)
    knobs = getattr(triton, "knobs", None)
    interpret = bool(knobs.runtime.interpret) if knobs is not None else _env_interpret()
    _BUILT = _Kernels(
        forward=triton.jit(_glu_forward_kernel),
        backward=triton.jit(_glu_backward_kernel),
        interpret=interpret,
    )
    return _BUILT


def launch_config(
    tensors: list[torch.Tensor], act: str, **constexprs: bool
) -> tuple[list[Any], dict[str, Any]]:
    """The positional arguments and the constexprs a launch over `tensors` passes: every
    tensor's pointer, the column count, every tensor's row stride; ACT, BLOCK (column block,
    a power of two up to 1024), BF16_BY_HAND and `constexprs`. Imports Triton."""
    check_act(act)
    m = tensors[0].shape[1]
    block = min(_MAX_BLOCK, 1 << max(0, (m - 1).bit_length()))
    args: list[Any] = [*tensors, m, *(t.stride(0) for t in tensors)]
    by_hand = compiled_kernels().interpret and tensors[0].dtype == torch.bfloat16
    return args, {"ACT": _ACT_CODE[act], "BLOCK": block, "BF16_BY_HAND": by_hand, **constexprs}


def launch(kernel: Any, tensors: list[torch.Tensor], act: str, **constexprs: bool) -> None:
    """Grid (rows, column blocks) over tensors[0]'s shape (see launch_config)."""
    args, consts = launch_config(tensors, act, **constexprs)
    n, m = tensors[0].shape
    block = consts["BLOCK"]
    grid = (n, (m + block - 1) // block)
    device = tensors[0].device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[grid](*args, **consts)


# The kernels' formulas are glu_reference.act_and_grad's, operation for operation: keep the two
# in step. Literals (glu_reference's constants): 1.5957691216057308 = _K2,
# 0.07135481627260025 = _K2C, 0.21406444881780073 = _K2C3, 0.7071067811865476 = _SQRT1_2,
# 0.3989422804014327 = _INV_SQRT_2PI. Row offsets are int64: rows * row_stride can exceed 2^31.


def _act_and_grad_tile(x, ACT: tl.constexpr):  # type: ignore[no-untyped-def]
    """(act(x), act'(x)) of a float32 block; ACT: 0 silu, 1 gelu_tanh, 2 gelu (erf)."""
    if ACT == 2:
        half_1pe = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
        a = x * half_1pe
        da = half_1pe + x * (0.3989422804014327 * tl.exp(-0.5 * (x * x)))
    else:
        z = x
        if ACT == 1:
            z = x * (1.5957691216057308 + 0.07135481627260025 * (x * x))
        s = tl.sigmoid(z)
        a = x * s
        if ACT == 1:
            da = s + a * (1.0 - s) * (1.5957691216057308 + 0.21406444881780073 * (x * x))
        else:
            da = s + a * (1.0 - s)
    return a, da


def _store_tile(ptrs, v, mask, BF16_BY_HAND: tl.constexpr):  # type: ignore[no-untyped-def]
    """Stores a float32 block into ptrs' dtype, rounding to nearest even.

    BF16_BY_HAND: Triton's interpreter truncates float32 -> bfloat16 (3.9's cast passes no
    rounding mode), compiled Triton rounds to nearest even: under the interpreter the bf16
    rounding is done on the bits, as torch does, so interpreted tests see the GPU's results.
    """
    if BF16_BY_HAND:
        bits = v.to(tl.uint32, bitcast=True)
        bits = tl.where(v != v, 0x7FC00000, bits + (0x7FFF + ((bits >> 16) & 1)))
        tl.store(ptrs, (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


def _glu_forward_kernel(  # type: ignore[no-untyped-def]
    g_ptr,
    u_ptr,
    h_ptr,
    n_cols,
    g_rs,
    u_rs,
    h_rs,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(g_ptr + row * g_rs + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_rs + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _act_tile(x, ACT)
    _store(h_ptr + row * h_rs + cols, a * u, mask, BF16_BY_HAND)


def _glu_backward_kernel(  # type: ignore[no-untyped-def]
    g_ptr,
    u_ptr,
    dh_ptr,
    h_ptr,
    n_cols,
    g_rs,
    u_rs,
    dh_rs,
    h_rs,
    ACT: tl.constexpr,
    BLOCK: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
    WRITE_H: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(g_ptr + row * g_rs + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_rs + cols, mask=mask, other=0.0).to(tl.float32)
    dh = tl.load(dh_ptr + row * dh_rs + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _act_tile(x, ACT)
    _store(g_ptr + row * g_rs + cols, (dh * u) * da, mask, BF16_BY_HAND)
    _store(u_ptr + row * u_rs + cols, dh * a, mask, BF16_BY_HAND)
    if WRITE_H:
        # h_ptr may be dh_ptr: dh was loaded above, and only this program touches these elements.
        _store(h_ptr + row * h_rs + cols, a * u, mask, BF16_BY_HAND)
