"""DeepSpeed ZeRO: what tiling needs from it.

ZeRO-1 and ZeRO-2 need nothing: the tiled op hands each parameter's gradient to autograd exactly
once, which is what their gradient hooks expect. ZeRO-3 partitions parameters (outside a gather a
parameter's data is empty, its full shape in `ds_shape`), so tiled MLPs under ZeRO-3 get a
backend (ops/tiling/backend.py) that gathers the MLP's parameters with deepspeed.zero.GatheredParameters
once for the tiled forward and once for the tiled backward, and that marks the child modules'
hooks as DeepSpeed's own parameter fetching: the fast path never calls the children, and the
generic path (LoRA-wrapped projections, MoE experts, custom MLPs) calls the module's own forward
with its children's hooks switched off, inside that gather. Parameters that DeepSpeed already
holds for a module in flight (the tiled module's direct parameters, fetched by its own hooks) are
left to DeepSpeed. The gradients come out full-size, once per
parameter, into DeepSpeed's reduce-scatter hooks, as from DeepSpeed's own ZeRO-3 linear layer.

Invariant: every rank gathers the same MLP's parameters at the same point of the forward and of
the backward (one gather per tiled call each way, whatever the tile count), so ranks never wait
on different collectives.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from tiledmlp.ops.tiling.backend import ParamBackend

__all__ = ["Zero3Backend", "backend_for", "quiet_accelerator_guess"]


def _is_zero3_param(p: torch.Tensor) -> bool:
    # DeepSpeed's ZeRO-3 parameters carry a ds_id (deepspeed/runtime/zero/partition_parameters.py)
    return hasattr(p, "ds_id")


def _ours_to_gather(params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The ZeRO-3 parameters the tiled call must gather itself: not those DeepSpeed already
    holds for a module in flight (the tiled module's own direct parameters, fetched by
    DeepSpeed's hooks on that module for its forward and again for its backward, and released
    by them), and not those already whole (fetched ahead by DeepSpeed's prefetch, or still held
    by an earlier tiled backward until their gradient is accumulated, e.g. when a checkpointed
    layer is recomputed in the backward): whoever gathered those releases them; releasing them
    here would leave their holder with an empty parameter."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    inflight = [p for p in params if getattr(p, "ds_status", None) is ZeroParamStatus.INFLIGHT]
    if inflight and not all(getattr(p, "ds_active_sub_modules", ()) for p in inflight):
        raise RuntimeError(
            "tiled_mlp under DeepSpeed ZeRO-3: a parameter of a tiled MLP is being prefetched by "
            "DeepSpeed (status INFLIGHT), so it cannot be gathered whole; this happens when the "
            "MLP's children were called outside the tiled op (their hooks taught DeepSpeed to "
            "prefetch them). Call the MLP only through its patched forward, or set "
            "zero_optimization.stage3_prefetch_bucket_size to 0."
        )
    return [
        p
        for p in params
        if _is_zero3_param(p)
        and not getattr(p, "ds_active_sub_modules", ())
        and getattr(p, "ds_status", None) is not ZeroParamStatus.AVAILABLE
    ]


class Zero3Backend(ParamBackend):
    """Gathers ZeRO-3 partitioned parameters around the tiled forward and backward."""

    engine_hooks = True

    def gathered(self, params: Sequence[torch.Tensor]) -> contextlib.AbstractContextManager[object]:
        zero3 = _ours_to_gather(params)
        if not zero3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(zero3, modifier_rank=None)

    @contextlib.contextmanager
    def gathered_for_backward(self, params: Sequence[torch.Tensor]) -> Iterator[None]:
        """Gathers for the tiled backward. Autograd accumulates the returned gradients after the
        backward, and checks them against the parameter's current size, so a parameter that
        gets a gradient stays whole until that gradient has been accumulated (and reduced by
        DeepSpeed's own hook, registered earlier); the others are partitioned at once."""
        zero3 = _ours_to_gather(params)
        if not zero3:
            yield
            return
        first: Any = zero3[0]  # a DeepSpeed ZeRO-3 parameter
        first.all_gather(param_list=zero3)
        try:
            yield
        finally:
            trainable = [p for p in zero3 if p.requires_grad]
            frozen = [p for p in zero3 if not p.requires_grad]
            if frozen:
                head: Any = frozen[0]
                head.partition(param_list=frozen, has_been_updated=False)
            for p in trainable:
                _partition_after_accumulation(p)


def _partition_after_accumulation(param: torch.Tensor) -> None:
    handle = None

    def partition(p: Any) -> None:
        assert handle is not None
        handle.remove()
        p.partition(param_list=[p], has_been_updated=False)

    handle = param.register_post_accumulate_grad_hook(partition)


_ZERO3 = Zero3Backend()


def backend_for(module: nn.Module) -> ParamBackend | None:
    """The ZeRO-3 backend when the module's parameters are ZeRO-3 partitioned."""
    if any(_is_zero3_param(p) for p in module.parameters()):
        return _ZERO3
    return None


class _AcceleratorGuess(logging.Filter):
    """Drops DeepSpeed's import-time warning that it fell back to the CPU accelerator."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Setting accelerator to CPU" not in record.getMessage()


def quiet_accelerator_guess() -> None:
    """For a run that does not use DeepSpeed: drops the warning DeepSpeed logs when something
    imports it on a machine without a GPU (accelerate's `unwrap_model` does, whenever DeepSpeed
    is installed), "Setting accelerator to CPU. If you have GPU ...", which is about DeepSpeed's
    own device choice and says nothing about this run. Its logger ("DeepSpeed",
    deepspeed/utils/logging.py) keeps its filters when DeepSpeed configures it on import."""
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _AcceleratorGuess) for f in logger.filters):
        logger.addFilter(_AcceleratorGuess())
