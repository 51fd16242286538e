"""The activation offloading feature (activation_offloading=True): the inputs of the model's
checkpointed layers live in host memory between the forward and their recompute
(patching/offloading.py).

No probe: the checkpointed layers are found by structure when it is applied, and checkpointing
itself is checked at each training forward (it may be turned on after patching).

Invariant: the model computes what it computes without offloading.
"""

from __future__ import annotations

from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.patching.features.base import Feature
from tiledmlp.patching.offloading import install_offloading, offloader_of, remove_offloading
from tiledmlp.patching.report import ReportParts

__all__ = ["ACTIVATION_OFFLOADING", "ActivationOffloading"]


class ActivationOffloading(Feature):
    """Activation offloading (module docstring)."""

    name = "activation_offloading"

    def apply(
        self, model: nn.Module, config: PatchConfig, probed: None, report: ReportParts
    ) -> None:
        del config, probed
        install_offloading(model)
        report.offloading = "checkpointed layer inputs to host memory (all but the last layer's)"

    def remove(self, model: nn.Module) -> list[str]:
        return ["<activation offloading>"] if remove_offloading(model) else []

    def describe(self, model: nn.Module, report: ReportParts) -> None:
        if offloader_of(model) is not None:
            report.offloading = "on"


ACTIVATION_OFFLOADING = ActivationOffloading()
