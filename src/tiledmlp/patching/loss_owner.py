"""Who computes a causal LM's training loss when more than one library offers to: the tiled
loss, Liger-Kernel's fused linear cross-entropy, TRL's fused LM head (its default loss,
`loss_type="nll"`, asks the model for per-token log-probabilities through `fused_lm_head=True`).

Each of them installs a forward on the causal LM; the one on top computes the loss. The tiled
loss, patched over Liger's or TRL's forward, owns the loss and serves TRL's `fused_lm_head`
calls itself (tiledmlp.integrations.trl); Liger's, installed over the tiled loss (a Trainer with
`use_liger_kernel=True` applies Liger after the user patched), owns it and the tiled loss no
longer runs. Either way the logits are never formed whole.

Invariant: reads forwards only; one line per model, naming the owner.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from tiledmlp.patching.features.tiled_loss import loss_patched, replaced_forward
from tiledmlp.patching.native import liger_loss

__all__ = ["loss_owner"]


def _is_trls(forward: Any) -> bool:
    """Whether `forward` is the one TRL's add_fused_lm_head installs (functools.wraps gives it
    the wrapped forward's name and module: its code's file says where it lives)."""
    func = getattr(forward, "__func__", forward)
    code = getattr(func, "__code__", None)
    path = Path(code.co_filename).parts if code is not None else ()
    return "trl" in path[:-1]


def _top(model: nn.Module) -> Any:
    return model.__dict__.get("forward") or type(model).forward


def loss_owner(model: nn.Module) -> str | None:
    """The report's line on who computes the loss where Liger's or TRL's forward is on the
    causal LM (module docstring); None where no other library's loss forward is there."""
    getter = getattr(model, "get_base_model", None)
    base = getter() if callable(getter) else None
    lm = base if isinstance(base, nn.Module) and base is not model else model
    top = _top(lm)
    liger_on_top = liger_loss(top)
    if liger_on_top is not None:
        if loss_patched(lm):
            return (
                f"loss: Liger's fused linear cross-entropy ({liger_on_top}) was installed over "
                "the tiled loss and computes the loss; the tiled loss no longer runs (apply "
                "Liger before patch_model for the tiled loss to own it, or drop tiled_loss)"
            )
        return (
            f"loss: Liger's fused linear cross-entropy ({liger_on_top}) computes the loss "
            "(tiled_loss is off; the logits are never formed whole either way)"
        )
    below = replaced_forward(lm) if loss_patched(lm) else None
    if below is not None:
        liger_below = liger_loss(below)
        if liger_below is not None:
            return (
                f"loss: the tiled loss computes it; Liger's fused linear cross-entropy "
                f"({liger_below}), which it was patched over, stands aside (it runs only "
                "for calls the loss line names, if any)"
            )
        if _is_trls(below):
            return (
                "loss: the tiled loss computes it, TRL's fused LM head calls included "
                "(fused_lm_head=True, TRL's default loss_type='nll'): TRL's own chunked head "
                "no longer runs"
            )
    elif _is_trls(top):
        return (
            "loss: TRL's fused LM head computes it (its default loss_type='nll', chunked; "
            "tiled_loss is off)"
        )
    return None
