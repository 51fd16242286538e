"""What a causal LM does between its last hidden states and its loss, as the tiled loss
reproduces it: the positions it keeps (`logits_to_keep`), the scale on its logits, their
soft-capping, and the targets Hugging Face's causal-LM loss scores them against.

`logits_to_keep` takes the forms of transformers' slice_logits_to_keep (modeling_utils): None
or 0 keeps every position; an int k > 0 the last k of each sequence; a 1-D tensor the positions
it indexes or masks, in every sequence; a 2-D integer tensor (batch, n) positions per sequence;
a 2-D bool tensor (batch, seq) the True positions, flattened. The model then scores the kept
logits, flattened, against its labels shifted along their own last dimension and flattened
(ForCausalLMLoss), so the labels hold one entry per kept position.

Invariant: kept_rows and targets_of compute the rows and targets that the model's own forward
scores; whether a model's forward slices this way is the probe's to show (forward.py),
form by form.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from tiledmlp.patching.detect import text_config

__all__ = [
    "ALL",
    "OWN_FAILS",
    "PASSED_FORMS",
    "HeadTransform",
    "keep_probes",
    "router_aux_loss",
    "keep_form",
    "keeps_positions",
    "kept_rows",
    "scale_candidates",
    "softcap_of",
    "targets_of",
]

#: the form of "every position" (logits_to_keep None or 0)
ALL = "all"
#: why a form runs the model's own loss when the model's own forward fails with it: the call
#: fails as it does unpatched (the probe's exception goes to the debug log)
OWN_FAILS = "the model's own forward fails with it too"
#: the logits_to_keep forms frameworks pass with labels (transformers' generate and TRL's
#: trainers an int; ms-swift an int, or a 1-D bool mask at batch size 1); the other forms reach
#: a model only from its caller's own code, so the patch report leaves them out and a call with
#: one that runs the model's own loss says so when it comes
PASSED_FORMS = frozenset({"an int", "a 1-D bool tensor"})


@dataclass
class HeadTransform:
    """How the tiled loss forms a model's logits, from its probe.

    Attributes:
        scale: multiplies the LM head's logits (before soft-capping).
        unserved: logits_to_keep form -> why calls with it run the model's own loss.
    """

    scale: float = 1.0
    unserved: dict[str, str] = field(default_factory=dict)


def keep_form(keep: Any) -> str | None:
    """The form of a `logits_to_keep` value (ALL, "an int", "a 1-D bool tensor", "a 1-D index
    tensor", "a 2-D bool tensor", "a 2-D index tensor"), or None for a value none of
    transformers' forms is (a negative int, a float or 0-d tensor, ...)."""
    if keep is None or (isinstance(keep, int) and not isinstance(keep, bool) and keep == 0):
        return ALL
    if isinstance(keep, int) and not isinstance(keep, bool):
        return "an int" if keep > 0 else None
    if not isinstance(keep, torch.Tensor) or keep.dim() not in (1, 2):
        return None
    if keep.dtype == torch.bool:
        kind = "bool"
    elif not keep.dtype.is_floating_point and not keep.dtype.is_complex:
        kind = "index"
    else:
        return None
    return f"a {keep.dim()}-D {kind} tensor"


def keeps_positions(model: Any) -> bool:
    """Whether the model's class's forward takes logits_to_keep (whatever wrapper an instance
    has installed over it)."""
    forward = getattr(type(model), "forward", None)
    return forward is not None and "logits_to_keep" in inspect.signature(forward).parameters


def kept_rows(hidden: torch.Tensor, keep: Any) -> torch.Tensor:
    """The rows of `hidden` (batch, seq, hidden) whose logits the model forms with
    `logits_to_keep` = keep (not ALL), flattened to (rows, hidden), in the model's order."""
    if isinstance(keep, torch.Tensor) and keep.dim() == 2:
        keep = keep.to(hidden.device)
        if keep.dtype == torch.bool:
            return hidden[keep]
        return torch.take_along_dim(hidden, keep[..., None], dim=1).flatten(0, -2)
    if isinstance(keep, int):
        return hidden[:, -keep:, :].flatten(0, -2)
    return hidden[:, keep.to(hidden.device), :].flatten(0, -2)


def targets_of(
    labels: torch.Tensor, shift_labels: torch.Tensor | None, ignore_index: int = -100
) -> torch.Tensor:
    """The flattened targets of Hugging Face's causal-LM loss: shift_labels when given, else the
    labels shifted by one along their last dimension (the last position ignored)."""
    if shift_labels is None:
        pad = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = pad[..., 1:]
    return shift_labels.reshape(-1)


def keep_probes(seq: int, batch: int, device: torch.device) -> list[tuple[str, Any, tuple]]:
    """(form, logits_to_keep, labels' shape) for each form, over a (batch, seq) input."""
    mask = torch.zeros(seq, dtype=torch.bool, device=device)
    mask[1::2] = True
    mask[-1] = True
    index = mask.nonzero().squeeze(1)
    mask2 = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    mask2[0, 1:4] = True
    mask2[1:, 2:] = True
    index2 = torch.stack([torch.arange(seq - 3, seq, device=device)] * batch)
    index2[0] = torch.tensor([0, 2, seq - 1], device=device)
    return [
        ("an int", 3, (batch, 3)),
        ("a 1-D bool tensor", mask, (batch, int(mask.sum()))),
        ("a 1-D index tensor", index, (batch, index.numel())),
        ("a 2-D bool tensor", mask2, (1, int(mask2.sum()))),
        ("a 2-D index tensor", index2, (batch, 3)),
    ]


def router_aux_loss(
    model: Any, outputs: Any, attention_mask: torch.Tensor | None
) -> tuple[torch.Tensor, float] | None:
    """The MoE auxiliary loss a causal LM adds to its loss, and its coefficient, from the router
    logits its decoder returned; None when it returned none (output_router_logits off), or
    when the model computes it otherwise (the probe then shows the difference).

    Transformers' MoE causal LMs (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS, ...) add
    router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts,
    num_experts_per_tok, attention_mask), that function from the model's own module.
    """
    router = getattr(outputs, "router_logits", None)
    if router is None or (isinstance(router, tuple | list) and not router):
        return None
    module = sys.modules.get(type(model).__module__)
    fn = getattr(module, "load_balancing_loss_func", None)
    experts = getattr(model, "num_experts", None)
    top_k = getattr(model, "num_experts_per_tok", None)
    coef = getattr(model, "router_aux_loss_coef", None)
    if not callable(fn) or experts is None or top_k is None or coef is None:
        return None
    return fn(router, experts, top_k, attention_mask), float(coef)


def softcap_of(config: Any) -> float | None:
    """The final-logit soft-capping the model applies: its config's, else its text config's
    (multimodal models such as PaliGemma with a Gemma 2 decoder, or Gemma3n, read it there)."""
    for cfg in (config, text_config(config) if config is not None else None):
        value = getattr(cfg, "final_logit_softcapping", None) if cfg is not None else None
        if value:
            return float(value)
    return None


def scale_candidates(config: Any) -> list[float]:
    """The logit scales a model's config may imply, the likeliest first: Cohere's logit_scale
    multiplies the logits; Granite and MiniCPM3 divide the logits (or the last hidden states)
    by logits_scaling, HyperCLOVAX multiplies them by it; Inkling divides the hidden states by
    logits_mup_width_multiplier. The probe keeps the first that reproduces the model's loss."""
    scale, alternatives = 1.0, []
    for cfg in (config, text_config(config) if config is not None else None):
        if cfg is None:
            continue
        mult = _number(getattr(cfg, "logit_scale", None))
        div = _number(getattr(cfg, "logits_scaling", None))
        width = _number(getattr(cfg, "logits_mup_width_multiplier", None))
        if mult is None and div is None and width is None:
            continue
        scale = (mult or 1.0) / (div or 1.0) / (width or 1.0)
        if div is not None:
            alternatives.append((mult or 1.0) * div / (width or 1.0))
        break
    out = [scale]
    for value in [*alternatives, 1.0]:
        if value not in out:
            out.append(value)
    return out


def _number(value: Any) -> float | None:
    """A positive finite scale, else None (absent, 0, a tensor or a string are not scales)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if value > 0 and value != float("inf") else None
