"""A recognised decoder layer as two token-wise blocks around its attention call.

A Llama-family decoder layer computes

    q, k, v = rotary(q_norm(q_proj(n1)), k_norm(k_proj(n1))), v_proj(n1),   n1 = norm1(x)
    a = attention(q, k, v)                                   (the attention core: mixes tokens)
    h = x + o_proj(a);   y = h + mlp(norm2(h))

Other families move the norms (`Norms`: after the attention and the MLP too, Gemma 2/3; on the
outputs only, OLMo 2/3; one norm for attention and MLP side by side, Cohere), fuse q/k/v
(Phi-3), gate the attention's output (Qwen3-Next), compress q/k/v (multi-head latent attention:
latent_attention.py), or route tokens to experts (the MoE block then runs whole between
the post-attention block and the last residual, so its router sees every token at once).
Everything but the attention core is token-wise (rotary given each token's cos/sin), so the
layer is `PreAttention` (x, cos, sin -> q, k, v), the attention function, and `PostAttention`
(a, x -> y). `layer_math` is that computation with a caller-chosen way of running each block
(tiled through the generic path by the tiled forward, plainly by the recognition probe); the
attention function is the one the model's config names, resolved through the attention backend
inside by_heads() (patching/attention_core.py: "sdpa" by head groups).

Invariant: the blocks hold the layer's own modules (unregistered: the layer's parameters,
buffers and state_dict are untouched), and layer_math computes what the layer's forward
computes, a KV cache updated with the rotated keys and the values as the attention module does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tiledmlp.ops.mlp.untiled import UntiledCall
from tiledmlp.patching.attention_core import by_heads
from tiledmlp.patching.hf_attention import HF_ATTENTION
from tiledmlp.patching.state import STATE, original_forward

__all__ = [
    "LayerParts",
    "Norms",
    "PostAttention",
    "PreAttention",
    "attention_function",
    "layer_math",
]


def call_untiled(module: nn.Module, *args: torch.Tensor) -> Any:
    """Calls `module` as the layer would, but never tiled again: a module patched by
    patch_model (a tiled MLP or norm) runs its original forward inside the block's tile."""
    if STATE in module.__dict__:
        return UntiledCall(module, original_forward(module))(*args)
    return module(*args)


