"""Fused elementwise kernels for gated MLP activations: h = act(g) * u and its backward.

In a gated MLP tile g = x W_gate^T and u = x W_up^T are (n, m) in the compute dtype and
h = act(g) * u feeds the down projection. Given dh = dy @ W_down, the backward is
du = dh * act(g) and dg = dh * u * act'(g). The Triton kernels here do each in one pass over
memory (read g, u[, dh]; write h, or dg over g and du over u), for SiLU, GELU with the tanh
approximation and exact (erf) GELU. `activation_kind` says when a module's activation is exactly
one of those; anything else keeps the module's own activation.

Cost: elementwise, no GEMM. Forward reads 2 and writes 1 (n, m) tensor; backward reads 3 and
writes 2 (3 with `h_out`), allocating nothing.

Failover: a kernel that fails to compile, load or launch on a device (a Triton version whose
compiler rejects it, a driver too old for its PTX, too few registers) raises before any thread
runs, so its operands are untouched. The call then logs one warning naming the error and
computes the same formula with the reference; that device uses the reference from then on
(`kernels_available` turns False for it, `kernel_failure` says why).

Invariant: the kernels and their PyTorch references evaluate the same formulas in float32
registers (float64 for float64 tensors, which only the references take) and round once, to the
tensors' dtype. Triton is imported only when a kernel is first needed on a device that can run
it: importing this module imports torch alone.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "ACT_KINDS",
    "ActKind",
    "activation_kind",
    "glu_backward",
    "glu_backward_reference",
    "glu_forward",
    "glu_forward_reference",
    "kernel_failure",
    "kernels_available",
]

logger = logging.getLogger(__name__)

ActKind = Literal["silu", "gelu_tanh", "gelu"]
ACT_KINDS: tuple[ActKind, ...] = ("silu", "gelu_tanh", "gelu")
_ACT_CODE = {"silu": 0, "gelu_tanh": 1, "gelu": 2}  # the kernels' ACT constexpr

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_BLOCK = 1024  # columns per program

# Formula constants. The kernels spell them as literals (Triton reads no non-constexpr globals);
# Python floats round to the same float32 values in both.
_K2 = 2.0 * math.sqrt(2.0 / math.pi)  # 1.5957691216057308: gelu_tanh(x) = x * sigmoid(z)
_K2C = _K2 * 0.044715  # 0.07135481627260025: z = x * (_K2 + _K2C * x^2)
_K2C3 = 3.0 * _K2C  # 0.21406444881780073: dz/dx = _K2 + _K2C3 * x^2
_SQRT1_2 = math.sqrt(0.5)  # 0.7071067811865476
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)  # 0.3989422804014327


# -- recognising activations ---------------------------------------------------------------


def activation_kind(act: object) -> ActKind | None:
    """The kernels' name for `act` when it computes exactly one of their formulas, else None.

    Matched by exact class and settings, never by name or subclass (a subclass may override
    forward):
    - torch: `nn.SiLU` (in place or not: the function is the same) -> "silu";
      `nn.GELU(approximate="tanh")` -> "gelu_tanh"; `nn.GELU()` -> "gelu".
    - transformers.activations: `SiLUActivation` -> "silu"; `GELUTanh` (alias `PytorchGELUTanh`,
      either implementation), `NewGELUActivation`, `AccurateGELUActivation` with its constant
      sqrt(2/pi) -> "gelu_tanh"; `GELUActivation` (either implementation) -> "gelu".
      `FastGELUActivation` (constant rounded to 10 digits), `QuickGELUActivation`,
      `ClippedGELUActivation` and every other class -> None.
    Also None: plain callables such as `F.silu` (only modules are matched: the MLPs this library
    recognises hold their activation as a module), modules with forward/backward hooks or a
    forward replaced on the instance (the kernel would skip them). Transformers is never
    imported here: a transformers class can only be passed in once it has been imported.

    Args:
        act: the activation, usually an MLP's `act_fn` child module.

    Returns:
        "silu", "gelu_tanh", "gelu", or None when the caller must keep `act` itself.
    """
    if not isinstance(act, nn.Module) or _has_hooks(act) or "forward" in vars(act):
        return None
    cls = type(act)
    if cls is nn.SiLU:
        return "silu"
    if cls is nn.GELU:
        approximate = getattr(act, "approximate", None)
        return "gelu" if approximate == "none" else "gelu_tanh" if approximate == "tanh" else None
    if cls.__module__ == "transformers.activations":
        return _transformers_kind(act, sys.modules.get(cls.__module__))
    return None


def _has_hooks(m: nn.Module) -> bool:
    return bool(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
    )


def _transformers_kind(act: nn.Module, hf: Any) -> ActKind | None:
    if hf is None:
        return None
    cls = type(act)

    def is_(name: str) -> bool:
        return getattr(hf, name, None) is cls

    fn = vars(act).get("act")  # GELUTanh / GELUActivation pick their implementation in __init__
    if is_("SiLUActivation") or is_("NewGELUActivation"):
        return "silu" if is_("SiLUActivation") else "gelu_tanh"
    if is_("GELUTanh") or is_("PytorchGELUTanh"):
        tanh_partial = (
            isinstance(fn, functools.partial)
            and fn.func is F.gelu
            and fn.args == ()
            and fn.keywords == {"approximate": "tanh"}
        )
        # Versions without an `act` attribute always call F.gelu(x, approximate="tanh").
        if fn is None or tanh_partial or _is_bound(fn, act, "_gelu_tanh_python"):
            return "gelu_tanh"
        return None
    if is_("GELUActivation"):
        return "gelu" if fn is F.gelu or _is_bound(fn, act, "_gelu_python") else None
    if is_("AccurateGELUActivation"):
        exact = getattr(act, "precomputed_constant", None) == math.sqrt(2 / math.pi)
        return "gelu_tanh" if exact else None
    return None


def _is_bound(fn: object, owner: nn.Module, name: str) -> bool:
    """fn is owner.<name>, the method its class defines (not a replacement)."""
    func = getattr(type(owner), name, None)
    return (
        func is not None
        and getattr(fn, "__func__", None) is func
        and getattr(fn, "__self__", None) is owner
    )


# -- PyTorch references ----------------------------------------------------------------------


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _act_and_grad(x: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """act(x) and act'(x), elementwise in x's dtype, in the kernels' order of operations."""
    if act == "gelu":
        half_1pe = 0.5 * (1.0 + torch.erf(x * _SQRT1_2))
        return x * half_1pe, half_1pe + x * (_INV_SQRT_2PI * torch.exp(-0.5 * (x * x)))
    # silu(x) = x * sigmoid(x); gelu_tanh(x) = 0.5 x (1 + tanh(z/2)) = x * sigmoid(z) with
    # z = 2 sqrt(2/pi) (x + 0.044715 x^3): no tanh, no cancellation in 1 + tanh for x << 0.
    z = x if act == "silu" else x * (_K2 + _K2C * (x * x))
    s = torch.sigmoid(z)
    a = x * s
    da = s + a * (1.0 - s) if act == "silu" else s + a * (1.0 - s) * (_K2 + _K2C3 * (x * x))
    return a, da


