"""Tiled decoder layers: everything token-wise in a Llama-family layer runs in tiles.

A recognised decoder layer computes

    q, k, v = rotary(q_norm(q_proj(n1)), k_norm(k_proj(n1))), v_proj(n1),   n1 = norm1(x)
    a = attention(q, k, v)                                   (the attention core: mixes tokens)
    h = x + o_proj(a);   y = h + mlp(norm2(h))

Everything but the attention core is token-wise (rotary given each token's cos/sin), so the
layer runs as two blocks through tiled_mlp's generic path (ops/generic.py), around the model's own
attention function, called through Hugging Face's attention interface for the model's
`_attn_implementation` (so a sequence-parallel attention registered there, Ulysses, runs on the
projections of the local shard):

- the pre-attention block x, cos, sin -> q, k, v (norm, projections, per-head norms, rotary);
- the post-attention block a, x -> y (o_proj, residual, norm, MLP, residual).

Neither block keeps anything from its forward but its inputs (saved by a tiny anchor op), so a
checkpointed layer's recompute holds x, q, k, v, the attention output and their gradients, and
stops right after the attention core (the post-attention block is not re-run by it). The
attention core itself, where the implementation is "sdpa" (also behind a sequence-parallel
exchange), runs by groups of heads (patching/attention_core.py): the flash backward's own
buffers exist for one group at a time.

Cost, per layer and training step, in units of 2 * tokens * hidden * (output columns): the
pre-attention projections run 3 times forward (forward, the checkpoint's recompute, the tiled
backward's recompute) against 2 untiled with checkpointing; o_proj and the MLP run twice forward
(forward, tiled backward) as untiled with checkpointing: the MLP runs inside the post-attention
block on the generic path, 12U instead of the fast path's 11U (U as in tiled_mlp). For the
Llama-3-8B shape that is 219,136 units against 212,992 untiled with checkpointing (+2.9%) and
198,656 with only the MLP tiled (+10.3%); attention's own cost (about 4.5 * tokens units) is
unchanged and dominates from ~64K tokens on.

Recognition is by structure and by a probe: the layer must hold input_layernorm, self_attn
(q_proj, k_proj, v_proj, o_proj, optional q_norm / k_norm, head_dim, scaling), a dense
post_attention_layernorm and mlp (no experts), and its own forward must give, at independent
random weights (ops/probe.py), in training mode, with random rotary angles, exactly what the two
blocks give around the same attention call (the probe records the keyword arguments the
attention module passes, e.g. a sliding window, and passes the same ones). Anything else is
refused with one line, never approximated.

Invariant: a tiled layer computes what its original forward computes, with the same gradients
for its input and every parameter, each delivered once per backward; its parameters, buffers and
state_dict are untouched (the blocks are unregistered wrappers around the layer's own modules),
and unpatching restores the original forward. Calls the blocks cannot take (attention weights
being recorded, no rotary embeddings) run the original forward; a KV cache is updated with the
rotated keys and the values as the attention module does.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tiledmlp.config.tiled import TiledMLPConfig
from tiledmlp.ops.functional import tiled_mlp
from tiledmlp.ops.probe import absent, stand_ins
from tiledmlp.ops.untiled import UntiledCall
from tiledmlp.patching.agreement import StepTokens
from tiledmlp.patching.attention_core import by_heads
from tiledmlp.patching.bound import bind
from tiledmlp.patching.detect import is_projection, probing
from tiledmlp.patching.engine_registry import backend_for, run_checks
from tiledmlp.patching.hf_attention import HF_ATTENTION
from tiledmlp.patching.state import STATE, PatchState, original_forward
from tiledmlp.sequence_parallel.install import set_implementation

__all__ = [
    "LAYER",
    "LAYER_KIND",
    "LayerParts",
    "PostAttention",
    "PreAttention",
    "decoder_layers",
    "install_layer",
    "layer_parts",
    "tiled_layer_forward",
]

logger = logging.getLogger(__name__)

LAYER = "_tiledmlp_layer"
LAYER_KIND = "decoder layer"
_PROBE_NAME = "tiledmlp_layer_probe"
_PROBE_TOKENS = 5
# Keyword arguments of the attention call that the tiled forward passes itself.
_OWN_KWARGS = frozenset({"dropout", "scaling", "position_ids", "use_cache"})


def _call_untiled(module: nn.Module, *args: torch.Tensor) -> Any:
    """Calls `module` as the layer would, but never tiled again: a module patched by
    patch_model (a tiled MLP or norm) runs its original forward inside the block's tile."""
    if STATE in module.__dict__:
        return UntiledCall(module, original_forward(module))(*args)
    return module(*args)


