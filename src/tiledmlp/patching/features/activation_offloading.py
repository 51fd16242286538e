"""The activation offloading feature (activation_offloading=True): the inputs of the model's
checkpointed layers live in host memory between the forward and their recompute
(tiledmlp.ops.offloading.saved_inputs does the moving).

Hugging Face models checkpoint a layer by calling the layer's `_gradient_checkpointing_func`
(set by `gradient_checkpointing_enable` / `activation_checkpointing_enable`, possibly after we
patch, e.g. by the Trainer) with the hidden states as the first positional argument. A forward
pre-hook on the model's root therefore checks, at every training forward, that checkpointing is
on and non-reentrant, and wraps each layer's checkpoint function (once) so that the call runs
inside the offloader's saved-tensor hooks. With checkpointing off or reentrant offloading would
silently do nothing (nothing is saved, or the reentrant checkpoint keeps its own copies), so both
are errors.

transformers' own offloading (`activation_checkpointing_enable(offload=True)`) wraps the same
checkpoint in `save_on_cpu`. Both cannot act: inside theirs, every saved tensor would go to the
host synchronously before ours sees it. With activation_offloading=True ours owns the job: a
layer whose checkpoint function is transformers' offloading one runs the plain checkpoint with
the same keywords under our offloader (the report says so), and removing the feature puts
transformers' function back. See Note [One offloader].

No probe: layers are found by structure; checkpointing is checked at each training forward.

Invariant: the model computes exactly what it computes without offloading; removing the feature
restores every checkpoint function it wrapped and removes the hook.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.ops.offloading.host_memory import check_host_memory, offload_bytes
from tiledmlp.ops.offloading.saved_inputs import ActivationOffloader
from tiledmlp.patching.features.base import Feature
from tiledmlp.patching.report import ReportParts

__all__ = [
    "ACTIVATION_OFFLOADING",
    "ActivationOffloading",
    "OffloadingCheckpoint",
    "before_forward",
    "enable_checkpointing",
    "install_offloading",
    "offloader_of",
    "remove_offloading",
]

_STATE = "_tiledmlp_offload"
_HOW = (
    "model.activation_checkpointing_enable({'use_reentrant': False}) (transformers 4.x: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
    "False})); with the Hugging Face Trainer, TrainingArguments(gradient_checkpointing=True, "
    "gradient_checkpointing_kwargs={'use_reentrant': False}) (the Trainer turns it on itself, "
    "reentrant unless told otherwise)"
)


# Note [One offloader]
# transformers' offload=True and ours move the same tensors (a checkpointed layer's saved
# inputs). Stacked, the inner one takes every saved tensor and the outer one sees nothing, so
# the result would depend on the order the two were turned on. The user who asks patch_model
# for activation_offloading asked for ours (copies on a side stream, prefetched in the
# backward, pooled host buffers, the host-memory check), so ours runs and transformers'
# save_on_cpu is set aside for the layers we wrap, and put back by remove_offloading.


class OffloadingCheckpoint:
    """A layer's checkpoint function whose call saves the hidden states through the offloader.

    Args:
        inner: the checkpoint function it replaces (put back by remove_offloading): a partial
            of torch.utils.checkpoint.checkpoint with use_reentrant=False, or transformers'
            offloading checkpoint (Note [One offloader]).
        offloader: the model's ActivationOffloader.
    """

    def __init__(self, inner: Callable[..., Any], offloader: ActivationOffloader) -> None:
        self.inner = inner
        self.offloader = offloader
        plain = transformers_offload_plain(inner)
        #: what runs: `inner`, or the plain checkpoint transformers' offloading one wraps
        self.run: Callable[..., Any] = inner if plain is None else plain
        #: whether transformers' offload=True was set aside for this layer
        self.replaced_native = plain is not None

    def __call__(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not args or not isinstance(args[0], torch.Tensor):
            return self.run(function, *args, **kwargs)
        with self.offloader.saving(args[0]):
            return self.run(function, *args, **kwargs)


def transformers_offload_plain(func: Any) -> functools.partial[Any] | None:
    """When `func` is transformers' offloading checkpoint function (a partial of the closure
    `activation_checkpointing_enable(offload=True)` builds around `save_on_cpu` and
    torch.utils.checkpoint.checkpoint): the plain checkpoint with the same arguments; else
    None. Recognised by where the closure lives and what it calls (transformers 5.25's
    modeling_utils; tests/patching/features/test_native_checkpointing.py fails loudly if it moves)."""
    if not isinstance(func, functools.partial):
        return None
    inner = func.func
    code = getattr(inner, "__code__", None)
    if (
        code is None
        or getattr(inner, "__module__", None) != "transformers.modeling_utils"
        or "save_on_cpu" not in code.co_names
        or "checkpoint" not in code.co_names
    ):
        return None
    return functools.partial(torch.utils.checkpoint.checkpoint, *func.args, **func.keywords)


def native_offload_layers(model: nn.Module) -> int:
    """How many of `model`'s checkpointed layers run transformers' offload=True now (not set
    aside by ours)."""
    return sum(
        1
        for m in _checkpointed(model)
        if m.gradient_checkpointing
        and transformers_offload_plain(m.__dict__.get("_gradient_checkpointing_func")) is not None
    )


def enable_checkpointing(model: Any, *, reentrant: bool = False, every_n_layers: int = 1) -> None:
    """Turns on a Hugging Face model's own checkpointing, non-reentrant by default (the current
    transformers name first, the deprecated one on older versions); with `every_n_layers` N > 1,
    of every N-th decoder layer only (transformers 5.25 and later).

    Raises:
        ValueError: every_n_layers > 1 on a transformers without it.
    """
    kwargs = {"use_reentrant": reentrant}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if every_n_layers != 1:
        if enable is None or "every_n_layers" not in inspect.signature(enable).parameters:
            raise ValueError(
                f"every_n_layers={every_n_layers}: {type(model).__name__}'s "
                "activation_checkpointing_enable has no every_n_layers (transformers 5.25 and "
                "later have it); upgrade transformers or checkpoint every layer"
            )
        enable(kwargs, every_n_layers=every_n_layers)
    elif enable is not None:
        enable(kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _checkpointed(model: nn.Module) -> list[nn.Module]:
    """Modules that Hugging Face's checkpointing toggles (they carry `gradient_checkpointing`)."""
    return [
        m for m in model.modules() if isinstance(getattr(m, "gradient_checkpointing", None), bool)
    ]