def glu_forward_reference(
    g: torch.Tensor, u: torch.Tensor, act: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """h = act(g) * u in float32 (float64 for float64 g), stored in g's dtype.

    Elementwise, so any shape and strides; `out` may alias g or u exactly.

    Args:
        g: gate pre-activation, (n, m) or any shape.
        u: up projection, g's shape.
        act: "silu", "gelu_tanh" or "gelu".
        out: where to store h (g's shape); a new tensor when None.

    Returns:
        h, with g's shape and dtype (`out` when given).
    """
    _check_act(act)
    x = g.to(_opmath(g.dtype))
    a, _ = _act_and_grad(x, act)
    h = (a * u.to(x.dtype)).to(g.dtype)
    if out is None:
        return h
    return out.copy_(h)


def glu_backward_reference(
    g: torch.Tensor,
    u: torch.Tensor,
    dh: torch.Tensor,
    act: str,
    *,
    h_out: torch.Tensor | None = None,
) -> None:
    """In place: g <- dg = dh * u * act'(g), u <- du = dh * act(g) [, h_out <- act(g) * u].

    Computed in float32 (float64 for float64 g) from the values before any write, stored in
    each destination's dtype. Elementwise, so any shape and strides; `dh` and `h_out` may alias
    each other exactly.

    Args:
        g: gate pre-activation, (n, m); overwritten with dg.
        u: up projection, (n, m); overwritten with du.
        dh: gradient of h, (n, m).
        act: "silu", "gelu_tanh" or "gelu".
        h_out: optional (n, m) destination for the forward value h.
    """
    _check_act(act)
    x = g.to(_opmath(g.dtype))
    uf = u.to(x.dtype)
    dhf = dh.to(x.dtype)
    a, da = _act_and_grad(x, act)
    h = a * uf if h_out is not None else None
    dg = (dhf * uf) * da
    du = dhf * a
    g.copy_(dg)
    u.copy_(du)
    if h_out is not None:
        h_out.copy_(h)  # type: ignore[arg-type]


# -- public entry points ---------------------------------------------------------------------


def glu_forward(
    g: torch.Tensor, u: torch.Tensor, act: str, out: torch.Tensor | None = None
) -> torch.Tensor:
    """h = act(g) * u in one pass: the Triton kernel where `kernels_available(g.device)` and the
    dtype is float32, bfloat16 or float16, else `glu_forward_reference` (same formula).

    Args:
        g: (n, m) gate pre-activation; rows may be strided, columns must be contiguous (e.g. a
            half of a fused (n, 2m) gate_up output).
        u: (n, m) up projection, g's dtype and device, same layout rules.
        act: "silu", "gelu_tanh" or "gelu" (see `activation_kind`).
        out: optional (n, m) destination in g's dtype; may be g or u itself (in place), must not
            otherwise overlap them.

    Returns:
        h: (n, m) in g's dtype (`out` when given, else a new contiguous tensor).

    Raises:
        ValueError: unknown act, or shapes, dtypes, devices, layouts or overlaps not as above.
    """
    _check_act(act)
    _check_operands("glu_forward", {"g": g, "u": u, "out": out})
    if out is None:
        out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    _check_aliasing("glu_forward", written={"out": out}, read={"g": g, "u": u})
    if not _use_kernel(g) or not _launched("forward", [g, u, out], act):
        return glu_forward_reference(g, u, act, out=out)
    return out


def glu_backward(
    g: torch.Tensor,
    u: torch.Tensor,
    dh: torch.Tensor,
    act: str,
    *,
    h_out: torch.Tensor | None = None,
) -> None:
    """In place, one pass: g <- dg = dh * u * act'(g), u <- du = dh * act(g), and, when
    `h_out` is given, h_out <- h = act(g) * u (the down projection's input, for its weight
    gradient). The Triton kernel where `kernels_available(g.device)` and the dtype is float32,
    bfloat16 or float16, else `glu_backward_reference` (same formula).

    With g and u the two halves of one fused (n, 2m) gate_up tensor, the result is [dg | du]
    in gate_up's layout, ready for one GEMM each for the weight gradient and for dx.

    Args:
        g: (n, m) gate pre-activation, overwritten with dg. Rows may be strided, columns must be
            contiguous.
        u: (n, m) up projection, overwritten with du; must not overlap g.
        dh: (n, m) gradient of h, read only (unless it is h_out).
        act: "silu", "gelu_tanh" or "gelu" (see `activation_kind`).
        h_out: optional (n, m) destination for h; may be dh itself (every element is read
            before it is written), must not overlap g or u.

    Raises:
        ValueError: unknown act, or shapes, dtypes, devices, layouts or overlaps not as above.
    """
    _check_act(act)
    _check_operands("glu_backward", {"g": g, "u": u, "dh": dh, "h_out": h_out})
    _check_aliasing("glu_backward", written={"g": g, "u": u, "h_out": h_out}, read={"dh": dh})
    # Without h_out the kernel's h pointer is dh's, never written (WRITE_H=False).
    h = dh if h_out is None else h_out
    if not _use_kernel(g) or not _launched(
        "backward", [g, u, dh, h], act, WRITE_H=h_out is not None
    ):
        glu_backward_reference(g, u, dh, act, h_out=h_out)


def kernels_available(device: torch.device | str) -> bool:
    """Whether `glu_forward`/`glu_backward` run their Triton kernels for tensors on `device`.

    True when Triton imports, the kernels have not failed on this device (see
    `kernel_failure`), and either the device is CUDA or Triton's interpreter is on (Triton's own
    TRITON_INTERPRET=1, read once, when the kernels are first built; meant for testing the
    kernels on CPU tensors, slowly). Imports Triton only in those cases.

    Args:
        device: a torch device or its name.

    Returns:
        True when the kernels run on that device, False when the references run instead.
    """
    dev = torch.device(device)
    interpret = _BUILT.interpret if _BUILT is not None else _env_interpret()
    if dev.type != "cuda" and not interpret:
        return False
    return _device_key(dev) not in _FAILED and _triton_imports()


def kernel_failure(device: torch.device | str) -> str | None:
    """Why the kernels no longer run on `device` (the error of their failed compile, load or
    launch there), or None when they have not failed on it.

    Args:
        device: a torch device or its name ("cuda" means the current CUDA device).

    Returns:
        "<ExceptionType>: <message>" or None.
    """
    return _FAILED.get(_device_key(torch.device(device)))


# -- failover --------------------------------------------------------------------------------

# Device -> the error that turned its kernels off ("cuda:0" -> "CompilationError: ..."). Written
# once per device, on the first failure; read on every call.
_FAILED: dict[str, str] = {}


def _device_key(dev: torch.device) -> str:
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        return f"cuda:{torch.cuda.current_device()}"
    return str(dev)


def _launched(which: str, tensors: list[torch.Tensor], act: str, **constexprs: bool) -> bool:
    """Runs kernel `which` ("forward" or "backward"); False when it failed (then the device is
    switched to the references, with one warning, and the operands are as they were)."""
    try:
        kernels = _kernels()
        _launch(getattr(kernels, which), tensors, act, **constexprs)
    except Exception as e:  # compile, module load and launch errors raise before any write
        _turn_off(tensors[0].device, e)
        return False
    return True


def _turn_off(device: torch.device, error: BaseException) -> None:
    key = _device_key(device)
    first_line = (str(error).strip().splitlines() or [""])[0][:300]
    reason = f"{type(error).__name__}: {first_line}" if first_line else type(error).__name__
    if key in _FAILED:
        return
    _FAILED[key] = reason
    logger.warning(
        "fused GLU kernels failed on %s (%s); using the PyTorch path there from now on (same "
        "formula, same results). Pass kernels=False to tiled_mlp / patch_model to choose it "
        "from the start.",
        key,
        reason,
    )


# -- checks ----------------------------------------------------------------------------------


def _check_act(act: str) -> None:
    if act not in _ACT_CODE:
        raise ValueError(
            f"glu kernels: expected act in {ACT_KINDS}, got {act!r}. Map a module with "
            "activation_kind(module) and keep the module's own activation when it returns None."
        )


def _check_operands(fn: str, tensors: dict[str, torch.Tensor | None]) -> None:
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


def _check_aliasing(
    fn: str, written: dict[str, torch.Tensor | None], read: dict[str, torch.Tensor]
) -> None:
    """Each element is read and written by one program, reads first: a written tensor may be
    exactly a read one; written tensors must not overlap each other or themselves."""
    outs = [(k, t) for k, t in written.items() if t is not None]
    if any(_absent(t) for _, t in outs):
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


# -- Triton ----------------------------------------------------------------------------------

# Bound by _kernels() on first use, read by the kernels below as module globals: triton.language
# (the interpreter patches the `tl` it finds in a kernel's globals) and the jit-decorated
# helpers _act_and_grad_tile and _store_tile. Importing this module must not import Triton.
tl: Any = None
_act_tile: Any = None
_store: Any = None


def _env_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


@functools.cache
def _triton_imports() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install: the references run instead
        return False
    return True


def _use_kernel(g: torch.Tensor) -> bool:
    return (
        g.numel() > 0
        and g.dtype in _KERNEL_DTYPES
        and kernels_available(g.device)
        and not _absent(g)
    )


def _absent(t: torch.Tensor) -> bool:
    """True for meta and fake tensors: shapes without values (as ops/probe.py's `absent`, not
    imported so that this module loads on its own, torch alone)."""
    if t.device.type == "meta":
        return True
    if type(t) is torch.Tensor:
        return False
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


@dataclass(frozen=True)
class _Kernels:
    forward: Any
    backward: Any
    interpret: bool


_BUILT: _Kernels | None = None


def _kernels() -> _Kernels:
    """Decorates the kernels on first use: triton.jit picks interpreted or compiled then."""
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


def compiled_kernels() -> _Kernels:
    """The kernels as Triton functions (forward, backward), decorated on first use; for
    ahead-of-time compilation (ops/glu_compile.py). Imports Triton."""
    return _kernels()


def launch_config(
    tensors: list[torch.Tensor], act: str, **constexprs: bool
) -> tuple[list[Any], dict[str, Any]]:
    """The positional arguments and the constexprs a launch over `tensors` passes: every
    tensor's pointer, the column count, every tensor's row stride; ACT, BLOCK (column block,
    a power of two up to 1024), BF16_BY_HAND and `constexprs`. Imports Triton."""
    _check_act(act)
    m = tensors[0].shape[1]
    block = min(_MAX_BLOCK, 1 << max(0, (m - 1).bit_length()))
    args: list[Any] = [*tensors, m, *(t.stride(0) for t in tensors)]
    by_hand = _kernels().interpret and tensors[0].dtype == torch.bfloat16
    return args, {"ACT": _ACT_CODE[act], "BLOCK": block, "BF16_BY_HAND": by_hand, **constexprs}


def _launch(kernel: Any, tensors: list[torch.Tensor], act: str, **constexprs: bool) -> None:
    """Grid (rows, column blocks) over tensors[0]'s shape (see launch_config)."""
    args, consts = launch_config(tensors, act, **constexprs)
    n, m = tensors[0].shape
    block = consts["BLOCK"]
    grid = (n, (m + block - 1) // block)
    device = tensors[0].device
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel[grid](*args, **consts)


# The kernels' formulas are _act_and_grad's, operation for operation: keep the two in step.
# Literals: 1.5957691216057308 = _K2, 0.07135481627260025 = _K2C, 0.21406444881780073 = _K2C3,
# 0.7071067811865476 = _SQRT1_2, 0.3989422804014327 = _INV_SQRT_2PI. Row offsets are int64:
# rows * row_stride can exceed 2^31.


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
