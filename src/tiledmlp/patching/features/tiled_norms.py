"""The tiled norms feature (tiled_norms=True): every normalisation layer over the hidden size
(LayerNorm / RMSNorm, the final norm included) runs through tiled_mlp's generic path, so its
float32 intermediates exist one tile at a time.

Probe: the norms by structure (patching/detect.py's norms_of: class and weight shape, no
values), less the modules the tiled MLPs take and those another library's kernel owns
(patching/native.py: Liger's RMSNorm, hub kernels; reported as skipped). Apply: tiled_forward on each
(features/tiled_modules.py).

Invariant: only norms whose weight has exactly hidden-size elements are tiled (per-head norms
are left alone).
"""

from __future__ import annotations

from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.patching.detect import norms_of
from tiledmlp.patching.features.base import Found
from tiledmlp.patching.features.tiled_mlp import FoundModules
from tiledmlp.patching.features.tiled_modules import ModuleTiling, hidden_size, tile_candidates
from tiledmlp.patching.report import ReportParts
from tiledmlp.patching.state import NORM_KIND, PatchState

__all__ = ["TILED_NORMS", "TiledNorms"]


class TiledNorms(ModuleTiling):
    """Tiled norms (module docstring)."""

    name = "tiled_norms"

    def owns(self, state: PatchState) -> bool:
        return state.kind == NORM_KIND

    def probe(self, model: nn.Module, config: PatchConfig, found: Found) -> FoundModules:
        mlps = found.get("tiled_mlp")
        taken = {id(c.module) for c in mlps.candidates} if mlps is not None else set()
        skipped: list[tuple[str, str]] = []
        norms = norms_of(model, hidden_size(model, config), skipped)
        return FoundModules([c for c in norms if id(c.module) not in taken], skipped)

    def apply(
        self, model: nn.Module, config: PatchConfig, probed: FoundModules, report: ReportParts
    ) -> None:
        tile_candidates(model, probed.candidates, config, report)
        report.skipped += probed.skipped


TILED_NORMS = TiledNorms()