class PreAttention(nn.Module):
    """x, cos, sin -> q, k, v: the layer's first norm (when present), the q/k/v projections
    (separate, or one fused projection split as q | k | v), the q/k norms (per head, or over
    the whole projection) and the rotary embedding, token by token.

    Holds the layer's own modules (it is not registered in the model: its parameters are the
    layer's). Inputs x (1 or batch, n, hidden), cos and sin (n, rotary_dim) or x's leading
    dims plus rotary_dim; outputs q (..., heads * head_dim), k and v (..., kv_heads * head_dim).
    """

    def __init__(
        self,
        norm: nn.Module | None,
        projections: tuple[nn.Module, ...],
        q_norm: nn.Module | None,
        k_norm: nn.Module | None,
        rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]],
        head_dim: int,
        *,
        q_size: int = 0,
        whole_qk_norm: bool = False,
        gated: bool = False,
    ) -> None:
        super().__init__()
        self.norm = norm
        self.projections = nn.ModuleList(projections)  # (q_proj, k_proj, v_proj) or (qkv_proj,)
        self.q_norm = q_norm
        self.k_norm = k_norm
        self.rotary = rotary
        self.head_dim = head_dim
        self.q_size = q_size  # a fused projection's query width
        self.whole_qk_norm = whole_qk_norm
        self.gated = gated  # q_proj gives each head's query and an output gate (Qwen3-Next)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[Any, ...]:
        lead = x.shape[:-1]
        normed = x if self.norm is None else call_untiled(self.norm, x)
        if len(self.projections) == 1:
            qkv = self.projections[0](normed)
            kv = (qkv.shape[-1] - self.q_size) // 2
            q, k, v = qkv.split([self.q_size, kv, kv], dim=-1)
        else:
            q, k, v = (p(normed) for p in self.projections)
        gate = None
        if self.gated:  # per head: the query, then the gate
            q, gate = q.view(*lead, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(*lead, -1)
        if self.whole_qk_norm:  # norms over the whole projection, before the split into heads
            q = q if self.q_norm is None else call_untiled(self.q_norm, q)
            k = k if self.k_norm is None else call_untiled(self.k_norm, k)
        q = q.reshape(*lead, -1, self.head_dim)
        k = k.reshape(*lead, -1, self.head_dim)
        if not self.whole_qk_norm:
            q = q if self.q_norm is None else call_untiled(self.q_norm, q)
            k = k if self.k_norm is None else call_untiled(self.k_norm, k)
        cos = cos.reshape(*lead, cos.shape[-1])
        sin = sin.reshape(*lead, sin.shape[-1])
        # The model's own rotary function, in its layout: (batch, heads, seq, head_dim).
        q, k = self.rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        qkv = (q.transpose(1, 2).reshape(*lead, -1), k.transpose(1, 2).reshape(*lead, -1), v)
        return qkv if gate is None else (*qkv, gate)


@dataclass(frozen=True)
class Norms:
    """Where a decoder layer's norms sit (None: no norm there).

    Attributes:
        attn_in: before the attention (Llama's input_layernorm).
        attn_out: on the attention's output, before its residual (Gemma 2/3, OLMo 2).
        mlp_in: before the MLP (Llama's post_attention_layernorm, Gemma's
            pre_feedforward_layernorm).
        mlp_out: on the MLP's output, before its residual (Gemma 2/3, OLMo 2).
        parallel: the attention and the MLP both read attn_in's output and are added to the
            input together (Cohere): y = x + attention + mlp(attn_in(x)).
    """

    attn_in: nn.Module | None
    attn_out: nn.Module | None = None
    mlp_in: nn.Module | None = None
    mlp_out: nn.Module | None = None
    parallel: bool = False


def _norm(norm: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else call_untiled(norm, x)  # type: ignore[no-any-return]


class PostAttention(nn.Module):
    """a, x -> y: the output projection, the norms around the MLP (Norms), the MLP and the
    residuals, token by token. Inputs a (1 or batch, n, heads * head_dim) and the layer input
    x (n, hidden) or a's leading dims plus hidden; output y like x with a's leading dims.

    With `mlp` None (a mixture of experts, run by layer_math outside the tiles: its router
    sees every token at once), the block stops before the MLP and returns (h, mlp_in(h)), h
    the residual stream after the attention.
    """

    def __init__(self, o_proj: nn.Module, norms: Norms, mlp: nn.Module | None) -> None:
        super().__init__()
        self.o_proj = o_proj
        self.norms = norms
        self.mlp = mlp
        # The norms this block calls, registered so the generic path sees their parameters as
        # the block's (and no others: the first norm belongs to PreAttention unless parallel).
        used: tuple[nn.Module | None, ...] = (norms.attn_out, norms.mlp_in, norms.mlp_out)
        used += (norms.attn_in,) if norms.parallel else ()
        self.norm_modules = nn.ModuleList(n for n in used if n is not None)

    def forward(
        self, attn: torch.Tensor, residual: torch.Tensor, gate: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        norms = self.norms
        residual = residual.reshape(*attn.shape[:-1], residual.shape[-1])
        if gate is not None:  # a gated attention's output gate (PreAttention.gated)
            attn = attn * torch.sigmoid(gate.reshape(attn.shape))
        out = _norm(norms.attn_out, self.o_proj(attn))
        if norms.parallel:
            assert self.mlp is not None  # recognition pairs a parallel block with a dense MLP
            return residual + out + call_untiled(self.mlp, _norm(norms.attn_in, residual))  # type: ignore[no-any-return]
        h = residual + out
        if self.mlp is None:
            return h, _norm(norms.mlp_in, h)
        return h + _norm(norms.mlp_out, call_untiled(self.mlp, _norm(norms.mlp_in, h)))


@dataclass
class LayerParts:
    """A recognised decoder layer: its two tiled blocks and how its attention is called.

    Attributes:
        pre: the pre-attention block (PreAttention, or LatentPreAttention of
            latent_attention.py).
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
        moe: the layer's mixture-of-experts block, called by layer_math between the
            post-attention block and the last residual (its router sees every token at once,
            so router logits and auxiliary losses are the model's own; its experts are tiled
            by the MLP patch); None for a dense MLP, which runs inside the post block.
        tensor_kwargs: keyword arguments of the attention call that are tensors of the
            attention module (e.g. attention sinks), by attribute name, read at each call.
        v_head_dim: per-head size of the values (0: head_dim).
        rotary_width: the rotary angles' width (0: head_dim; multi-head latent attention:
            its rotary part).
        latent: multi-head latent attention (latent_attention.py), whose KV cache
            holds the latents: a call with a cache runs the layer's own forward.
    """

    pre: nn.Module
    post: PostAttention
    attn: Any
    head_dim: int
    eager: Callable[..., Any] | None
    extra_kwargs: dict[str, Any] = field(default_factory=dict)
    returns_tuple: bool = False
    cache_keyword: str = "past_key_values"
    moe: nn.Module | None = None
    tensor_kwargs: dict[str, str] = field(default_factory=dict)
    v_head_dim: int = 0
    rotary_width: int = 0
    latent: bool = False


def attention_function(parts: LayerParts) -> Callable[..., Any]:
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


def layer_math(
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
    q, k, v, *gate = run(parts.pre, hidden_states, cos, sin)
    q, k = (t.view(batch, seq, -1, parts.head_dim).transpose(1, 2) for t in (q, k))
    v = v.view(batch, seq, -1, parts.v_head_dim or parts.head_dim).transpose(1, 2)
    attn = parts.attn
    if past_key_values is not None:  # what the attention module does with a cache
        if parts.cache_keyword == "cache":
            seen = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}
            k, v = past_key_values.update(k, v, attn.layer_idx, kwargs=seen)
        else:
            k, v = past_key_values.update(k, v, attn.layer_idx)
    with by_heads():  # "sdpa" by head groups, also behind a sequence-parallel exchange
        fn = attention if attention is not None else attention_function(parts)
        out, _ = fn(
            attn,
            q,
            k,
            v,
            attention_mask,
            dropout=attn.attention_dropout if attn.training else 0.0,
            scaling=attn.scaling,
            **parts.extra_kwargs,
            **{k: getattr(attn, name) for k, name in parts.tensor_kwargs.items()},
            position_ids=position_ids,
            use_cache=use_cache,
            **kwargs,
        )
    out = out.reshape(batch, seq, -1).contiguous()
    y = run(parts.post, out, hidden_states, *gate)
    if parts.moe is not None:  # (h, mlp_in(h)) -> h + mlp_out(experts(mlp_in(h)))
        h, normed = y
        mixed = parts.moe(normed)
        mixed = mixed[0] if isinstance(mixed, tuple) else mixed  # some return router scores too
        y = h + _norm(parts.post.norms.mlp_out, mixed)
    return (y,) if parts.returns_tuple else y
