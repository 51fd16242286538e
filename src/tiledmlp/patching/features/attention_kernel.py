"""The attention-kernel feature (attention_kernel= other than a plain "auto"): every decoder
layer's call runs its attention under `torch.nn.attention.sdpa_kernel` with the kernel the
option chooses for that call (ops/attention/buffers.py: kernel_for), so the model's own SDPA
attention (transformers' attention interface) and the attention core by heads of tiled decoder
layers (whose kernel selection follows SDPA's enabled backends) both run it.

Invariant: the layers' outputs are those of SDPA's attention (kernels differ only in summation
order); remove() restores each layer's forward and each switched config's implementation
exactly.

Note: how it works, its costs and its choices are in
docs/how-it-works/module-notes.md#patching-features-attention-kernel.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.ops.attention.buffers import (
    KERNEL_NAMES,
    AttentionShape,
    KernelChoice,
    backward_buffer_bytes,
    config_heads,
    kernel_for,
    unusable,
    usable_kernels,
)
from tiledmlp.patching.attention_core import by_heads
from tiledmlp.patching.features.base import Feature
from tiledmlp.patching.features.tiled_layers import decoder_layers
from tiledmlp.patching.hf_attention import HF_ATTENTION
from tiledmlp.patching.report import ReportParts

__all__ = ["ATTENTION_KERNEL", "ROUTED_SDPA", "AttentionKernel", "call_context"]

_KEY = "_tiledmlp_attention_kernel"  # instance attribute: (the choice, the forward replaced)
_ATTN_KEY = "_tiledmlp_attention_kernel_inner"  # the same, on a layer's attention module
_ATTENTION_NAMES = ("self_attn", "attention", "attn")
_CONFIGS = "_tiledmlp_attention_kernel_configs"  # model attribute: the configs switched
_MISSING = object()
ROUTED_SDPA = "tiledmlp_sdpa"  # transformers' sdpa; by head groups inside by_heads()
_REGISTERED: list[bool] = []


def _routed_sdpa(*args: Any, **kwargs: Any) -> Any:
    return HF_ATTENTION.function("sdpa")(*args, **kwargs)


def _register_routed() -> None:
    """Registers ROUTED_SDPA once per process, with sdpa's mask function."""
    if not _REGISTERED:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        HF_ATTENTION.register(ROUTED_SDPA, _routed_sdpa, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
        _REGISTERED.append(True)


def _set_implementation(config: Any, name: str) -> None:
    if hasattr(config, "_attn_implementation_internal"):
        config._attn_implementation_internal = name
    else:
        config._attn_implementation = name


def _backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def call_context(
    choice: KernelChoice, heads: tuple[int, int, int], hidden: torch.Tensor
) -> contextlib.AbstractContextManager[Any]:
    """The context one decoder layer's call runs in: sdpa_kernel(the chosen kernel), or nothing
    where SDPA keeps its own choice.

    Args:
        choice: the option.
        heads: (query heads, key/value heads, head size) of the model.
        hidden: the layer's input (batch, tokens, hidden).

    Raises:
        ValueError: a named kernel the device or dtype cannot run (one line).
    """
    device = hidden.device.type
    dtype = hidden.dtype
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    shape = AttentionShape(
        hidden.shape[0], heads[0], heads[1], hidden.shape[1], heads[2], dtype.itemsize
    )
    dtype_name = str(dtype).removeprefix("torch.")
    if choice.name != "auto":
        why = unusable(choice.name, shape, device, dtype_name)
        if why is not None:
            raise ValueError(f"attention_kernel={choice.name}: {why}; use auto or another kernel")
    usable = usable_kernels(shape, device, dtype_name)
    name = kernel_for(choice.name, shape, usable, choice.budget_bytes)
    if name is None:
        return contextlib.nullcontext()
    if name == "by_heads":  # SDPA's own kernel, per group of heads (module docstring)
        return by_heads()
    from torch.nn.attention import sdpa_kernel

    names = [name]
    if choice.budget_bytes is not None:
        # auto: the slower kernels that fit as well, in order, where the chosen one cannot
        # take this call after all (an explicit mask, say, which flash refuses)
        at = usable.index(name)
        names += [
            k
            for k in usable[at + 1 :]
            if k != "by_heads" and backward_buffer_bytes(k, shape) <= choice.budget_bytes
        ]
    return sdpa_kernel([_backend(k) for k in names], set_priority=True)


def _restore(module: nn.Module, before: Any) -> None:
    if before is _MISSING:
        del module.__dict__["forward"]
    else:
        module.forward = before  # type: ignore[method-assign]


def _wrapped(
    layer: nn.Module, choice: KernelChoice, heads: tuple[int, int, int]
) -> Callable[..., Any]:
    forward = layer.forward

    def forward_with_kernel(*args: Any, **kwargs: Any) -> Any:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
            return forward(*args, **kwargs)
        with call_context(choice, heads, hidden):
            return forward(*args, **kwargs)

    return forward_with_kernel


class AttentionKernel(Feature):
    """The attention-kernel feature (module docstring)."""

    name = "attention_kernel"

    def wanted(self, config: PatchConfig) -> bool:
        choice = config.attention_kernel
        return not (choice.name == "auto" and choice.budget_bytes is None)

    def apply(
        self, model: nn.Module, config: PatchConfig, probed: Any, report: ReportParts
    ) -> None:
        del probed
        model_config = getattr(model, "config", None)
        if model_config is None:
            raise ValueError(
                "attention_kernel: the model has no config to read its heads from (a "
                "transformers model is expected)"
            )
        heads = config_heads(model_config)
        choice = config.attention_kernel
        # under sequence parallelism the context alone routes (module docstring); its wrapper
        # takes the model's own implementation, sdpa, not ROUTED_SDPA
        parallel = config.sequence_parallel_size is not None or (
            config.sequence_parallel_group is not None
        )
        routes = choice.name == "by_heads" or choice.budget_bytes is not None
        if routes and not parallel and not hasattr(model, _CONFIGS):
            self._route(model)
        for _, layer in decoder_layers(model):
            if _KEY in layer.__dict__:
                continue
            # the layer's call, and its attention module's inside it: Hugging Face's
            # checkpointing recomputes the class's forward (not an instance's), so the
            # recompute runs the kernel the forward ran only with the context inside it too
            attn = next((m for n in _ATTENTION_NAMES
                         if isinstance(m := getattr(layer, n, None), nn.Module)), None)  # fmt: skip
            for module, key in ((layer, _KEY), (attn, _ATTN_KEY)):
                if module is None or key in module.__dict__:
                    continue
                before = module.__dict__.get("forward", _MISSING)
                wrapped = _wrapped(module, config.attention_kernel, heads)
                module.__dict__[key] = (config.attention_kernel, before)
                module.forward = wrapped  # type: ignore[method-assign]
        self.describe(model, report)

    @staticmethod
    def _route(model: nn.Module) -> None:
        """Switches the configs of `model` that name transformers' sdpa to ROUTED_SDPA (module
        docstring), remembering them for remove()."""
        switched: list[Any] = []
        for m in model.modules():
            cfg = getattr(m, "config", None)
            if getattr(cfg, "_attn_implementation", None) == "sdpa" and all(
                cfg is not c for c in switched
            ):
                switched.append(cfg)
        if switched:
            _register_routed()
        for cfg in switched:
            _set_implementation(cfg, ROUTED_SDPA)
        model.__dict__[_CONFIGS] = switched

    def remove(self, model: nn.Module) -> list[str]:
        for cfg in model.__dict__.pop(_CONFIGS, []):
            if getattr(cfg, "_attn_implementation", None) == ROUTED_SDPA:
                _set_implementation(cfg, "sdpa")
        restored = []
        for name, layer in model.named_modules():
            inner = layer.__dict__.pop(_ATTN_KEY, None)
            if inner is not None:
                _restore(layer, inner[1])
            entry = layer.__dict__.pop(_KEY, None)
            if entry is None:
                continue
            before = entry[1]
            if before is _MISSING:
                del layer.__dict__["forward"]
            else:
                layer.forward = before  # type: ignore[method-assign]
            restored.append(name)
        return restored

    def describe(self, model: nn.Module, report: ReportParts) -> None:
        choices = {str(layer.__dict__[_KEY][0]) for _, layer in model.named_modules()
                   if _KEY in layer.__dict__}  # fmt: skip
        layers = sum(1 for _, layer in model.named_modules() if _KEY in layer.__dict__)
        if choices:
            what = " or ".join(sorted(choices))
            how = "" if what in KERNEL_NAMES else " (per call)"
            report.attention_kernel = f"{what}{how} in {layers} decoder layer(s)"


ATTENTION_KERNEL = AttentionKernel()
