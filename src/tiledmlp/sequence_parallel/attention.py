"""Ulysses attention: the exchange around the model's own attention function.

With SP of size P each rank holds seq/P tokens of every sequence. Everything but attention is
per token and runs on the local tokens as usual. Around attention, an all-to-all turns
(local tokens, all heads) into (all tokens, heads/P); the model's own attention function (sdpa or
flash attention, found through the attention backend: sequence_parallel/attention_backend.py)
runs on whole sequences with the masks of sequence_parallel/masks.py; a second all-to-all turns
the result back. sequence_parallel/install.py points a model's configs at it.

Invariant: each rank's attention output equals, for its tokens, the output of the original
attention function on the whole (unsplit) sequences; every check that depends on local data
either runs before any collective or runs on data all ranks of the group have gathered, so a
bad input raises on every rank instead of deadlocking one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tiledmlp.sequence_parallel.all_to_all import heads_to_sequence, sequence_to_heads
from tiledmlp.sequence_parallel.attention_backend import attention_backend
from tiledmlp.sequence_parallel.collectives import guarded
from tiledmlp.sequence_parallel.groups import SequenceParallelGroups
from tiledmlp.sequence_parallel.masks import FullPositions, ulysses_error

__all__ = ["SUPPORTED_ATTENTION", "UlyssesAttention", "kv_repeat"]

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")
_FLASH_PREPARED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


class _LocalHeads:
    """The attention module as the original function sees it, with num_key_value_groups set to
    the local ratio of query to key/value heads (Hugging Face's sdpa repeats K/V by it); every
    other attribute is the module's own."""

    def __init__(self, module: nn.Module, groups: int) -> None:
        self.__dict__["_module"] = module
        self.__dict__["num_key_value_groups"] = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)