class PreAttention(nn.Module):
    """x, cos, sin -> q, k, v: the layer's first norm, the q/k/v projections, the per-head
    q/k norms (when present) and the rotary embedding, token by token.

    Holds the layer's own modules (it is not registered in the model: its parameters are the
    layer's). Inputs x (1 or batch, n, hidden), cos and sin (n, head_dim) or x's leading dims
    plus head_dim; outputs q (..., heads * head_dim), k and v (..., kv_heads * head_dim).
    """

    def __init__(
        self,
        norm: nn.Module,
        q_proj: nn.Module,
        k_proj: nn.Module,
        v_proj: nn.Module,
        q_norm: nn.Module | None,
        k_norm: nn.Module | None,
        rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        head_dim: int,
    ) -> None:
        super().__init__()
        self.norm = norm
        self.q_proj = q_proj
        self.k_proj = k_proj
        self.v_proj = v_proj
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.rotary = rotary
        self.head_dim = head_dim

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        lead = x.shape[:-1]
        normed = _call_untiled(self.norm, x)
        q = self.q_proj(normed).view(*lead, -1, self.head_dim)
        k = self.k_proj(normed).view(*lead, -1, self.head_dim)
        v = self.v_proj(normed)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        cos = cos.reshape(*lead, cos.shape[-1])
        sin = sin.reshape(*lead, sin.shape[-1])
        # The model's own rotary function, in its layout: (batch, heads, seq, head_dim).
        q, k = self.rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q.transpose(1, 2).reshape(*lead, -1), k.transpose(1, 2).reshape(*lead, -1), v


