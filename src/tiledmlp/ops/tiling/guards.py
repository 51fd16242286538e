"""Guards that keep a tiled backward from silently returning something other than the gradient.

A tiled backward recomputes from tensors it keeps by reference, and the first-order path
computes its gradients outside autograd. Two uses would make it return gradients of a
computation that never ran, or drop terms, without an error: a kept tensor changed in place
between the forward and the backward (raises here, saying whether the untiled module would
raise too: autograd raises there only for tensors its backward keeps),
and a backward asked to build a graph of itself (create_graph=True) where no differentiable
backward exists (tiled_cross_entropy, which forms its gradients in the forward; the tiled MLP
under an engine that partitions parameters): raises here instead of returning gradients without
a graph, whose second-order terms would silently be zero. The tiled MLP otherwise supports it
(function.py).

Invariant: a tiled backward either returns the exact first-order gradient of the forward that
ran, or raises.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["check_versions", "refuse_double_backward"]


def refuse_double_backward(op: str) -> None:
    """Raises when the backward runs with create_graph=True (autograd enables grad mode for the
    backward only then): the tiled backward computes its gradients outside autograd, so they
    would carry no graph and second-order terms (gradient penalties, Hessian-vector products)
    would silently be zero."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{op}: a graph of the backward was requested (create_graph=True, e.g. a gradient "
            "penalty or a Hessian-vector product), but the tiled backward is first-order only: "
            "its gradients would carry no graph and the second-order terms would be lost. "
            "Expected create_graph=False; for higher-order gradients run this part untiled "
            "(tiledmlp.unpatch_model, or call the module / F.cross_entropy directly)."
        )


def check_versions(
    op: str, versions: Sequence[tuple[object, torch.Tensor, int, bool | None]]
) -> None:
    """Raises like autograd does for a saved tensor modified in place.

    Args:
        op: the op's name, for the message.
        versions: (description (str() is taken only for the message), tensor, its version
            counter when the forward ran, whether the untiled computation's autograd keeps it
            too: True, False, or None when not known). The message says what the untiled
            computation would do accordingly.
    """
    for name, t, version, untiled_keeps in versions:
        if t._version != version:
            if untiled_keeps:
                untiled = " The untiled module raises here too."
            elif untiled_keeps is None:
                untiled = ""
            else:
                untiled = (
                    " The untiled module would not raise here (its backward keeps no reference "
                    "to this tensor, so its gradients are those of the forward that ran), but "
                    "the tiled backward recomputes from it and cannot give them."
                )
            raise RuntimeError(
                f"{op}: one of the variables needed for gradient computation has been "
                f"modified by an inplace operation: {name} of shape {tuple(t.shape)} is at "
                f"version {t._version}; expected version {version} instead (its version when "
                f"the tiled forward ran).{untiled} The tiled backward recomputes from it: change "
                "it in place only after the backward (e.g. optimizer.step() after "
                "loss.backward()), or run this module untiled (tiledmlp.unpatch_model)."
            )
