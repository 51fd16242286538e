"""Ulysses sequence parallelism for Hugging Face decoder models, through the attention interface.

With SP of size P each rank holds seq/P tokens of every sequence. Everything but attention is
per token and runs on the local tokens as usual. Around attention, an all-to-all turns
(local tokens, all heads) into (all tokens, heads/P); the model's own attention function (sdpa or
flash attention) runs on whole sequences; a second all-to-all turns the result back.

`install` points the decoder's config(s) at an attention function registered with Hugging
Face's AttentionInterface (and a mask function registered with AttentionMaskInterface that makes
the model build no mask): every attention module calls it through
ALL_ATTENTION_FUNCTIONS[config._attn_implementation], whatever engine (DDP, FSDP, DeepSpeed)
wraps the model. Causal masking comes from the position ids, gathered over the SP group: a
document starts at column 0 and wherever a position is not the previous one plus 1 (Hugging
Face's own rule for packed sequences on sdpa), so packed documents never attend to each other.

Invariant: each rank's attention output equals, for its tokens, the output of the original
attention function on the whole (unsplit) sequences; every check that depends on local data
either runs before any collective or runs on data all ranks of the group have gathered, so a
bad input raises on every rank instead of deadlocking one. Nothing on the model's modules or
state_dict changes; `remove` restores the original implementation names.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tiledmlp.sequence_parallel.all_to_all import heads_to_sequence, sequence_to_heads
from tiledmlp.sequence_parallel.collectives import guarded
from tiledmlp.sequence_parallel.groups import SequenceParallelGroups
from tiledmlp.sequence_parallel.model_loss import exact_output, refuse_unshifted_labels

__all__ = ["SUPPORTED_ATTENTION", "UlyssesAttention", "UlyssesReport", "install", "remove"]

logger = logging.getLogger(__name__)

SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")
_NAME = "tiledmlp_ulysses"
_STATE = "_tiledmlp_sequence_parallel"
_FLASH_PREPARED = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _error(what: str) -> ValueError:
    return ValueError(f"tiledmlp: sequence parallelism (Ulysses): {what}")


@dataclass(frozen=True)
class UlyssesReport:
    """What install did.

    Attributes:
        attn_implementation: the registered name the switched configs now carry.
        original: the attention implementation the wrapper calls on whole sequences.
        configs: class names of the configs switched (the decoder's text config and copies of
            it held by sub-models).
        checked: class names of the modules whose inputs are checked on every forward (missing
            position_ids, padding masks).
    """

    attn_implementation: str
    original: str
    configs: tuple[str, ...]
    checked: tuple[str, ...]


@dataclass
class _Installed:
    """Kept on the model (in its __dict__) between install and remove."""

    name: str
    originals: list[tuple[Any, Any]]  # (config, its original _attn_implementation)
    groups: SequenceParallelGroups | None = None


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
        self._cached: _FullPositions | None = None

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

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
            raise _error(
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
        out, _ = ALL_ATTENTION_FUNCTIONS[self.original](seen, q, k, v, attention_mask, **kwargs)
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
            raise _error(
                f"{type(module).__name__} called attention without position_ids: the wrapper "
                "needs them for the causal mask and for the ranks' token offsets; pass the "
                "position_ids from tiledmlp.sequence_parallel.shard_batch to the model (this "
                "model family must also hand them on to its attention)"
            )
        if attention_mask is not None:
            raise _error(
                f"got an attention mask of shape {tuple(attention_mask.shape)}; a prepared mask "
                "covers local tokens only and cannot be split across ranks: drop attention_mask "
                "and pass position_ids (packed documents restart at 0)"
            )
        if key.shape[2] != query.shape[2]:
            raise _error(
                f"keys cover {key.shape[2]} positions, queries {query.shape[2]}: generation with "
                "a KV cache and cross-attention are not supported; call the model with "
                "use_cache=False, or remove() sequence parallelism to generate"
            )
        if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
            raise _error(
                f"{type(module).__name__} is not causal; only causal self-attention is supported"
            )
        prepared = [name for name in _FLASH_PREPARED if kwargs.get(name) is not None]
        if prepared:
            raise _error(
                f"got {', '.join(prepared)}, computed from local tokens; pass position_ids "
                "instead (the wrapper derives document boundaries from the gathered ones)"
            )
        positions = kwargs["position_ids"]
        if positions.dim() != 2 or positions.shape[-1] != query.shape[2]:
            raise _error(
                f"position_ids of shape {tuple(positions.shape)} do not match the "
                f"{query.shape[2]} local tokens; expected (batch, {query.shape[2]})"
            )

    def _positions(self, given: torch.Tensor, batch: int, tokens: int) -> _FullPositions:
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
                raise _error(
                    "the ranks of a sequence-parallel group hold different (batch, local "
                    f"tokens): {shapes} in rank order; every rank must hold seq/P tokens of the "
                    "same batch: build each rank's inputs with shard_batch from the same full "
                    "batch, with seq divisible by P"
                )
            parts = [torch.empty_like(local) for _ in range(p)]
            with guarded("the sequence-parallel position-id gather", group):
                dist.all_gather(parts, local, group=group)
            positions = torch.cat(parts, dim=1)
        self._cached = _FullPositions(given, given._version, positions)
        return self._cached

    def forget(self) -> None:
        """Drops the cached position ids (at the start of each model forward)."""
        self._cached = None


class _FullPositions:
    """Whole-sequence position ids (batch, seq) and what the masks need from them."""

    def __init__(self, given: torch.Tensor, version: int, positions: torch.Tensor) -> None:
        self.given = given
        self.version = version
        self.positions = positions
        self.starts = _document_starts(positions)
        self.packed = bool(self.starts.any())  # one host sync per forward
        self._masks: dict[int | None, torch.Tensor | None] = {}

    def sdpa_mask(self, window: Any) -> torch.Tensor | None:
        """None (plain causal: sdpa's is_causal) for one document per row and no effective
        sliding window, else the boolean (batch, 1, seq, seq) mask; one per window size."""
        seq = self.positions.shape[1]
        key = window if isinstance(window, int) and 0 < window < seq else None
        if key not in self._masks:
            needed = self.packed or key is not None
            self._masks[key] = _causal_documents_mask(self.starts, key) if needed else None
        return self._masks[key]


def kv_repeat(heads: int, kv_heads: int, p: int) -> int:
    """How many times each KV head is repeated before the all-to-all: 1 when kv_heads % P == 0,
    P / kv_heads when kv_heads divides P.

    Raises:
        ValueError: the query heads are not divisible by P, or the KV heads neither divisible
            by P nor dividing it.
    """
    if heads % p != 0:
        raise _error(
            f"the {heads} query heads must be divisible by the sequence-parallel size {p}; "
            f"choose a sequence_parallel_size that divides {heads}"
        )
    if kv_heads % p == 0:
        return 1
    if p % kv_heads == 0:
        return p // kv_heads
    raise _error(
        f"{kv_heads} key/value heads can neither be split over nor repeated to the "
        f"sequence-parallel size {p}; choose a sequence_parallel_size that divides or is a "
        f"multiple of {kv_heads}"
    )


def _document_starts(positions: torch.Tensor) -> torch.Tensor:
    """(batch, seq) int -> (batch, seq) bool: True where a new document starts after column 0
    (a position that is not the previous one plus 1); all False for one document per row."""
    starts = torch.zeros_like(positions, dtype=torch.bool)
    starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
    return starts


def _causal_documents_mask(starts: torch.Tensor, window: Any) -> torch.Tensor:
    """(batch, seq) bool document starts -> (batch, 1, seq, seq) bool, True where query i may
    attend to key j: same document, j <= i, and i - j < window when a sliding window is set."""
    doc = starts.cumsum(-1)
    seq = starts.shape[1]
    idx = torch.arange(seq, device=starts.device)
    allowed = idx[None, :] <= idx[:, None]
    if isinstance(window, int) and window > 0:
        allowed = allowed & (idx[:, None] - idx[None, :] < window)
    return ((doc[:, :, None] == doc[:, None, :]) & allowed)[:, None]


def _no_mask(*args: Any, attention_mask: Any = None, **kwargs: Any) -> None:
    """The mask function for the registered name: the wrapper masks from the position ids, so
    the model builds none. A 2-D padding mask with zeros is refused (before any collective)."""
    _refuse_padding(attention_mask)
    return None


def _refuse_padding(attention_mask: Any) -> None:
    if attention_mask is None:
        return
    if attention_mask.dim() == 2 and bool(attention_mask.all()):
        return
    what = "with padding (zeros)" if attention_mask.dim() == 2 else "prepared (not 2-D)"
    raise _error(
        f"got an attention mask {what} of shape {tuple(attention_mask.shape)}; padding cannot "
        "be split across ranks: pack the sequences instead (documents back to back, "
        "position_ids restarting at 0 for each, no attention_mask) and ignore the filler "
        "tokens' labels"
    )


_REGISTERED: dict[str, UlyssesAttention] = {}


def _register(groups: SequenceParallelGroups, original: str) -> str:
    """The name of the attention function for (groups, original), registered on first use."""
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    for name, fn in _REGISTERED.items():
        if fn.groups == groups and fn.original == original:
            return name
    name = f"{_NAME}_{original}" + (f"_{len(_REGISTERED)}" if _REGISTERED else "")
    fn = UlyssesAttention(groups, original)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, _no_mask)
    _REGISTERED[name] = fn
    return name


def _text_config(config: Any) -> Any:
    getter = getattr(config, "get_text_config", None)
    if callable(getter):
        try:
            return getter(decoder=True)
        except TypeError:  # older signature without decoder=
            return getter()
    return config


def _base(model: nn.Module) -> nn.Module:
    """A PEFT wrapper's base model (get_base_model()), else the model itself."""
    getter = getattr(model, "get_base_model", None)
    base = getter() if callable(getter) else None
    return base if isinstance(base, nn.Module) else model


def _decoder_configs(model: nn.Module) -> list[Any]:
    """The text decoder's config and every copy of it a sub-model holds (same class)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise TypeError(
            f"tiledmlp: sequence parallelism needs a Hugging Face model with a config, got "
            f"{type(model).__name__}"
        )
    text = _text_config(config)
    found = [text]
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if type(cfg) is type(text) and all(cfg is not c for c in found):
            found.append(cfg)
    return found


def _set_implementation(config: Any, name: Any) -> None:
    # The internal attribute: the public setter recurses into sub-configs (a vision tower
    # must keep its own attention).
    if hasattr(config, "_attn_implementation_internal"):
        config._attn_implementation_internal = name
    else:
        config._attn_implementation = name


def install(model: nn.Module, groups: SequenceParallelGroups) -> UlyssesReport:
    """Makes `model`'s attention sequence-parallel over groups.sp_group (Ulysses).

    Call it on every rank before wrapping the model in an engine (DDP, FSDP, DeepSpeed); the
    wrapper does not care which. Afterwards every forward must get this rank's shard of each
    sequence, with position_ids, e.g. model(**shard_batch(batch, groups)); the model's loss
    (`out.loss`, when shift_labels are given) is then the exact loss over the whole sequences
    (see model_loss.py): use it as it is. Inputs are checked before any collective the forward
    runs (the hooks go first, also before patch_model's per-step token agreement).

    Args:
        model: a Hugging Face causal LM (or a PEFT wrapper of one) whose decoder uses sdpa or
            flash attention.
        groups: from make_groups.

    Returns:
        What was switched and checked.

    Raises:
        ValueError: already installed; an unsupported attention implementation (eager, flex);
            query heads not divisible by P; key/value heads neither divisible by P nor dividing
            P. No collective runs here.
    """
    base = _base(model)
    if _STATE in base.__dict__:
        raise _error("already installed on this model; call remove(model) first")
    configs = _decoder_configs(base)
    text = configs[0]
    originals = {c._attn_implementation for c in configs}
    if len(originals) != 1:
        raise _error(
            f"the decoder's configs use different attention implementations {sorted(originals)}; "
            "set one with model.set_attn_implementation('sdpa') first"
        )
    original = originals.pop()
    if original not in SUPPORTED_ATTENTION:
        raise _error(
            f"attention implementation {original!r} is not supported (expected one of "
            f"{', '.join(SUPPORTED_ATTENTION)}): the wrapper calls the model's own attention on "
            "whole sequences and masks by position ids; load the model with "
            "attn_implementation='sdpa' (or call model.set_attn_implementation('sdpa'))"
        )
    p = groups.sp_size
    heads = getattr(text, "num_attention_heads", None)
    if isinstance(heads, int):
        kv_repeat(heads, int(getattr(text, "num_key_value_heads", None) or heads), p)
    name = _register(groups, original)
    checked = []
    for m in base.modules():
        cfg = getattr(m, "config", None)
        if any(cfg is c for c in configs) and _takes_position_ids(m):
            m.register_forward_pre_hook(_check_inputs, with_kwargs=True, prepend=True)
            checked.append(type(m).__name__)
    if model is not base:  # a PEFT wrapper: the module the user (and the engine) calls
        model.register_forward_pre_hook(_check_inputs, with_kwargs=True, prepend=True)
        checked.insert(0, type(model).__name__)
    model.register_forward_hook(_exact_loss, with_kwargs=True)
    base.__dict__[_STATE] = _Installed(name, [(c, c._attn_implementation) for c in configs], groups)
    for c in configs:
        _set_implementation(c, name)
    logger.info("tiledmlp: Ulysses SP over %d ranks installed (wrapping %s)", p, original)
    return UlyssesReport(name, original, tuple(type(c).__name__ for c in configs), tuple(checked))


def _takes_position_ids(module: nn.Module) -> bool:
    """A model (a module with a config, not one of its layers) whose forward takes
    position_ids: where missing position ids are caught before the first collective."""
    if not hasattr(module, "get_input_embeddings"):
        return False
    try:
        return "position_ids" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _given(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The forward's arguments by name (positional ones named by the forward's signature)."""
    given = dict(zip(inspect.signature(module.forward).parameters, args))
    given.update(kwargs)
    return given


def _check_inputs(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """Forward pre-hook (registered to run before every other pre-hook): refuses missing
    position_ids, padding masks and unshifted labels before any collective."""
    given = _given(module, args, kwargs)
    fn = _REGISTERED.get(getattr(getattr(module, "config", None), "_attn_implementation", ""))
    if fn is not None:
        fn.forget()
    if given.get("position_ids") is None:
        raise _error(
            f"{type(module).__name__} got no position_ids; without them each rank would number "
            "its tokens from 0. Pass this rank's position ids, e.g. "
            "model(**tiledmlp.sequence_parallel.shard_batch(batch, groups))"
        )
    _refuse_padding(given.get("attention_mask"))
    refuse_unshifted_labels(given)


def _exact_loss(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook on the model the user calls: its loss becomes the exact loss over the SP
    group's whole sequences (model_loss.py)."""
    groups = installed_groups(module)
    if groups is None:
        return None
    return exact_output(output, _given(module, args, kwargs), groups)


def installed_groups(model: nn.Module) -> SequenceParallelGroups | None:
    """The groups `model`'s attention is sequence-parallel over, or None when not installed."""
    state: _Installed | None = _base(model).__dict__.get(_STATE)
    return None if state is None else state.groups


def remove(model: nn.Module) -> bool:
    """Restores the attention implementation(s) install replaced; True if it was installed."""
    base = _base(model)
    state: _Installed | None = base.__dict__.pop(_STATE, None)
    if state is None:
        return False
    for config, original in state.originals:
        _set_implementation(config, original)
    for m in model.modules():  # a PEFT wrapper's modules include its base model's
        for key, hook in list(m._forward_pre_hooks.items()):
            if hook is _check_inputs:
                del m._forward_pre_hooks[key]
                m._forward_pre_hooks_with_kwargs.pop(key, None)
        for key, hook in list(m._forward_hooks.items()):
            if hook is _exact_loss:
                del m._forward_hooks[key]
                m._forward_hooks_with_kwargs.pop(key, None)
                m._forward_hooks_always_called.pop(key, None)
    return True
