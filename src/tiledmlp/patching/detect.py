"""Finding the MLPs of a model by structure (never by class name).

A module is a candidate when it owns at least two projection matrices touching the model's
hidden size and behaves token-wise: on random tokens (eval mode, RNG untouched) its output for a
sequence equals the outputs for the sequence's two halves. Decoder layers and attention mix
tokens (or need more arguments) and fail that test; the walk then descends into their children.
The walk never descends into a chosen module.

Classification of a token-wise candidate:
- fast: ops.recognise() confirms a gated / fused gated / plain MLP;
- generic: an MLP whose projections are wrapped (PEFT LoRA) or are not nn.Linear (GPT-2's
  Conv1D), or that has dropout; or an MoE experts module (tiled with its routing tensors);
- not understood: token-wise, MLP-sized, but none of the above (reported; patched with the
  generic path only when the caller asks for it).

Invariant: detection runs each probed module on a few random tokens (no gradient is taken), the
caller's RNG state restored, and independent random weights and cloned buffers standing in for
the module's own (ops/tiling/probe.py): its answer does not depend on the current weight values (a
zero-initialised output projection makes any module look token-wise) and it changes no parameter,
buffer, mode or generator.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tiledmlp.ops.mlp.structure import recognise
from tiledmlp.ops.mlp.untiled import UntiledCall
from tiledmlp.ops.tiling.probe import stand_ins
from tiledmlp.patching.native import left_alone, liger_kind
from tiledmlp.patching.state import NORM_KIND, original_forward

__all__ = ["Candidate", "Detection", "detect_mlps", "experts_count", "hidden_size_of", "norms_of"]

logger = logging.getLogger(__name__)

_PROBE_TOKENS = 6


@dataclass(frozen=True)
class Candidate:
    """A module that can be tiled.

    Attributes:
        name: qualified name in the model ("" for the root).
        module: the module.
        path: "fast" or "generic".
        kind: what it was recognised as, e.g. "gated", "plain", "lora-wrapped MLP", "moe-experts".
        per_token_args: extra positional inputs that are split by tokens with x (MoE experts:
            the routing indices and weights); 0 for ordinary MLPs.
    """

    name: str
    module: nn.Module
    path: str
    kind: str
    per_token_args: int = 0


@dataclass(frozen=True)
class Detection:
    """Result of a walk: candidates, modules that look like MLPs but are not understood, and
    candidates skipped with a reason."""

    candidates: list[Candidate]
    not_understood: list[tuple[str, str]]
    skipped: list[tuple[str, str]]


def text_config(config: Any) -> Any:
    """The decoder's config: config.get_text_config() (multimodal models keep their language
    model's sizes and options there; a plain config returns itself), else config."""
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        try:
            return getter(decoder=True)
        except TypeError:  # older signature without decoder=
            return getter()
    return config


def hidden_size_of(model: nn.Module) -> int | None:
    """The model's hidden size: the text config's hidden_size (a multimodal model's top-level
    hidden_size may belong to another tower), else config.hidden_size, else the input
    embedding's dimension."""
    config = getattr(model, "config", None)
    for cfg in (text_config(config) if config is not None else None, config):
        value = getattr(cfg, "hidden_size", None) if cfg is not None else None
        if isinstance(value, int) and value > 0:
            return value
    getter = getattr(model, "get_input_embeddings", None)
    try:
        emb = getter() if callable(getter) else None
    except (NotImplementedError, AttributeError):
        emb = None
    if isinstance(emb, nn.Embedding):
        return emb.embedding_dim
    for m in model.modules():
        if isinstance(m, nn.Embedding):
            return m.embedding_dim
    return None


def is_projection(m: object) -> bool:
    """A layer applying one matrix: nn.Linear and look-alikes (a 2-D weight, no children, e.g.
    GPT-2's Conv1D), or an adapter wrapper around one (PEFT's base_layer convention). Anything
    that is not a module (an attribute set to None where a family leaves a projection out, as
    multi-head latent attention's q_proj beside q_a_proj) is not."""
    if not isinstance(m, nn.Module):
        return False
    base = getattr(m, "base_layer", None)
    if isinstance(base, nn.Module) and base is not m:
        return is_projection(base)
    weight = _weight_of(m)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and all(_is_parametrizations(m, c) for c in m.children())
    )