class PostAttention(nn.Module):
    """a, x -> y: the output projection, the residual, the second norm, the MLP and the second
    residual, token by token. Inputs a (1 or batch, n, heads * head_dim) and the layer input x
    (n, hidden) or a's leading dims plus hidden; output y like x with a's leading dims."""

    def __init__(self, o_proj: nn.Module, norm: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.o_proj = o_proj
        self.norm = norm
        self.mlp = mlp

    def forward(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        residual = residual.reshape(*attn.shape[:-1], residual.shape[-1])
        h = residual + self.o_proj(attn)
        return h + _call_untiled(self.mlp, _call_untiled(self.norm, h))


@dataclass
class LayerParts:
    """A recognised decoder layer: its two tiled blocks and how its attention is called.

    Attributes:
        pre: the pre-attention block.
        post: the post-attention block.
        attn: the attention module (handed to the attention function, as its own forward does).
        head_dim: per-head size.
        eager: the model family's eager attention function (for `_attn_implementation`
            "eager").
        extra_kwargs: keyword arguments the attention module passes to the attention function
            beyond dropout, scaling and the layer's own (e.g. sliding_window), as recorded by the
            probe.
        returns_tuple: whether the layer's forward returns (hidden_states,) rather than a
            tensor.
        cache_keyword: the name under which the layer takes its KV cache ("past_key_values";
            "cache" from transformers 5.24, whose caches also take the attention keywords).
    """

    pre: PreAttention
    post: PostAttention
    attn: Any
    head_dim: int
    eager: Callable[..., Any] | None
    extra_kwargs: dict[str, Any] = field(default_factory=dict)
    returns_tuple: bool = False
    cache_keyword: str = "past_key_values"


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


def _family_function(module: nn.Module, name: str) -> Callable[..., Any] | None:
    """A function of the module's modeling file (the one its forward calls by that name)."""
    fn = getattr(sys.modules.get(type(module).__module__), name, None)
    return fn if callable(fn) else None


def _structure(layer: nn.Module) -> LayerParts | str:
    """The layer's parts by attribute, or why it is not a recognised decoder layer."""
    need = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
    missing = [n for n in need if not isinstance(getattr(layer, n, None), nn.Module)]
    if missing:
        return f"no {', '.join(missing)}"
    attn: Any = layer.self_attn  # the family's attention module, read by attribute
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")
    bad = [n for n in projections if not is_projection(getattr(attn, n, nn.Identity()))]
    if bad:
        return f"its attention has no projection {', '.join(bad)} (fused or renamed q/k/v)"
    head_dim = getattr(attn, "head_dim", None)
    if not isinstance(head_dim, int) or not isinstance(getattr(attn, "scaling", None), float):
        return "its attention has no head_dim / scaling attributes"
    config = getattr(attn, "config", None)
    if not isinstance(getattr(config, "_attn_implementation", None), str):
        return "its attention has no config naming the attention implementation"
    mlp: nn.Module = layer.mlp  # type: ignore[assignment]
    if any(p.dim() > 2 for p in mlp.parameters()) or any(
        isinstance(m, nn.ModuleList) for m in mlp.modules()
    ):
        return "its MLP routes tokens to experts (mixture of experts)"
    rotary = _family_function(attn, "apply_rotary_pos_emb")
    if rotary is None:
        return "its attention's module has no apply_rotary_pos_emb (no rotary embedding)"
    params = inspect.signature(original_forward(layer)).parameters
    if "position_embeddings" not in params:
        return "its forward takes no position_embeddings"
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    pre = PreAttention(
        layer.input_layernorm,  # type: ignore[arg-type]
        attn.q_proj,
        attn.k_proj,
        attn.v_proj,
        q_norm if isinstance(q_norm, nn.Module) else None,
        k_norm if isinstance(k_norm, nn.Module) else None,
        rotary,
        head_dim,
    )
    post = PostAttention(attn.o_proj, layer.post_attention_layernorm, mlp)  # type: ignore[arg-type]
    parts = LayerParts(pre, post, attn, head_dim, _family_function(attn, "eager_attention_forward"))
    parts.cache_keyword = "cache" if "cache" in params else "past_key_values"
    return parts


def _attention_function(parts: LayerParts) -> Callable[..., Any]:
    """The attention function the attention module would call now (its config may have been
    switched, e.g. to sequence parallelism, since patching), as the attention backend resolves
    it (inside by_heads(): "sdpa" by head groups)."""
    name = parts.attn.config._attn_implementation
    if name == "eager":
        if parts.eager is None:
            raise ValueError(
                f"tiled_layers: {type(parts.attn).__name__} has no eager_attention_forward in "
                "its module; use attn_implementation='sdpa'"
            )
        return parts.eager
    return HF_ATTENTION.function(name)


def _layer_math(
    parts: LayerParts,
    run: Callable[..., Any],
    hidden_states: torch.Tensor,
    attention_mask: Any,
    position_ids: Any,
    use_cache: Any,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    kwargs: dict[str, Any],
    attention: Callable[..., Any] | None = None,
    past_key_values: Any = None,
) -> Any:
    """The layer's forward as the two blocks (each through `run(block, x, *extras)`) around the
    attention function."""
    batch, seq = hidden_states.shape[:2]
    cos, sin = position_embeddings
    cos = cos.expand(batch, seq, cos.shape[-1])
    sin = sin.expand(batch, seq, sin.shape[-1])
    q, k, v = run(parts.pre, hidden_states, cos, sin)
    shape = (batch, seq, -1, parts.head_dim)
    q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
    attn = parts.attn
    if past_key_values is not None:  # what the attention module does with a cache
        if parts.cache_keyword == "cache":
            seen = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}
            k, v = past_key_values.update(k, v, attn.layer_idx, kwargs=seen)
        else:
            k, v = past_key_values.update(k, v, attn.layer_idx)
    with by_heads():  # "sdpa" by head groups, also behind a sequence-parallel exchange
        fn = attention if attention is not None else _attention_function(parts)
        out, _ = fn(
            attn,
            q,
            k,
            v,
            attention_mask,
            dropout=attn.attention_dropout if attn.training else 0.0,
            scaling=attn.scaling,
            **parts.extra_kwargs,
            position_ids=position_ids,
            use_cache=use_cache,
            **kwargs,
        )
    out = out.reshape(batch, seq, -1).contiguous()
    y = run(parts.post, out, hidden_states)
    return (y,) if parts.returns_tuple else y


def _recording_attentions() -> bool:
    """Whether Hugging Face is recording attention weights (output_attentions=True): they come
    from hooks on the attention module, whose forward the tiled layer does not call."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # older transformers: layers return the weights themselves
        return False
    collected = _active_collector.get()
    return collected is not None and "attentions" in collected


def _checkpoints_in_forward(layer: nn.Module) -> bool:
    """Whether the layer's class checkpoints inside its `forward` (transformers 5 wraps each
    GradientCheckpointingLayer subclass's forward; 4.x checkpointed in `__call__`, which an
    instance forward stays inside of)."""
    forward = type(layer).forward
    return (
        hasattr(forward, "__wrapped__")
        and hasattr(layer, "_gradient_checkpointing_func")
        and "__call__" not in vars(_checkpointing_base(layer))
    )


def _checkpointing_base(layer: nn.Module) -> type:
    """The class that defines `gradient_checkpointing` (Hugging Face's GradientCheckpointingLayer)."""
    for cls in type(layer).__mro__:
        if "gradient_checkpointing" in vars(cls):
            return cls
    return type(layer)


def _unchecked_forward(layer: nn.Module) -> Callable[..., Any]:
    """The layer's original computation without the checkpointing its class may wrap around it
    (for calls made inside a checkpoint, and for the probe)."""
    if STATE not in layer.__dict__ or layer.__dict__[STATE].saved is None:
        inner = getattr(type(layer).forward, "__wrapped__", None)
        if inner is not None and _checkpoints_in_forward(layer):
            return inner.__get__(layer)  # type: ignore[no-any-return]
    return original_forward(layer)


def tiled_layer_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The forward installed on tiled decoder layers (bound with patching.bound.bind). Where
    the layer's class checkpoints inside its own forward (transformers 5), this replacement
    does the same around the tiled computation, with the same treatment of the cache
    arguments (a checkpointed layer neither reads nor writes a cache)."""
    checkpointed = getattr(self, "gradient_checkpointing", False) and self.training
    if checkpointed and _checkpoints_in_forward(self):
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if not getattr(self, "_can_checkpoint_with_cache", False):
            kwargs[self.__dict__[LAYER].cache_keyword] = None
        func: Any = self._gradient_checkpointing_func
        return func(functools.partial(_tiled_layer_call, self, **kwargs), *args)
    return _tiled_layer_call(self, *args, **kwargs)


def _tiled_layer_call(
    self: nn.Module,
    hidden_states: Any,
    attention_mask: Any = None,
    position_ids: Any = None,
    past_key_values: Any = None,
    use_cache: Any = False,
    position_embeddings: Any = None,
    **kwargs: Any,
) -> Any:
    """The layer's computation: the tiled blocks, or the original computation for calls they
    cannot take."""
    parts: LayerParts = self.__dict__[LAYER]
    state: PatchState = self.__dict__[STATE]
    if parts.cache_keyword != "past_key_values":  # the cache under the name the layer takes
        past_key_values = kwargs.pop(parts.cache_keyword, past_key_values)
    if (
        (
            past_key_values is not None
            and not isinstance(getattr(parts.attn, "layer_idx", None), int)
        )
        or not isinstance(position_embeddings, (tuple, list))
        or not isinstance(hidden_states, torch.Tensor)
        or hidden_states.dim() != 3
        or _recording_attentions()
    ):
        # Inside a checkpoint already (or not checkpointed): the class's own computation.
        return _unchecked_forward(self)(
            hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **{parts.cache_keyword: past_key_values},
            **kwargs,
        )
    run_checks(self)

    def run(block: nn.Module, x: torch.Tensor, *extras: torch.Tensor) -> Any:
        return tiled_mlp(
            block,
            x,
            *extras,
            num_tiles=state.config.policy,
            backend=backend_for(block),
            plan_tokens=state.step.value,
            count=state.count if block is parts.post else None,
        )

    return _layer_math(
        parts, run, hidden_states, attention_mask, position_ids, use_cache,
        tuple(position_embeddings), kwargs, None, past_key_values,
    )  # fmt: skip


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
        theta = torch.rand(1, _PROBE_TOKENS, parts.head_dim, generator=gen, device=device)
        cos, sin = (theta * 6.0).cos().to(dtype), (theta * 6.0).sin().to(dtype)
        positions = torch.arange(_PROBE_TOKENS, device=device)[None]
        try:
            ref = _unchecked_forward(layer)(
                x,
                attention_mask=None,
                position_ids=positions,
                use_cache=False,
                position_embeddings=(cos, sin),
                **{parts.cache_keyword: None},
            )
        except Exception as e:  # any failure means the layer is not called like Llama's
            return f"its forward cannot be called like a Llama decoder layer's ({_line(e)})"
        if len(_RECORDED.calls) != 1:
            return "its forward does not call the attention function exactly once"
        q_ref, k_ref, v_ref, recorded = _RECORDED.calls.pop()
        if recorded.get("scaling") != parts.attn.scaling:
            return "its attention passes a scaling other than its `scaling` attribute"
        if recorded.get("dropout") != getattr(parts.attn, "attention_dropout", None):
            return "its attention passes a dropout other than its `attention_dropout`"
        parts.extra_kwargs = {k: v for k, v in recorded.items() if k not in _OWN_KWARGS}
        parts.returns_tuple = isinstance(ref, tuple)
        if parts.returns_tuple and len(ref) != 1:
            return f"its forward returns {len(ref)} values"
        try:
            got = _layer_math(
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
                "rotary -> attention -> o_proj + residual -> norm -> MLP + residual"
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
