"""The tiled loss feature (tiled_loss=True): a causal LM's training loss through
tiled_cross_entropy, the logits never formed at once (patching/loss.py).

Probe: the patched loss must equal the model's own on random ids (loss.py's loss_refusal), run
without the sequence-parallel attention (the probe passes no position_ids), which is taken off
for it and put back. Apply: the loss forward, from a passed probe; where the probe refused, the
report carries the reason (and, without tiled MLPs, patch_model raises it).

Invariant: the loss is routed through tiled_cross_entropy only after the probe (or a caller's
declaration, the planner's) says it equals the model's own.
"""

from __future__ import annotations

from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.patching.features.base import Feature, Found
from tiledmlp.patching.loss import install_loss, loss_description, loss_refusal, unpatch_loss
from tiledmlp.patching.report import ReportParts
from tiledmlp.sequence_parallel.install import install as install_sp
from tiledmlp.sequence_parallel.install import installed_groups as sp_installed
from tiledmlp.sequence_parallel.install import remove as remove_sp

__all__ = ["TILED_LOSS", "TiledLoss"]


class TiledLoss(Feature):
    """The tiled loss (module docstring). Its probe's result: None (tile it) or why not."""

    name = "tiled_loss"

    def probe(self, model: nn.Module, config: PatchConfig, found: Found) -> str | None:
        del found
        groups = sp_installed(model)
        if groups is not None:
            remove_sp(model)
        try:
            why = loss_refusal(model, config.loss_policy)
        finally:
            if groups is not None:
                install_sp(model, groups)
        if why is not None and not config.tiled_mlp:
            raise ValueError(
                f"patch_model: the loss of {type(model).__name__} cannot be tiled: {why}"
            )
        return why

    def apply(
        self, model: nn.Module, config: PatchConfig, probed: str | None, report: ReportParts
    ) -> None:
        if probed is None:
            install_loss(model, config.loss_policy)
        report.loss = probed or loss_description(model) or "tiled"

    def remove(self, model: nn.Module) -> list[str]:
        return ["<loss>"] if unpatch_loss(model) else []

    def describe(self, model: nn.Module, report: ReportParts) -> None:
        described = loss_description(model)
        if described is not None:
            report.loss = described


TILED_LOSS = TiledLoss()