def _is_parametrizations(owner: nn.Module, child: nn.Module) -> bool:
    return child is getattr(owner, "parametrizations", None)


def _weight_of(m: nn.Module) -> Any:
    """m's weight without evaluating a parametrization (reading a spectral_norm-ed weight in
    training mode runs a power iteration and changes the module): the registered tensor, or for
    a parametrized weight the original it is computed from (same shape)."""
    own = m.__dict__.get("_parameters", {}).get("weight")
    if own is None:
        own = m.__dict__.get("_buffers", {}).get("weight")
    if own is not None:
        return own
    plist = getattr(m, "parametrizations", None)
    if isinstance(plist, nn.ModuleDict) and "weight" in plist:
        originals = [p for p in plist["weight"].parameters(recurse=False)]
        return max(originals, key=lambda p: p.dim(), default=None)
    weight = m.__dict__.get("weight")  # a plain attribute (some quantised layers)
    return weight if isinstance(weight, torch.Tensor) else None


def _matrices_touching(m: nn.Module, hidden: int) -> int:
    return sum(1 for p in m.parameters() if p.dim() >= 2 and hidden in p.shape)


@contextlib.contextmanager
def probing(m: nn.Module, training: bool = False) -> Iterator[None]:
    """Eval mode (or training mode), no grad, the RNG of the CPU and of the module's device
    forked; modes restored afterwards."""
    modes = [(sub, sub.training) for sub in m.modules()]
    m.train(training)
    p = next(m.parameters(), None)
    devices = [p.device] if p is not None and p.device.type not in ("cpu", "meta") else []
    device_type = devices[0].type if devices else "cuda"
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices, device_type=device_type):
            yield
    finally:
        for sub, mode in modes:
            sub.training = mode


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    tol = 1e-4 if a.dtype in (torch.float32, torch.float64) else 5e-2
    scale = max(b.abs().max().item(), 1e-30) if b.numel() else 1.0
    return bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * scale))


def _token_wise(call: Any, inputs: list[torch.Tensor], hidden: int, split: int) -> bool:
    """Whether call(*inputs) on all tokens equals the concatenation of calls on two parts."""
    try:
        full = _first_tensor(call(*inputs))
        a = _first_tensor(call(*[t[..., :split, :] if t.dim() == 3 else t[:split] for t in inputs]))
        b = _first_tensor(call(*[t[..., split:, :] if t.dim() == 3 else t[split:] for t in inputs]))
    except Exception:  # modules that need more arguments (attention, decoder layers) are not MLPs
        return False
    if full is None or a is None or b is None or full.shape[-1] != hidden:
        return False
    dim = -2 if inputs[0].dim() == 3 else 0
    if full.dim() != inputs[0].dim():
        return False
    return _close(torch.cat([a, b], dim=dim), full)


def _param_like(m: nn.Module) -> torch.Tensor | None:
    """A floating-point parameter: the device and dtype of the module's inputs (quantised
    layers keep packed integer weights beside floating-point adapters and biases)."""
    return next((p for p in m.parameters() if p.is_floating_point()), None)


def _probe_dense(m: nn.Module, hidden: int) -> bool:
    p = _param_like(m)
    if p is None or p.device.type == "meta":
        return False
    gen = torch.Generator(device=p.device).manual_seed(0)
    x = torch.randn(1, _PROBE_TOKENS, hidden, generator=gen, device=p.device).to(p.dtype)
    return _token_wise_everywhere(m, [x], hidden)


def _probe_experts(m: nn.Module, hidden: int, num_experts: int) -> bool:
    """MoE experts called as experts(hidden_states, top_k_index, top_k_weights)."""
    p = _param_like(m)
    if p is None or p.device.type == "meta":
        return False
    gen = torch.Generator(device=p.device).manual_seed(0)
    x = torch.randn(_PROBE_TOKENS, hidden, generator=gen, device=p.device).to(p.dtype)
    idx = torch.randint(0, num_experts, (_PROBE_TOKENS, 2), generator=gen, device=p.device)
    w = torch.rand(_PROBE_TOKENS, 2, generator=gen, device=p.device).to(p.dtype)
    return _token_wise_everywhere(m, [x, idx, w], hidden)


