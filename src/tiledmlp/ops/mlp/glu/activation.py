"""Which activation modules the fused GLU kernels compute exactly: silu, gelu_tanh, gelu.

A module is matched by its exact class and settings, never by name or subclass, among torch's
`nn.SiLU` / `nn.GELU` and the transformers.activations classes that compute the same formula.
Anything else (and any module with hooks or a replaced forward) keeps its own activation.

Invariant: transformers is never imported here; its classes are read from `sys.modules`, so a
transformers activation can only be recognised once the caller has imported transformers.
Importing this module imports torch alone.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any, Literal

import torch.nn.functional as F
from torch import nn

__all__ = ["ACT_KINDS", "ActKind", "activation_kind", "check_act"]

ActKind = Literal["silu", "gelu_tanh", "gelu"]
ACT_KINDS: tuple[ActKind, ...] = ("silu", "gelu_tanh", "gelu")


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


def check_act(act: str) -> None:
    """Raises ValueError unless `act` is one of `ACT_KINDS`."""
    if act not in ACT_KINDS:
        raise ValueError(
            f"glu kernels: expected act in {ACT_KINDS}, got {act!r}. Map a module with "
            "activation_kind(module) and keep the module's own activation when it returns None."
        )
