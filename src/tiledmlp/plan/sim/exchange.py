"""The attention of one GPU under Ulysses sequence parallelism, as the planner simulates it.

The planner runs one GPU's step at seq_len / P tokens with every head. Outside attention that
holds what the GPU holds; inside, a GPU attends over the whole sequence with heads / P, the same
number of elements, but a kernel's buffers and the attention core's per-call temporaries
(patching/attention_core.py: one head group's output and gradients, a key/value head's float32
dk and dv) scale with the sequence a call sees. So under P > 1 the planner's model attends
through `exchanged_attention(P)`: q, k and v are seen as (batch, heads / P, tokens x P,
head_dim) views of their own storage (no copy: the exchange's own buffers are counted apart, as
"all_to_all"), the attention function the layer would call on whole sequences ("sdpa", by heads
inside a tiled layer) runs on them, and its output is seen back as (batch, tokens, heads,
head_dim). Values are meaningless (the planner runs on fake tensors); shapes and storage are
those of the GPU's attention.

Invariant: no storage is created besides what the attention function creates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tiledmlp.sequence_parallel.attention import kv_repeat
from tiledmlp.sequence_parallel.install import set_implementation

__all__ = ["exchanged_attention", "register_exchanged"]


def _whole(t: torch.Tensor, p: int) -> torch.Tensor:
    """(batch, heads, tokens, d) seen as (batch, heads / p, tokens x p, d), a view if t's
    storage is laid out (batch, heads, tokens, d) or (batch, tokens, heads, d)."""
    b, h, n, d = t.shape
    if t.is_contiguous():
        return t.view(b, h // p, n * p, d)
    swapped = t.transpose(1, 2)
    if swapped.is_contiguous():
        return swapped.view(b, n * p, h // p, d).transpose(1, 2)
    return t.reshape(b, h // p, n * p, d)


def exchanged_attention(p: int, attend: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
    """An attention function with transformers' signature that runs `attend()` (looked up at
    each call) on one GPU's whole-sequence shapes under P = p (module docstring)."""

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        b, h, n, d = query.shape
        repeat = kv_repeat(h, key.shape[1], p)
        if repeat > 1:  # fewer key/value heads than GPUs: each GPU gets one, repeated (a copy)
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
        out, weights = attend()(
            module, _whole(query, p), _whole(key, p), _whole(value, p), attention_mask, **kwargs
        )
        return out.reshape(b, n, h, d), weights

    return attention


def register_exchanged(p: int, model: Any) -> None:
    """Points the (fake) model's attention at exchanged_attention(p) around "sdpa", through
    transformers' AttentionInterface; the attention backend resolves "sdpa" at each call (by
    heads inside a tiled decoder layer)."""
    from transformers.modeling_utils import AttentionInterface

    from tiledmlp.patching.hf_attention import HF_ATTENTION

    name = f"tiledmlp_plan_exchange_{p}"
    AttentionInterface.register(name, exchanged_attention(p, lambda: HF_ATTENTION.function("sdpa")))
    set_implementation(model.config.get_text_config(), name)
