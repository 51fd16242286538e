"""The pre-attention block of a multi-head-latent-attention layer (DeepSeek-V2/V3 and alike).

Multi-head latent attention compresses the keys and values of a token into one latent vector
and the query into another (or projects it directly), then expands them per head:

    q = q_b_proj(q_a_layernorm(q_a_proj(n1)))  (or q_proj(n1)),  per head [q_nope | q_rope]
    [c | k_rope] = kv_a_proj_with_mqa(n1),   [k_nope | v] = kv_b_proj(kv_a_layernorm(c))
    q = [q_nope | rotary(q_rope)],   k = [k_nope | rotary(k_rope) (one for every head)]

All of it is token-wise, so `LatentPreAttention` (x, cos, sin -> q, k, v) takes the place of
PreAttention (blocks.py) in front of the attention call.

Invariant: the block holds the attention module's own submodules (unregistered in the model),
reads the head sizes from the attention module, and computes the q, k and v the attention
module passes to its attention function (checked by the layer probe, recognise.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tiledmlp.patching.features.tiled_layers.blocks import call_untiled

__all__ = ["LatentPreAttention", "is_latent"]

_PARTS = ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")


def is_latent(attn: Any) -> bool:
    """Whether the attention module is multi-head latent attention by its attributes."""
    sizes = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank", "num_heads")
    return all(isinstance(getattr(attn, n, None), nn.Module) for n in _PARTS) and all(
        isinstance(getattr(attn, n, None), int) for n in sizes
    )


class LatentPreAttention(nn.Module):
    """x, cos, sin -> q, k, v of a multi-head-latent-attention layer (module docstring).

    Inputs x (1 or batch, n, hidden), cos and sin (n, rope_dim) or x's leading dims plus
    rope_dim; outputs q and k
    (..., heads * (nope + rope)), v (..., heads * v_head_dim).
    """

    def __init__(
        self,
        norm: nn.Module | None,
        attn: Any,
        rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        super().__init__()
        self.norm = norm
        self.q_proj = attn.q_proj if isinstance(attn.q_proj, nn.Module) else None
        self.q_a_proj = attn.q_a_proj if self.q_proj is None else None
        self.q_a_layernorm = attn.q_a_layernorm if self.q_proj is None else None
        self.q_b_proj = attn.q_b_proj if self.q_proj is None else None
        self.kv_a_proj_with_mqa = attn.kv_a_proj_with_mqa
        self.kv_a_layernorm = attn.kv_a_layernorm
        self.kv_b_proj = attn.kv_b_proj
        self.rotary = rotary
        self.heads = int(attn.num_heads)
        self.nope = int(attn.qk_nope_head_dim)
        self.rope = int(attn.qk_rope_head_dim)
        self.v_dim = int(attn.v_head_dim)
        self.rank = int(attn.kv_lora_rank)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch, seq = x.shape[:2]
        normed = x if self.norm is None else call_untiled(self.norm, x)
        if self.q_proj is not None:
            q = self.q_proj(normed)
        else:
            assert self.q_a_proj is not None and self.q_b_proj is not None
            assert self.q_a_layernorm is not None  # the compressed query's three parts
            q = self.q_b_proj(call_untiled(self.q_a_layernorm, self.q_a_proj(normed)))
        q = q.view(batch, seq, -1, self.nope + self.rope).transpose(1, 2)
        q_pass, q_rot = q.split([self.nope, self.rope], dim=-1)
        kv_nope, k_rot = self.kv_a_proj_with_mqa(normed).split([self.rank, self.rope], dim=-1)
        kv_nope = call_untiled(self.kv_a_layernorm, kv_nope)
        k_rot = k_rot.view(batch, 1, seq, self.rope)  # one rotary key for every head
        cos = cos.reshape(batch, seq, cos.shape[-1])  # a tile may hand them over flattened
        sin = sin.reshape(batch, seq, sin.shape[-1])
        # The model's own rotary function, in its layout: (batch, heads, seq, rope_dim).
        q_rot, k_rot = self.rotary(q_rot, k_rot, cos, sin)
        q = torch.cat((q_pass, q_rot), dim=-1)
        kv = self.kv_b_proj(kv_nope).view(batch, seq, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        return tuple(t.transpose(1, 2).reshape(batch, seq, -1) for t in (q, k, v))  # type: ignore[return-value]