def _token_wise_everywhere(m: nn.Module, inputs: list[torch.Tensor], hidden: int) -> bool:
    """Token-wise at the module's own weights (cheap: most modules of a model fail here, e.g.
    a whole model or a decoder layer, which need other inputs) and then at independent random
    weights (at its own, a zero-initialised output projection makes any module look
    token-wise). Buffers are clones in both runs."""
    call = UntiledCall(m, original_forward(m))
    recorded = [_recorded(t) for t in inputs]
    for random_params in (False, True):
        with probing(m), stand_ins(m, random_params=random_params), _as_training_records():
            if not _token_wise(call, recorded, hidden, 2):
                return False
    return True


def _as_training_records() -> contextlib.AbstractContextManager[object]:
    """The dense probes record autograd as training does (on an input that requires grad): some
    layers take an inference-only kernel when nothing is recorded, and bitsandbytes' 4-bit
    layers on the CPU then repack their weights in place (and fail on the next call)."""
    return torch.enable_grad()


def _recorded(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.is_floating_point())


def experts_count(m: nn.Module) -> int | None:
    """E when the module holds experts as >= 2 stacked 3-D parameters with leading dim E."""
    stacked = [p for p in m.parameters(recurse=False) if p.dim() == 3]
    if len(stacked) >= 2 and len({p.shape[0] for p in stacked}) == 1:
        return stacked[0].shape[0]
    return None


def _classify_dense(m: nn.Module) -> str | None:
    """For a token-wise module the fast path refused: its generic-path kind when it has an MLP's
    shape (2-3 projections, at most one activation, dropouts) and a reason the fast path cannot
    take it (wrapped or non-Linear projections, dropout, hooks); None when its projections are
    plain Linear layers and yet its forward is not a known MLP formula."""
    if not _mlp_shaped(m) or any(True for _ in m.parameters(recurse=False)):
        return None
    children = list(m.children())
    projections = [c for c in children if is_projection(c)]
    rest = [c for c in children if not is_projection(c)]
    if any(any(True for _ in c.children()) for c in rest if not isinstance(c, nn.Dropout)):
        return None
    if any(getattr(c, "base_layer", None) is not None for c in projections):
        return "lora-wrapped MLP"
    if any(isinstance(c, nn.Dropout) and c.p > 0 for c in rest):
        return "MLP with dropout"
    if any(type(c).forward is not nn.Linear.forward for c in projections):
        return "MLP with non-Linear projections"
    if any(c._forward_hooks or c._forward_pre_hooks for c in children):
        return "MLP with hooked projections"
    return None


def _on_meta(m: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in m.parameters())


def _mlp_shaped(m: nn.Module) -> bool:
    """2-3 projection children, at most one parameter-free other child besides dropouts."""
    children = list(m.children())
    projections = [c for c in children if is_projection(c)]
    others = [c for c in children if not is_projection(c) and not isinstance(c, nn.Dropout)]
    return (
        len(projections) in (2, 3)
        and len(others) <= 1
        and not any(True for c in others for _ in c.parameters())
    )


def _has_mlp_inside(m: nn.Module) -> bool:
    return any(
        sub is not m and (experts_count(sub) is not None or recognise(sub) is not None)
        for sub in m.modules()
    )


