"""Tiled decoder layers: recognising a decoder layer and installing the tiled forward.

A layer is recognised by structure and by a probe: it must hold self_attn (q_proj, k_proj,
v_proj or a fused qkv_proj, o_proj, optional q_norm / k_norm per head or over the whole
projection, head_dim, scaling; or multi-head latent attention, latent_attention.py),
an mlp (dense, or a mixture of experts run whole) and norms whose names say where they sit
(`_norms`: Llama, Gemma 2/3, OLMo 2/3, Cohere); its own forward must give, at independent random
weights (ops/tiling/probe.py), in training mode, with random rotary angles, exactly what the two
blocks (blocks.py) give around the same attention call (the probe records the
keyword arguments the attention module passes, e.g. a sliding window, soft-capping or attention
sinks, and passes the same ones). Anything else is refused with one line, never approximated;
a hybrid stack's linear-attention layer keeps its own attention (`own_mixer`). `install_layer`
puts the tiled forward (forward.py) on a recognised layer.

Invariant: recognition changes nothing on the layer (the probe restores its weights, mode and
attention implementation); installing is reversible (the original forward is kept in the layer's
patch state) and leaves parameters, buffers and state_dict untouched.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tiledmlp.config.tiled import TiledMLPConfig
from tiledmlp.ops.tiling.probe import absent, stand_ins
from tiledmlp.patching.agreement import StepTokens
from tiledmlp.patching.bound import bind
from tiledmlp.patching.detect import is_projection, probing
from tiledmlp.patching.features.tiled_layers.blocks import (
    LayerParts,
    Norms,
    PostAttention,
    PreAttention,
    layer_math,
)
from tiledmlp.patching.features.tiled_layers.forward import (
    LAYER,
    tiled_layer_forward,
    unchecked_forward,
)
from tiledmlp.patching.features.tiled_layers.latent_attention import LatentPreAttention, is_latent
from tiledmlp.patching.state import LAYER_KIND, STATE, PatchState, original_forward
from tiledmlp.sequence_parallel.install import set_implementation

__all__ = [
    "LAYER",
    "decoder_layers",
    "install_layer",
    "layer_parts",
    "own_mixer",
    "tiled_layer_forward",
]

_PROBE_NAME = "tiledmlp_layer_probe"
_PROBE_TOKENS = 5
# Keyword arguments of the attention call that the tiled forward passes itself.
_OWN_KWARGS = frozenset({"dropout", "scaling", "position_ids", "use_cache"})


def decoder_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that look like decoder layers: an attention child (a name containing "attn" or
    "attention") beside an MLP child ("mlp" or "feed_forward"), not inside another one."""
    found: list[tuple[str, nn.Module]] = []
    for name, m in model.named_modules():
        if any(name.startswith(n + ".") for n, _ in found if n):
            continue
        children = dict(m.named_children())
        has_attn = any("attn" in c or "attention" in c for c in children)
        has_mlp = any(c in ("mlp", "feed_forward") for c in children)
        if has_attn and has_mlp:
            found.append((name, m))
    return found


def own_mixer(layer: nn.Module) -> str | None:
    """Why a decoder layer keeps its own token mixer (a hybrid stack's linear-attention layer,
    e.g. Qwen3-Next's gated delta net: its state runs along the sequence, so it is not split
    into tiles; its MLP and norms are tiled by their own patches), or None."""
    mixer = getattr(layer, "linear_attn", None)
    if isinstance(mixer, nn.Module) and not isinstance(
        getattr(layer, "self_attn", None), nn.Module
    ):
        return (
            f"linear-attention layer ({type(mixer).__name__}): keeps its own attention; "
            "its MLP and norms are tiled by the MLP and norm patches"
        )
    return None


def _family_function(module: nn.Module, name: str) -> Callable[..., Any] | None:
    """A function of the module's modeling file (the one its forward calls by that name)."""
    fn = getattr(sys.modules.get(type(module).__module__), name, None)
    return fn if callable(fn) else None