def _check_inner(func: Any, layer: nn.Module) -> None:
    """Raises unless `func` is torch's checkpoint, non-reentrant, with nothing else around it
    but transformers' own offloading (set aside by ours: Note [One offloader])."""
    plain = transformers_offload_plain(func)
    func = func if plain is None else plain
    ok = (
        isinstance(func, functools.partial)
        and func.func is torch.utils.checkpoint.checkpoint
        and func.keywords.get("use_reentrant") is False
    )
    if ok:
        return
    if isinstance(func, functools.partial) and func.keywords.get("use_reentrant") is True:
        raise ValueError(
            f"activation offloading: {type(layer).__name__} uses reentrant checkpointing, which "
            f"keeps its own copies of the layer inputs (offloading would do nothing). Enable "
            f"non-reentrant checkpointing: {_HOW}"
        )
    raise ValueError(
        f"activation offloading: {type(layer).__name__} is checkpointed by {func!r}; expected "
        "torch.utils.checkpoint.checkpoint with use_reentrant=False (or transformers' own "
        f"activation_checkpointing_enable(offload=True), which ours then replaces). Enable it "
        f"with {_HOW}"
    )


def before_forward(
    offloader: ActivationOffloader,
    layers: list[nn.Module],
    module: nn.Module,
    args: Any,
    kwargs: dict[str, Any] | None = None,
) -> None:
    """The root's forward pre-hook: checks checkpointing, wraps new checkpoint functions, and
    before a step longer than any before, checks that its offloaded inputs fit in host memory
    (ops/offloading/host_memory.py)."""
    if not (module.training and torch.is_grad_enabled()):
        return  # evaluation: nothing is saved, nothing to offload
    on = [m for m in layers if m.gradient_checkpointing]
    if not on:
        raise ValueError(
            f"activation offloading is on but {type(module).__name__} is not checkpointing "
            f"(offloading moves the checkpointed layers' inputs; without checkpointing there are "
            f"none and every activation stays on the device). Enable it with {_HOW}, or patch "
            "without activation_offloading"
        )
    for layer in on:
        func = layer.__dict__.get("_gradient_checkpointing_func")
        if isinstance(func, OffloadingCheckpoint) and func.offloader is offloader:
            continue
        _check_inner(func, layer)
        assert func is not None  # checked above
        layer.__dict__["_gradient_checkpointing_func"] = OffloadingCheckpoint(func, offloader)
    _check_host(offloader, len(on), module, args, kwargs or {})
    offloader.begin_step()


def _tokens(args: Any, kwargs: dict[str, Any]) -> int | None:
    for t in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *(args or ())[:1]):
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return t.numel() // t.shape[-1] if t.is_floating_point() else t.numel()
    return None


