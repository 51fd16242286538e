"""The tiled loss's probe: on random ids, does the patched loss equal the model's own?

The probe runs the model's own forward and the patched one on the same inputs from the same
random state and compares their losses (forward.py installs the patch only when they
agree). What it varies: ignored labels, an attention mask with zeros, num_items_in_batch, large
logits (for soft-capping), the logit scales the config implies, and each form of
logits_to_keep.

Invariant: the probe changes nothing in the model (its LM head's weight is swapped for the
block only; the caller runs it under probing() and stand_ins()); what it finds is returned
(the reason) and handed to `use` (the HeadTransform).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from tiledmlp.ops.tiling.probe import stand_ins
from tiledmlp.patching.detect import probing
from tiledmlp.patching.features.tiled_loss.head import (
    OWN_FAILS,
    HeadTransform,
    keep_probes,
    keeps_positions,
    scale_candidates,
)

__all__ = ["probe"]

logger = logging.getLogger(__name__)


def probe(
    model: nn.Module,
    own: Callable[..., Any],
    ours: Callable[..., Any],
    use: Callable[[HeadTransform], None],
) -> str | None:
    """None when the patched loss equals the model's own loss on every probe input, else why
    not; `use` receives each HeadTransform tried and, last, the one the patched loss keeps.

    Args:
        model: the causal LM, its loss forward installed for the probe.
        own: the model's own forward (its loss, from its own logits).
        ours: the patched forward (the tiled loss, with the HeadTransform last given to `use`).
        use: sets the HeadTransform the patched forward reads.

    The probe inputs exercise what a model's loss may read beyond the LM head's cross-entropy:
    ignored labels (-100), an attention mask with zeros (some models drop masked positions from
    their loss), num_items_in_batch (when the forward takes it), and logits large enough that
    final-logit soft-capping matters (the LM head's weight scaled up for the probe: at random
    init the logits are too small for a cap to show). They run at each logit scale the config
    implies (head.py: scale_candidates) until one reproduces the model's loss. Then each form
    of logits_to_keep (when the forward takes it) is compared alone: a form that differs is
    served by the model's own loss, the others by the tiled one.
    """
    lm: Any = model  # a Hugging Face PreTrainedModel, duck-typed
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if head is None or getattr(head, "weight", None) is None:
        return "no LM head (get_output_embeddings): not a causal LM"
    if head.weight.device.type == "meta":
        return "weights on the meta device"
    device = head.weight.device
    vocab = head.weight.shape[0]
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, vocab, (2, 7), generator=gen, device=device)
    labels = ids.clone()
    labels[0, :2] = -100
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    cases: list[tuple[str, dict[str, Any]]] = [
        ("labels with ignored positions", {"input_ids": ids, "labels": labels}),
        (
            "an attention mask with zeros",
            {"input_ids": ids, "labels": labels, "attention_mask": mask},
        ),
    ]
    if _accepts(own, "num_items_in_batch"):
        cases.append(
            ("num_items_in_batch", {"input_ids": ids, "labels": labels, "num_items_in_batch": 7})
        )
    # The patched loss runs the same GEMMs on the same rows; low precision leaves room for a
    # different kernel choice, far below what a dropped position or a missing cap changes.
    rtol = 1e-4 if head.weight.dtype in (torch.float32, torch.float64) else 1e-2
    try:
        # In training mode, as the tiled loss is used (an MoE auxiliary loss shows; layers with
        # an inference-only path, such as bitsandbytes' 4-bit layers on the CPU, which repack
        # their weights in place, stay on their training path), each forward from the same
        # random state so that dropout draws the same masks; buffers are clones, so a
        # training-mode forward that updates them changes nothing.
        with probing(model, training=True), stand_ins(model, random_params=False):
            why = None
            for scale in scale_candidates(getattr(model, "config", None)):
                chosen = HeadTransform(scale)
                use(chosen)
                failed = _first_difference(own, ours, head, ids, cases, rtol)
                if failed is None:
                    break
                why = why or failed
            else:
                return why
            if keeps_positions(model):
                chosen.unserved = _unserved_forms(own, ours, ids, rtol)
    except Exception as e:  # a forward that the generic reimplementation cannot drive
        return f"the probe failed ({type(e).__name__}: {e})"
    return None


def _first_difference(
    own: Callable[..., Any],
    ours: Callable[..., Any],
    head: nn.Module,
    ids: torch.Tensor,
    cases: list[tuple[str, dict[str, Any]]],
    rtol: float,
) -> str | None:
    """None when the patched loss equals the model's own on every case, at ordinary and at
    large logits; else where it first differs."""
    for large in (False, True):
        with _large_logits(own, head, ids) if large else contextlib.nullcontext():
            for what, inputs in cases:
                output, tiled = _both_losses(own, ours, inputs)
                theirs = output.loss
                if getattr(output, "aux_loss", None) is not None and not _close(
                    tiled, theirs, rtol
                ):
                    return (
                        "its loss adds an MoE auxiliary loss (aux_loss) computed otherwise than "
                        "transformers' load_balancing_loss_func, which the tiled loss does not "
                        f"reproduce (own loss {float(theirs)}, tiled {float(tiled)}); set "
                        "output_router_logits=False to train without it, or leave the loss "
                        "untiled"
                    )
                if theirs is None or not torch.allclose(
                    tiled.float(), theirs.float(), rtol=rtol, atol=rtol * 0.1
                ):
                    where = what + (" and large logits" if large else "")
                    return (
                        f"with {where} the model's own loss "
                        f"({float(theirs) if theirs is not None else None}) differs from the "
                        f"LM-head cross-entropy ({float(tiled)}): its loss reads or "
                        "adds something the tiled loss does not reproduce (e.g. an MoE "
                        "auxiliary loss, logit scaling, positions dropped by the "
                        "attention mask, a soft-cap it reads elsewhere)"
                    )
    return None


def _both_losses(
    own: Callable[..., Any], ours: Callable[..., Any], inputs: dict[str, Any]
) -> tuple[Any, torch.Tensor]:
    """The model's own output and the patched loss on `inputs`, each from the same random
    state."""
    torch.manual_seed(0)
    theirs = own(**inputs)
    torch.manual_seed(0)
    return theirs, ours(**inputs).loss


def _close(a: torch.Tensor, b: Any, rtol: float) -> bool:
    return b is not None and torch.allclose(a.float(), b.float(), rtol=rtol, atol=rtol / 10)


def _unserved_forms(
    own: Callable[..., Any], ours: Callable[..., Any], ids: torch.Tensor, rtol: float
) -> dict[str, str]:
    """logits_to_keep form -> why the patched loss does not serve it (its loss differs from the
    model's own, or the model's own forward fails with it: OWN_FAILS, the exception logged at
    debug level)."""
    out: dict[str, str] = {}
    batch, seq = ids.shape
    gen = torch.Generator(device=ids.device).manual_seed(1)
    vocab = int(ids.max()) + 1
    for form, keep, shape in keep_probes(seq, batch, ids.device):
        labels = torch.randint(0, vocab, shape, generator=gen, device=ids.device)
        labels.view(-1)[0] = -100
        inputs = {"input_ids": ids, "labels": labels, "logits_to_keep": keep}
        try:
            output, tiled = _both_losses(own, ours, inputs)
            theirs = output.loss
        except Exception as e:  # the model's own forward does not take this form either
            out[form] = OWN_FAILS
            logger.debug(
                "tiled loss probe: logits_to_keep as %s runs the model's own loss, whose "
                "forward fails with it (%s: %s)",
                form,
                type(e).__name__,
                e,
            )
            continue
        if theirs is None or not torch.allclose(
            tiled.float(), theirs.float(), rtol=rtol, atol=rtol / 10
        ):
            out[form] = "the model keeps other positions than transformers' slice_logits_to_keep"
            logger.debug(
                "tiled loss probe: logits_to_keep as %s runs the model's own loss (%s, tiled %s)",
                form,
                None if theirs is None else float(theirs),
                float(tiled),
            )
    return out


def _accepts(fn: Any, name: str) -> bool:
    params = inspect.signature(fn).parameters
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


@contextlib.contextmanager
def _large_logits(own: Callable[..., Any], head: nn.Module, ids: torch.Tensor) -> Iterator[None]:
    """The LM head's weight scaled (for the block only, the head alone: a tied embedding keeps
    its own) so that the model's largest probe logit is about 100."""
    weight = head._parameters.get("weight")
    if weight is None:  # not a registered parameter (parametrized, quantised): probe as is
        yield
        return
    torch.manual_seed(0)
    logits = own(input_ids=ids).logits
    peak = float(logits.float().abs().max()) if logits is not None else 0.0
    scale = 100.0 / peak if peak > 0 else 1.0
    head._parameters["weight"] = nn.Parameter(weight.detach() * scale, weight.requires_grad)
    try:
        yield
    finally:
        head._parameters["weight"] = weight