def _norms(layer: nn.Module) -> Norms | str:
    """Where the layer's norms sit, by their names (the probe checks the guess)."""

    def get(name: str) -> nn.Module | None:
        m = getattr(layer, name, None)
        return m if isinstance(m, nn.Module) else None

    attn_in, post_attn = get("input_layernorm"), get("post_attention_layernorm")
    pre_ff, post_ff = get("pre_feedforward_layernorm"), get("post_feedforward_layernorm")
    if pre_ff is not None:  # Gemma 2/3: a norm before and after the attention and the MLP
        return Norms(attn_in, post_attn, pre_ff, post_ff)
    if post_ff is not None:  # OLMo 2/3: norms on the outputs only
        return Norms(attn_in, post_attn, None, post_ff)
    if post_attn is not None:  # Llama: a norm before the attention and before the MLP
        return Norms(attn_in, None, post_attn, None)
    if attn_in is not None:  # Cohere: one norm, attention and MLP side by side
        return Norms(attn_in, parallel=True)
    return "no input_layernorm or post_attention_layernorm"


def _projection(attn: Any, name: str) -> nn.Module | None:
    """The attention's projection of that name (None where absent, None or not a matrix)."""
    m = getattr(attn, name, None)
    return m if isinstance(m, nn.Module) and is_projection(m) else None


def _projections(attn: Any) -> tuple[nn.Module, ...] | str:
    """(q_proj, k_proj, v_proj), or (qkv_proj,) for one fused projection."""
    names = ("q_proj", "k_proj", "v_proj")
    found = [_projection(attn, n) for n in names]
    if all(p is not None for p in found):
        return tuple(p for p in found if p is not None)
    fused = _projection(attn, "qkv_proj")
    if fused is not None:
        return (fused,)
    missing = [n for n, p in zip(names, found) if p is None]
    return f"its attention has no projection {', '.join(missing)} (renamed q/k/v)"


def _dropout(layer: nn.Module) -> str | None:
    """Why the layer cannot be tiled exactly for dropout in it (outside its MLP), or None."""
    for name, m in layer.named_children():
        if isinstance(m, nn.Dropout) and m.p > 0:
            return f"its {name} drops out with p={m.p} (set it to 0 to tile the layer)"
    return None


def _structure(layer: nn.Module) -> LayerParts | str:
    """The layer's parts by attribute, or why it is not a recognised decoder layer."""
    missing = [
        n for n in ("self_attn", "mlp") if not isinstance(getattr(layer, n, None), nn.Module)
    ]
    if missing:
        return f"no {', '.join(missing)}"
    norms = _norms(layer)
    if isinstance(norms, str):
        return norms
    attn: Any = layer.self_attn  # the family's attention module, read by attribute
    config: Any = getattr(attn, "config", None)
    if not isinstance(getattr(config, "_attn_implementation", None), str):
        return "its attention has no config naming the attention implementation"
    if is_latent(attn):
        return _latent_structure(layer, norms)
    projections = _projections(attn)
    if isinstance(projections, str):
        return projections
    if _projection(attn, "o_proj") is None:
        return "its attention has no projection o_proj"
    head_dim = getattr(attn, "head_dim", None)
    if not isinstance(head_dim, int) or not isinstance(getattr(attn, "scaling", None), float):
        return "its attention has no head_dim / scaling attributes"
    common = _common(layer, norms)
    if isinstance(common, str):
        return common
    moe, cache_keyword = common
    mlp: nn.Module = layer.mlp  # type: ignore[assignment]
    rotary = _family_function(attn, "apply_rotary_pos_emb")
    if rotary is None:
        return "its attention's module has no apply_rotary_pos_emb (no rotary embedding)"
    q_norm = getattr(attn, "q_norm", None)
    q_norm = q_norm if isinstance(q_norm, nn.Module) else None
    k_norm = getattr(attn, "k_norm", None)
    k_norm = k_norm if isinstance(k_norm, nn.Module) else None
    q_size = int(config.num_attention_heads) * head_dim
    # A q norm whose weight spans every head is over the whole projection (OLMo 2/3).
    weight = getattr(q_norm, "weight", None)
    whole = (
        isinstance(weight, torch.Tensor) and weight.dim() == 1 and len(weight) == q_size != head_dim
    )
    # A q projection twice the query's width gives each head's query and output gate.
    gated = len(projections) == 3 and getattr(projections[0], "out_features", 0) == 2 * q_size
    pre = PreAttention(
        norms.attn_in, projections, q_norm, k_norm, rotary, head_dim,
        q_size=q_size, whole_qk_norm=whole, gated=gated,
    )  # fmt: skip
    post = PostAttention(attn.o_proj, norms, None if moe else mlp)
    parts = LayerParts(pre, post, attn, head_dim, _family_function(attn, "eager_attention_forward"))
    parts.moe = mlp if moe else None
    parts.cache_keyword = cache_keyword
    return parts