class UlyssesAttention:
    """The attention function registered for one (SP group, original implementation) pair.

    Called by Hugging Face attention modules as
    fn(module, query, key, value, attention_mask, dropout=..., scaling=..., **kwargs) with
    query (batch, heads, seq/P, head_dim), key/value (batch, kv_heads, seq/P, head_dim) and
    kwargs["position_ids"] (batch or 1, seq/P); returns (output (batch, seq/P, heads, head_dim),
    None), the layout of Hugging Face's attention functions.

    Cost per layer: 3 all-to-alls of the local q, k, v and 1 of the output (each moves (P-1)/P
    of the tensor); the original attention on (batch, heads/P, seq) at 1/P of the unsplit FLOPs;
    for packed documents on sdpa, a boolean (batch, 1, seq, seq) mask. Once per forward (cached
    on the position_ids tensor), 2 all-gathers of the position ids.
    """

    def __init__(self, groups: SequenceParallelGroups, original: str) -> None:
        self.groups = groups
        self.original = original
        self._cached: FullPositions | None = None

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        p = self.groups.sp_size
        batch, heads, local, _ = query.shape
        kv_heads = key.shape[1]
        self._check_local(module, query, key, attention_mask, kwargs)
        repeat = kv_repeat(heads, kv_heads, p)
        full = self._positions(kwargs["position_ids"], batch, local)
        kwargs = dict(kwargs, position_ids=full.positions)
        window = kwargs.get("sliding_window")
        if self.original == "sdpa":
            attention_mask = full.sdpa_mask(window)
        elif full.packed and batch > 1:
            # Hugging Face's flash path derives cu_seqlens from position_ids for batch 1 only.
            raise ulysses_error(
                f"packed documents with flash attention need batch size 1, got {batch}; put "
                "all documents in one row (batch 1) or use attn_implementation='sdpa'"
            )
        if repeat > 1:
            # KV head h serves query heads [h*G, (h+1)*G), G = heads / kv_heads: repeated in
            # place, rank r receives KV head r // repeat, the one its query heads use.
            key = key.repeat_interleave(repeat, dim=1)
            value = value.repeat_interleave(repeat, dim=1)
        group = self.groups.sp_group
        if p == 1:
            q, k, v = query, key, value
        else:
            q = sequence_to_heads(query, group)
            k = sequence_to_heads(key, group)
            v = sequence_to_heads(value, group)
        local_ratio = q.shape[1] // k.shape[1]
        seen: Any = module
        if getattr(module, "num_key_value_groups", local_ratio) != local_ratio:
            seen = _LocalHeads(module, local_ratio)
        attend = attention_backend().function(self.original)
        out, _ = attend(seen, q, k, v, attention_mask, **kwargs)
        return (out if p == 1 else heads_to_sequence(out, group)), None

    def _check_local(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        attention_mask: Any,
        kwargs: dict[str, Any],
    ) -> None:
        """Checks that need no other rank (the model and this rank's inputs), before any
        collective."""
        if kwargs.get("position_ids") is None:
            raise ulysses_error(
                f"{type(module).__name__} called attention without position_ids: the wrapper "
                "needs them for the causal mask and for the ranks' token offsets; pass the "
                "position_ids from tiledmlp.sequence_parallel.shard_batch to the model (this "
                "model family must also hand them on to its attention)"
            )
        if attention_mask is not None:
            raise ulysses_error(
                f"got an attention mask of shape {tuple(attention_mask.shape)}; a prepared mask "
                "covers local tokens only and cannot be split across ranks: drop attention_mask "
                "and pass position_ids (packed documents restart at 0)"
            )
        if key.shape[2] != query.shape[2]:
            raise ulysses_error(
                f"keys cover {key.shape[2]} positions, queries {query.shape[2]}: generation with "
                "a KV cache and cross-attention are not supported; call the model with "
                "use_cache=False, or remove() sequence parallelism to generate"
            )
        if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
            raise ulysses_error(
                f"{type(module).__name__} is not causal; only causal self-attention is supported"
            )
        prepared = [name for name in _FLASH_PREPARED if kwargs.get(name) is not None]
        if prepared:
            raise ulysses_error(
                f"got {', '.join(prepared)}, computed from local tokens; pass position_ids "
                "instead (the wrapper derives document boundaries from the gathered ones)"
            )
        positions = kwargs["position_ids"]
        if positions.dim() != 2 or positions.shape[-1] != query.shape[2]:
            raise ulysses_error(
                f"position_ids of shape {tuple(positions.shape)} do not match the "
                f"{query.shape[2]} local tokens; expected (batch, {query.shape[2]})"
            )

    def _positions(self, given: torch.Tensor, batch: int, tokens: int) -> FullPositions:
        """The SP group's position ids for this rank's (batch or 1, seq/P) position_ids.

        Gathered once per forward: every layer (and a checkpointed layer's recompute) receives
        the same position_ids tensor, so the result is cached on that tensor's identity and
        version, and the cache is dropped when the model's next forward starts (a rank must
        never skip a gather that another rank runs).
        """
        cached = self._cached
        if (
            cached is not None
            and cached.given is given
            and cached.version == given._version
            and cached.positions.shape[0] == batch
        ):
            return cached
        group = self.groups.sp_group
        p = self.groups.sp_size
        local = given.expand(batch, -1).contiguous()
        if p == 1:
            positions = local
        else:
            header = torch.tensor([batch, tokens], device=local.device, dtype=torch.long)
            headers = [torch.empty_like(header) for _ in range(p)]
            with guarded("the sequence-parallel position-id gather", group):
                dist.all_gather(headers, header, group=group)
            shapes = [tuple(int(v) for v in h.tolist()) for h in headers]
            if len(set(shapes)) != 1:
                # Every rank gathered the same shapes, so every rank raises here.
                raise ulysses_error(
                    "the ranks of a sequence-parallel group hold different (batch, local "
                    f"tokens): {shapes} in rank order; every rank must hold seq/P tokens of the "
                    "same batch: build each rank's inputs with shard_batch from the same full "
                    "batch, with seq divisible by P"
                )
            parts = [torch.empty_like(local) for _ in range(p)]
            with guarded("the sequence-parallel position-id gather", group):
                dist.all_gather(parts, local, group=group)
            positions = torch.cat(parts, dim=1)
        self._cached = FullPositions(given, given._version, positions)
        return self._cached

    def forget(self) -> None:
        """Drops the cached position ids (at the start of each model forward)."""
        self._cached = None


def kv_repeat(heads: int, kv_heads: int, p: int) -> int:
    """How many times each KV head is repeated before the all-to-all: 1 when kv_heads % P == 0,
    P / kv_heads when kv_heads divides P.

    Raises:
        ValueError: the query heads are not divisible by P, or the KV heads neither divisible
            by P nor dividing it.
    """
    if heads % p != 0:
        raise ulysses_error(
            f"the {heads} query heads must be divisible by the sequence-parallel size {p}; "
            f"choose a sequence_parallel_size that divides {heads}"
        )
    if kv_heads % p == 0:
        return 1
    if p % kv_heads == 0:
        return p // kv_heads
    raise ulysses_error(
        f"{kv_heads} key/value heads can neither be split over nor repeated to the "
        f"sequence-parallel size {p}; choose a sequence_parallel_size that divides or is a "
        f"multiple of {kv_heads}"
    )