def _check_host(
    offloader: ActivationOffloader, checkpointed: int, module: nn.Module, args: Any, kwargs: Any
) -> None:
    """Stops before a step whose offloaded layer inputs cannot fit in host memory. Only for
    devices other than the host: on the CPU the host copy replaces the device copy, and the
    planner's pool holds no data."""
    param = next(module.parameters(), None)
    if param is None or param.device.type in ("cpu", "meta"):
        return
    if offloader.pool.device.type == "meta":
        return
    tokens = _tokens(args, kwargs)
    getter = getattr(module, "get_input_embeddings", None)
    weight = getattr(getter() if callable(getter) else None, "weight", None)
    if tokens is None or tokens <= offloader.host_checked_tokens or weight is None:
        return
    hidden, elem = int(weight.shape[-1]), weight.element_size()
    need = offload_bytes(checkpointed, tokens, hidden, elem)
    check_host_memory(
        need,
        f"a step of {tokens} tokens ({checkpointed - 1} checkpointed layer inputs of {tokens} x "
        f"{hidden} x {elem} bytes)",
    )
    offloader.host_checked_tokens = tokens


def install_offloading(model: nn.Module) -> ActivationOffloader:
    """Turns activation offloading on for `model` (idempotent); returns its offloader.

    Checkpointing may be enabled before or after this call; it is checked at each training
    forward.

    Raises:
        ValueError: the model has no layers that Hugging Face's gradient checkpointing can
            checkpoint (no module with a `gradient_checkpointing` attribute).
    """
    existing = model.__dict__.get(_STATE)
    if existing is not None:
        return existing[0]  # type: ignore[no-any-return]
    layers = _checkpointed(model)
    if not layers:
        raise ValueError(
            f"activation offloading: {type(model).__name__} has no layers Hugging Face's "
            "gradient checkpointing can checkpoint (no module with a `gradient_checkpointing` "
            "attribute); expected a transformers model that supports gradient checkpointing"
        )
    offloader = ActivationOffloader()
    handle = model.register_forward_pre_hook(
        functools.partial(before_forward, offloader, layers), with_kwargs=True
    )
    model.__dict__[_STATE] = (offloader, handle)
    return offloader


def offloader_of(model: nn.Module) -> ActivationOffloader | None:
    """The model's offloader (its pool and stats), or None when offloading is off."""
    state = model.__dict__.get(_STATE)
    return None if state is None else state[0]


def remove_offloading(model: nn.Module) -> bool:
    """Turns activation offloading off; returns whether it was on."""
    state = model.__dict__.pop(_STATE, None)
    if state is None:
        return False
    offloader, handle = state
    handle.remove()
    for layer in model.modules():
        func = layer.__dict__.get("_gradient_checkpointing_func")
        if isinstance(func, OffloadingCheckpoint) and func.offloader is offloader:
            layer.__dict__["_gradient_checkpointing_func"] = func.inner
    offloader.pool.clear()
    return True


class ActivationOffloading(Feature):
    """Activation offloading (module docstring)."""

    name = "activation_offloading"

    def wanted(self, config: PatchConfig) -> bool:
        del config
        return True  # off, it still names transformers' offloading when that is on (apply)

    def apply(
        self, model: nn.Module, config: PatchConfig, probed: None, report: ReportParts
    ) -> None:
        del probed
        if not config.activation_offloading:
            native = native_offload_layers(model)
            if native:
                report.offloading = (
                    f"transformers' activation_checkpointing_enable(offload=True) moves the "
                    f"inputs of {native} checkpointed layer(s) (tiledmlp's activation_offloading "
                    "is off)"
                )
            return
        install_offloading(model)
        report.offloading = _described(model)

    def remove(self, model: nn.Module) -> list[str]:
        return ["<activation offloading>"] if remove_offloading(model) else []

    def describe(self, model: nn.Module, report: ReportParts) -> None:
        if offloader_of(model) is not None:
            report.offloading = _described(model, "on")


_OWNS = (
    "; transformers' activation_checkpointing_enable(offload=True) is on too and stands aside "
    "(tiledmlp's offloader owns the checkpointed inputs; its save_on_cpu is put back by "
    "unpatch_model)"
)


def _described(
    model: nn.Module,
    what: str = "checkpointed layer inputs to host memory (all but the last layer's)",
) -> str:
    """The report's line: what is offloaded, and who owns it where transformers' offloading is
    on as well (Note [One offloader])."""
    native = native_offload_layers(model) + sum(
        1
        for m in model.modules()
        if isinstance(f := m.__dict__.get("_gradient_checkpointing_func"), OffloadingCheckpoint)
        and f.replaced_native
    )
    return what + (_OWNS if native else "")


ACTIVATION_OFFLOADING = ActivationOffloading()
