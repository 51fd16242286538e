"""Hugging Face transformers' attention interface, as sequence parallelism uses it.

The Ulysses wrapper (sequence_parallel/) imports torch only; this module is its attention
backend (sequence_parallel/attention_backend.py): a new attention implementation is registered
with transformers' AttentionInterface (and its mask function with AttentionMaskInterface), the
model's own implementation is found in ALL_ATTENTION_FUNCTIONS, and the decoder's config is
detect.text_config's. tiledmlp/registrations.py declares it.

Invariant: transformers is imported only when sequence parallelism registers or calls an
attention function (by then the model is a transformers model); importing this module does not
import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tiledmlp.patching.attention_core import BY_HEADS, active, sdpa_by_heads
from tiledmlp.patching.detect import text_config
from tiledmlp.sequence_parallel.attention_backend import AttentionBackend

__all__ = ["HF_ATTENTION"]


def _register(name: str, attention: Callable[..., Any], mask: Callable[..., Any]) -> None:
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, mask)


def _function(name: str) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == BY_HEADS and active():  # inside a tiled decoder layer (attention_core.py)
        return sdpa_by_heads
    return ALL_ATTENTION_FUNCTIONS[name]


HF_ATTENTION = AttentionBackend(register=_register, function=_function, text_config=text_config)