def _common(layer: nn.Module, norms: Norms) -> tuple[bool, str] | str:
    """(whether the MLP is a mixture of experts, the cache keyword), or why the layer is
    refused, for what every recognised layer shares."""
    mlp: nn.Module = layer.mlp  # type: ignore[assignment]
    moe = any(p.dim() > 2 for p in mlp.parameters()) or any(
        isinstance(m, nn.ModuleList) for m in mlp.modules()
    )
    if moe and norms.parallel:
        return "its MLP routes tokens to experts beside the attention (parallel block)"
    why = _dropout(layer)
    if why is not None:
        return why
    params = inspect.signature(original_forward(layer)).parameters
    if "position_embeddings" not in params:
        return "its forward takes no position_embeddings"
    return moe, "cache" if "cache" in params else "past_key_values"


def _latent_structure(layer: nn.Module, norms: Norms) -> LayerParts | str:
    """The parts of a multi-head-latent-attention layer (latent_attention.py)."""
    attn: Any = layer.self_attn
    if not isinstance(getattr(attn, "scaling", None), float):
        return "its latent attention has no scaling attribute"
    common = _common(layer, norms)
    if isinstance(common, str):
        return common
    moe, cache_keyword = common
    interleaved = bool(getattr(attn.config, "rope_interleave", False))
    name = "apply_rotary_pos_emb_interleave" if interleaved else "apply_rotary_pos_emb"
    rotary = _family_function(attn, name)
    if rotary is None:
        return f"its latent attention's module has no {name}"
    mlp: nn.Module = layer.mlp  # type: ignore[assignment]
    pre = LatentPreAttention(norms.attn_in, attn, rotary)
    post = PostAttention(attn.o_proj, norms, None if moe else mlp)
    head_dim = pre.nope + pre.rope
    eager = _family_function(attn, "eager_attention_forward")
    parts = LayerParts(pre, post, attn, head_dim, eager, moe=mlp if moe else None)
    parts.cache_keyword = cache_keyword
    parts.v_head_dim, parts.rotary_width, parts.latent = pre.v_dim, pre.rope, True
    return parts


# -- recognition by probe ----------------------------------------------------------------------


@dataclass
class _Recorded:
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, Any]]] = field(
        default_factory=list
    )


_RECORDED = _Recorded()


def _probe_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention in plain PyTorch that records its inputs: the same function for the
    layer's own forward and for the blocks, so only what surrounds it is compared."""
    _RECORDED.calls.append((query, key, value, kwargs))
    groups = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(groups, dim=1)
    v = value.repeat_interleave(groups, dim=1)
    scores = (query @ k.transpose(-1, -2)).float() * kwargs.get("scaling", 1.0)
    n = scores.shape[-1]
    mask = torch.ones(n, n, dtype=torch.bool, device=scores.device).tril()
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1).to(v.dtype)
    return (weights @ v).transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _probe_implementation(config: Any) -> Iterator[None]:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(_PROBE_NAME, _probe_attention)
    internal = hasattr(config, "_attn_implementation_internal")
    saved = config._attn_implementation_internal if internal else config._attn_implementation
    set_implementation(config, _PROBE_NAME)
    try:
        yield
    finally:
        set_implementation(config, saved)
        _RECORDED.calls.clear()


