"""Fused elementwise for gated MLP activations: the entry points and their failover.

`glu_forward` computes h = act(g) * u and `glu_backward` its backward in place (dg over g, du
over u), each in one pass: the Triton kernels (ops/mlp/glu/triton_kernels.py) for float32, bfloat16 and
float16 tensors on a device that can run them, else the PyTorch references
(ops/mlp/glu/reference.py), which compute the same formulas. `activation_kind`
(ops/mlp/glu/activation.py) says when a module's activation is exactly one of the kernels' (silu,
gelu_tanh, gelu); anything else keeps the module's own activation.

Failover: a kernel that fails to compile, load or launch on a device (a Triton version whose
compiler rejects it, a driver too old for its PTX, too few registers) raises before any thread
runs, so its operands are untouched. The call then logs one warning naming the error and
computes the same formula with the reference; that device uses the reference from then on
(`kernels_available` turns False for it, `kernel_failure` says why).

Invariant: a call gives the reference's results whichever path runs; operands are checked
(ops/mlp/glu/operands.py) before either touches them. Triton is imported only when a kernel is
first needed on a device that can run it: importing this module imports torch alone.
"""

from __future__ import annotations

import logging

import torch

from tiledmlp.ops.mlp.glu import triton_kernels as glu_triton
from tiledmlp.ops.mlp.glu.activation import ACT_KINDS, ActKind, activation_kind, check_act
from tiledmlp.ops.mlp.glu.operands import absent, check_aliasing, check_operands
from tiledmlp.ops.mlp.glu.reference import glu_backward_reference, glu_forward_reference
from tiledmlp.ops.tiling.assumed import assumed_type

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
    "kernels_planned",
]

logger = logging.getLogger(__name__)


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
    check_act(act)
    check_operands("glu_forward", {"g": g, "u": u, "out": out})
    if out is None:
        out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    check_aliasing("glu_forward", written={"out": out}, read={"g": g, "u": u})
    if kernels_planned(g):
        return out  # the kernel's memory: its output alone
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
    check_act(act)
    check_operands("glu_backward", {"g": g, "u": u, "dh": dh, "h_out": h_out})
    check_aliasing("glu_backward", written={"g": g, "u": u, "h_out": h_out}, read={"dh": dh})
    # Without h_out the kernel's h pointer is dh's, never written (WRITE_H=False).
    h = dh if h_out is None else h_out
    if kernels_planned(g):
        return  # the kernel's memory: none (it writes in place)
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
    if dev.type != "cuda" and not glu_triton.interpreting():
        return False
    return _device_key(dev) not in _FAILED and glu_triton.triton_imports()


def kernels_planned(t: torch.Tensor) -> bool:
    """Whether `t` is a shapes-only tensor of a planned accelerator step (the planner's fake
    tensors under ops/tiling/assumed.py's `assume_device`), whose GPU runs the kernels: the
    step is planned with them. A kernel allocates nothing and writes its operands in place, so
    on tensors without values a call is its operand checks alone: the memory the GPU's call
    takes, in no time."""
    assumed = assumed_type()
    return assumed is not None and assumed != "cpu" and absent(t)


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
        kernels = glu_triton.compiled_kernels()
        glu_triton.launch(getattr(kernels, which), tensors, act, **constexprs)
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


def _use_kernel(g: torch.Tensor) -> bool:
    return (
        g.numel() > 0
        and g.dtype in glu_triton.KERNEL_DTYPES
        and kernels_available(g.device)
        and not absent(g)
    )