def _examine(name: str, m: nn.Module, hidden: int) -> tuple[str, Any] | None:
    """detect_mlps's verdict on one module: None (not an MLP or an MoE block: look inside),
    ("candidate", Candidate), ("skipped" or "not understood", reason) or ("skipped, look
    inside", reason); every verdict but None and "skipped, look inside" stops the walk below
    the module."""
    if is_projection(m) or (_matrices_touching(m, hidden) < 2 and experts_count(m) is None):
        return None
    why = left_alone(m, "MLP")  # another library's kernel owns it (native.py)
    if why is not None:
        return "skipped", why
    experts = experts_count(m)
    if experts is not None:
        if _probe_experts(m, hidden, experts):
            return "candidate", Candidate(name, m, "generic", "moe-experts", per_token_args=2)
        return "skipped", (
            f"{type(m).__name__}: stacked experts not callable as "
            "experts(hidden_states, top_k_index, top_k_weights); left untiled"
        )
    if _on_meta(m):  # no values to probe
        if _mlp_shaped(m):
            return "skipped", "weights on the meta device: materialise them first"
        return None
    if not _probe_dense(m, hidden):
        if _mlp_shaped(m):
            # not chosen: the walk goes on below it (a candidate inside is still found)
            return "skipped, look inside", (
                f"{type(m).__name__}: shaped like an MLP but not token-wise on random "
                "hidden states (or needs more arguments); left untiled"
            )
        return None
    structure = recognise(m, UntiledCall(m, original_forward(m)))
    if structure is not None:
        return "candidate", Candidate(name, m, "fast", structure.kind.value)
    kind = _classify_dense(m)
    if kind is None and _mlp_shaped(m) and liger_kind(m) is not None:
        # a Liger MLP class (its activation inside Liger's kernel, no act_fn to read): the
        # generic path recomputes its own forward per tile
        kind = "Liger MLP"
    if kind is not None:
        return "candidate", Candidate(name, m, "generic", kind)
    if _has_mlp_inside(m):
        # An MoE block (stacked experts, or a list of expert MLPs): the experts are tiled
        # below and the router stays untiled, so router logits keep their gradients.
        return None
    return (
        "not understood",
        f"{type(m).__name__}: token-wise and MLP-sized, structure not recognised",
    )


def detect_mlps(model: nn.Module, hidden: int) -> Detection:
    """Walks `model` top-down and classifies its MLPs.

    Args:
        model: any nn.Module (a whole model, a decoder layer, or an MLP itself).
        hidden: the hidden size the MLPs take and return.
    """
    candidates: list[Candidate] = []
    not_understood: list[tuple[str, str]] = []
    skipped: list[tuple[str, str]] = []
    chosen: list[str] = []
    for name, m in model.named_modules():
        if any(c == "" or name == c or name.startswith(c + ".") for c in chosen):
            continue  # never descend into a chosen module
        try:
            verdict = _examine(name, m, hidden)
        except Exception as e:  # a module nobody foresaw is left untiled, saying why
            first = (str(e).strip().splitlines() or [""])[0][:160]
            why = f"{type(e).__name__}: {first}" if first else type(e).__name__
            verdict = (
                "skipped",
                f"{type(m).__name__}: recognising it failed ({why}); left untiled",
            )
        if verdict is None:
            continue
        what, found = verdict
        if what == "candidate":
            candidates.append(found)
        elif what == "not understood":
            not_understood.append((name, found))
        else:
            skipped.append((name, found))
        if what != "skipped, look inside":
            chosen.append(name)
    return Detection(candidates, not_understood, skipped)


_NORM_NAMES = ("LayerNorm", "RMSNorm")


def norms_of(
    model: nn.Module, hidden: int, skipped: list[tuple[str, str]] | None = None
) -> list[Candidate]:
    """The normalisation layers over the hidden size (token-wise: each token is normalised on
    its own), as generic-path candidates: nn.LayerNorm, nn.RMSNorm and modules whose class
    name ends in LayerNorm or RMSNorm, with one weight of `hidden` elements. Per-head norms
    (e.g. Qwen3's q_norm over the head dimension) are left alone, and so are norms another
    library's kernel already owns (native.py: Liger's RMSNorm, hub kernels), each added to
    `skipped` with the reason."""
    found = []
    for name, module in model.named_modules():
        named = type(module).__name__.endswith(_NORM_NAMES)
        if not (named or isinstance(module, (nn.LayerNorm, nn.RMSNorm))):
            continue
        weight = _weight_of(module)
        if isinstance(weight, torch.Tensor) and tuple(weight.shape) == (hidden,):
            why = left_alone(module, "norm")
            if why is None:
                found.append(Candidate(name, module, "generic", NORM_KIND))
            elif skipped is not None:
                skipped.append((name, why))
    return found