def _line(e: Exception) -> str:
    """An exception as one line (refusals are one line)."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    tol = 1e-4 if a.dtype in (torch.float32, torch.float64) else 5e-2
    scale = max(float(b.abs().max()), 1e-30) if b.numel() else 1.0
    return bool(torch.allclose(a.float(), b.float(), rtol=tol, atol=tol * scale))


def _probe(layer: nn.Module, parts: LayerParts) -> str | None:
    """Runs the layer's own forward and the blocks on the same random inputs at independent
    random weights, in training mode; fills parts.extra_kwargs and parts.returns_tuple from the
    attention call the layer makes. Returns why the layer is refused, or None. On fake or meta
    parameters (the planner) only the recording runs."""
    param = next((p for p in layer.parameters() if p.is_floating_point()), None)
    if param is None:
        return "it has no floating-point parameters"
    compare = not absent(param)
    device, dtype = param.device, param.dtype
    hidden = int(parts.attn.config.hidden_size)
    weights = stand_ins(layer) if compare else contextlib.nullcontext()
    with probing(layer, training=True), _probe_implementation(parts.attn.config), weights:
        gen = torch.Generator(device=device).manual_seed(0) if compare else None
        x = torch.randn(2, _PROBE_TOKENS, hidden, generator=gen, device=device).to(dtype)
        positions = torch.arange(_PROBE_TOKENS, device=device)[None]
        failed: Exception | None = None
        # The rotary angles span the head (Llama) or half of it (a rotary that splits the
        # head in halves and gives each the same angle, e.g. GPT-OSS): the first that runs.
        rotary = parts.rotary_width or parts.head_dim
        for width in (rotary, rotary // 2):
            theta = torch.rand(1, _PROBE_TOKENS, width, generator=gen, device=device)
            cos, sin = (theta * 6.0).cos().to(dtype), (theta * 6.0).sin().to(dtype)
            _RECORDED.calls.clear()
            try:
                ref = unchecked_forward(layer)(
                    x,
                    attention_mask=None,
                    position_ids=positions,
                    use_cache=False,
                    position_embeddings=(cos, sin),
                    **{parts.cache_keyword: None},
                )
                break
            except Exception as e:  # any failure means the layer is not called like Llama's
                failed = failed or e
        else:
            assert failed is not None
            return f"its forward cannot be called like a Llama decoder layer's ({_line(failed)})"
        if len(_RECORDED.calls) != 1:
            return "its forward does not call the attention function exactly once"
        q_ref, k_ref, v_ref, recorded = _RECORDED.calls.pop()
        if recorded.get("scaling") != parts.attn.scaling:
            return "its attention passes a scaling other than its `scaling` attribute"
        if recorded.get("dropout") != getattr(parts.attn, "attention_dropout", None):
            return "its attention passes a dropout other than its `attention_dropout`"
        extra = {k: v for k, v in recorded.items() if k not in _OWN_KWARGS}
        own = {id(t): n for n, t in vars(parts.attn)["_parameters"].items() if t is not None}
        own.update((id(t), n) for n, t in vars(parts.attn)["_buffers"].items() if t is not None)
        for key, value in list(extra.items()):
            if isinstance(value, torch.Tensor):
                if id(value) not in own:
                    return f"its attention passes a tensor {key} that is not one of its own"
                parts.tensor_kwargs[key] = own[id(value)]
                del extra[key]
        parts.extra_kwargs = extra
        parts.returns_tuple = isinstance(ref, tuple)
        if parts.returns_tuple and len(ref) != 1:
            return f"its forward returns {len(ref)} values"
        try:
            got = layer_math(
                parts, lambda block, *a: block(*a), x, None, positions, False,
                (cos, sin), {}, _probe_attention,
            )  # fmt: skip
        except Exception as e:
            return f"its modules cannot be called as a Llama decoder layer's ({_line(e)})"
        q, k, v, _ = _RECORDED.calls.pop()
        if not compare:
            return None
        y_ref = ref[0] if parts.returns_tuple else ref
        y = got[0] if parts.returns_tuple else got
        if not all(_close(a, b) for a, b in ((q, q_ref), (k, k_ref), (v, v_ref), (y, y_ref))):
            return (
                "its forward computes something other than norm -> q/k/v (-> q/k norms) -> "
                "rotary -> attention -> o_proj (-> norm) + residual -> norm -> MLP (-> norm) "
                "+ residual, with the norms where their names say"
            )
    return None


def layer_parts(layer: nn.Module) -> LayerParts | str:
    """The recognised parts of a decoder layer (module docstring), or why it is refused."""
    parts = _structure(layer)
    if isinstance(parts, str):
        return parts
    why = _probe(layer, parts)
    return parts if why is None else why


def install_layer(
    layer: nn.Module,
    parts: LayerParts,
    config: TiledMLPConfig,
    step: StepTokens | None = None,
) -> None:
    """Installs the tiled forward on `layer` (idempotent: a patched layer takes the new config).

    Args:
        layer: the decoder layer.
        parts: from layer_parts(layer).
        config: the tile policy of both blocks.
        step: the model's per-step token agreement (patching/agreement.py); None: none.
    """
    existing = layer.__dict__.get(STATE)
    if existing is not None:
        existing.config = config
        existing.step = step or existing.step
        return
    state = PatchState(
        layer.__dict__.get("forward"), config, "generic", LAYER_KIND, 0, step or StepTokens()
    )
    layer.__dict__[LAYER] = parts
    layer.__dict__[STATE] = state
    layer.forward = bind(tiled_layer_forward, layer, original_forward)  # type: ignore[method-assign]
