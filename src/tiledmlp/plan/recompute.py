"""The FLOPs a training step spends, and what checkpointing only every N-th layer saves.

A non-reentrant checkpoint recomputes a layer's forward in its backward only until every tensor
the backward needs is rebuilt (torch.utils.checkpoint stops early). Which matmuls that reruns
depends on the stack (counted with FlopCounterMode on real steps:
tests/plan/test_recompute_flops.py):

- untiled: the attention's projections (q, k, v, o), its core, and the MLP's first projection(s)
  (gate and up; the down projection's output is needed by nothing the backward saved);
- a tiled MLP (the tiled_mlp* stacks): the projections and the core only; the tiled MLP
  recomputes its first projections in its own backward whether or not its layer is
  checkpointed, so that cost is the same either way;
- tiled layers: q, k, v and the core; the tiled blocks recompute the rest (o and the whole MLP)
  in their own backward, checkpointed or not.

A step's matmul FLOPs are the forward's (T tokens, hidden h, attention widths q and kv, MLP
intermediate m with 3 matrices gated, 2 plain, vocabulary V): per layer 2T*h*(q + 2kv) +
2T*q*h (projections), 2T^2*q (the causal attention core: half of QK^T and PV) and 2T*h*m per
MLP matrix; the head 2T*h*V. The backward is twice the forward; the recompute of each
checkpointed layer and the stack's own recomputes are added. Mixture-of-experts MLPs are counted
as one dense MLP of the config's intermediate size.

Invariant: the ratio is of FLOPs, not of measured time: with every layer checkpointed it is 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiledmlp.config.patch import PatchConfig

__all__ = ["LayerFlops", "checkpointing_flop_ratio", "layer_flops", "step_flops"]


# model types whose MLP is two matrices (up, down) without a gate
_PLAIN_MLP = ("gpt2", "gpt_neox", "gpt_bigcode", "starcoder2", "phi", "falcon", "opt", "bloom")


@dataclass(frozen=True)
class LayerFlops:
    """One forward's matmul FLOPs of a decoder layer's parts and of the head, at T tokens."""

    qkv: int
    o: int
    attention: int
    mlp_in: int  # the MLP's first projection(s): gate and up, or up
    mlp_out: int  # the down projection
    head: int


def layer_flops(config: Any, tokens: int, *, attention: bool = True) -> LayerFlops:
    """The forward FLOPs of one of `config`'s decoder layers and its head at `tokens` tokens
    (module docstring); `attention=False` leaves the attention core out (what FlopCounterMode
    sees of SDPA on the CPU: nothing)."""
    text = config.get_text_config()
    h = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or h // heads)
    q, kv = heads * head_dim, kv_heads * head_dim
    m = int(getattr(text, "intermediate_size", None) or 4 * h)
    gated = getattr(text, "model_type", "") not in _PLAIN_MLP
    t = tokens
    return LayerFlops(
        qkv=2 * t * h * (q + 2 * kv),
        o=2 * t * q * h,
        attention=2 * t * t * q if attention else 0,
        mlp_in=(2 if gated else 1) * 2 * t * h * m,
        mlp_out=2 * t * h * m,
        head=2 * t * h * int(text.vocab_size),
    )


def _kind(patch: PatchConfig | None) -> str:
    if patch is None or not (patch.tiled_mlp or patch.tiled_layers):
        return "untiled"
    return "tiled_layer" if patch.tiled_layers else "tiled_mlp"


def step_flops(f: LayerFlops, layers: int, patch: PatchConfig | None, checkpointed: int) -> int:
    """The matmul FLOPs of one training step of `layers` layers of `f` with `patch`'s features
    (None: untiled), `checkpointed` of its layers checkpointed (module docstring)."""
    kind = _kind(patch)
    layer = f.qkv + f.o + f.attention + f.mlp_in + f.mlp_out
    base = 3 * (layers * layer + f.head)
    if kind == "untiled":
        again = f.qkv + f.o + f.attention + f.mlp_in
    elif kind == "tiled_mlp":
        base += layers * f.mlp_in  # the tiled MLP's own recompute
        again = f.qkv + f.o + f.attention
    else:
        base += layers * (f.qkv + f.o + f.mlp_in + f.mlp_out)  # the tiled blocks' own
        again = f.qkv + f.attention
    return base + checkpointed * again


def checkpointing_flop_ratio(
    config: Any, tokens: int, patch: PatchConfig | None, every_n_layers: int
) -> float:
    """The step's FLOPs with every `every_n_layers`-th layer checkpointed over its FLOPs with
    every layer checkpointed (at most 1)."""
    f = layer_flops(config, tokens)
    layers = int(config.get_text_config().num_hidden_layers)
    few = step_flops(f, layers, patch, len(range(0, layers, every_n_layers)))
    return few / step_flops(f, layers, patch, layers)
