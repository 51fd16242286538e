"""The tiled norms feature (tiled_norms=True): every normalisation layer over the hidden size
(LayerNorm / RMSNorm, the final norm included) runs through tiled_mlp's generic path, so its
float32 intermediates exist one tile at a time.

Probe: the norms by structure (patching/detect.py's norms_of: class and weight shape, no
values), less the modules the tiled MLPs take. Apply: tiled_forward on each
(features/tiled_modules.py).

Invariant: only norms whose weight has exactly hidden-size elements are tiled (per-head norms
are left alone).
"""

from __future__ import annotations

from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.patching.agreement import step_tokens
from tiledmlp.patching.detect import norms_of
from tiledmlp.patching.features.base import Feature, Found
from tiledmlp.patching.features.tiled_mlp import FoundModules
from tiledmlp.patching.features.tiled_modules import (
    blocked_modules,
    describe_modules,
    hidden_size,
    patch_module,
    remove_modules,
)
from tiledmlp.patching.report import ReportParts
from tiledmlp.patching.state import PatchState

__all__ = ["TILED_NORMS", "TiledNorms"]


def _owns(state: PatchState) -> bool:
    return state.kind == "norm"


class TiledNorms(Feature):
    """Tiled norms (module docstring)."""

    name = "tiled_norms"

    def probe(self, model: nn.Module, config: PatchConfig, found: Found) -> FoundModules:
        mlps = found.get("tiled_mlp")
        taken = {id(c.module) for c in mlps.candidates} if mlps is not None else set()
        norms = norms_of(model, hidden_size(model, config))
        return FoundModules([c for c in norms if id(c.module) not in taken])

    def apply(
        self, model: nn.Module, config: PatchConfig, probed: FoundModules, report: ReportParts
    ) -> None:
        if probed.candidates:
            step = step_tokens(model)
            for cand in probed.candidates:
                patch_module(cand.module, cand, config.mlp_config, step)
        report.paths.update({c.name: f"{c.path}: {c.kind}" for c in probed.candidates})

    def blocked(self, model: nn.Module) -> list[str]:
        return blocked_modules(model, _owns)

    def remove(self, model: nn.Module) -> list[str]:
        return remove_modules(model, _owns)

    def describe(self, model: nn.Module, report: ReportParts) -> None:
        describe_modules(model, _owns, report)


TILED_NORMS = TiledNorms()
