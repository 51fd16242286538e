"""A tiled decoder layer's attention core by head groups: transformers' "sdpa" with the fused
kernel's backward buffers sized for a few heads (ops/attention/heads.py).

`sdpa_by_heads` takes the arguments of transformers' attention functions. A call it can take
(no mask, no dropout, causal, query length equal to key length, no position bias, soft-capping
or paged cache, a fused kernel that SDPA would select and that passed its self-check on this
device, dtype and head size: ops/attention/select.py) runs `causal_attention_by_heads` through
that kernel in `head_groups(...)` groups (ops/attention/select.py: by_heads_plan); any other
call, or one that would be a single group, goes to transformers' own sdpa function unchanged.
`by_heads()` is the context in which a tiled decoder layer calls its attention: inside it,
"sdpa" looked up through the attention backend (what the Ulysses wrapper calls after its
exchange) is `sdpa_by_heads`.

Invariant: sdpa_by_heads returns what transformers' sdpa_attention_forward returns for the same
call, (batch, tokens, heads, head_dim) and None, up to the kernels' summation order.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from tiledmlp.ops.attention.heads import causal_attention_by_heads, unsupported
from tiledmlp.ops.attention.kernels import FusedKernel, default_kernel
from tiledmlp.ops.attention.select import by_heads_plan, call_groups

__all__ = ["BY_HEADS", "active", "by_heads", "plan_for", "sdpa_by_heads"]

_ACTIVE = contextvars.ContextVar("tiledmlp_attention_by_heads", default=False)
BY_HEADS = "sdpa"  # the attention implementation run by head groups


@contextlib.contextmanager
def by_heads() -> Iterator[None]:
    """Within: "sdpa" resolves to sdpa_by_heads through the attention backend (in a graph
    torch.compile traces, nothing changes: See Note [The attention plan under torch.compile])."""
    if torch.compiler.is_compiling():  # dynamo cannot set a context variable
        yield
        return
    token = _ACTIVE.set(True)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    """Whether the calling code runs inside by_heads() (never in a traced graph)."""
    return not torch.compiler.is_compiling() and _ACTIVE.get()


def _hf_sdpa() -> Callable[..., Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward  # type: ignore[no-any-return]


# Note [The attention plan under torch.compile]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The plan asks torch which kernel SDPA would select (an int dynamo does not trace) and
# self-checks a kernel by running it once per device, dtype and head size: neither can be
# traced, and a graph torch.compile traces holds fake tensors that the planner's branch would
# take for its own. So in a traced graph by_heads() changes nothing and "sdpa" is transformers'
# sdpa, one call the compiler lowers itself: the layer stays one graph, exact, with SDPA's own
# backward buffers (where eager runs by heads, CUDA at long sequences, those are larger). The
# core itself traces group by group (tests/ops/test_library.py), should a traceable plan ever
# reach it.


def plan_for(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float,
    kwargs: dict[str, Any],
) -> tuple[int, FusedKernel | None]:
    """The head groups and the kernel this call runs in by heads; (1, None) when it runs as
    transformers' sdpa."""
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    if (
        attention_mask is not None
        or dropout
        or not is_causal
        or query.shape[2] < 2
        or any(kwargs.get(k) is not None for k in ("position_bias", "softcap", "cache"))
        or kwargs.get("output_attentions")
        or unsupported(query, key, value) is not None
        or torch.compiler.is_compiling()  # See Note [The attention plan under torch.compile]
    ):
        return 1, None

    # On fake tensors (the planner) the op is planned with the device type's flash kernel, as
    # it runs on the device it stands for; elsewhere with the kernel SDPA would select that
    # passed its self-check (a call that stays one group checks nothing).
    if is_fake(query):
        kernel = default_kernel(query.device)
        n = call_groups(kernel, query, key)
        return (1, None) if n == 1 else (n, kernel)
    return by_heads_plan(query, key, value)


def sdpa_by_heads(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, by head groups where the call allows (module docstring).

    Args:
        module: the attention module (its is_causal).
        query: (batch, heads, tokens, head_dim).
        key, value: (batch, kv_heads, tokens, head_dim).
        attention_mask: None for the grouped path.
        dropout: the attention dropout probability (0 for the grouped path).
        scaling: the softmax scale; None: head_dim ** -0.5.
        **kwargs: what the layer passes on (is_causal, position_ids, sliding_window, ...).

    Returns:
        (batch, tokens, heads, head_dim) and None, as transformers' sdpa_attention_forward.
    """
    groups, kernel = plan_for(module, query, key, value, attention_mask, dropout, kwargs)
    if kernel is None:
        return _hf_sdpa()(  # type: ignore[no-any-return]
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = query.shape[3] ** -0.5 if scaling is None else scaling
    return causal_attention_by_heads(query, key, value, scale, groups, kernel), None
