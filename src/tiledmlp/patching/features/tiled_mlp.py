"""The tiled MLPs feature (tiled_mlp=True): every MLP found by structure runs through tiled_mlp.

Probe: detection (patching/detect.py), which runs candidate modules on random tokens at random
weights. Apply: tiled_forward on each found MLP (features/tiled_modules.py), from the probe's
candidates or from candidates a planner declares by structure (plan/apply_stack.py).

Invariant: an MLP is tiled only when detection (or the caller's declaration) found it; modules
that look like MLPs but are not understood are an error unless generic=True.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.patching.detect import Candidate, detect_mlps
from tiledmlp.patching.features.base import Found
from tiledmlp.patching.features.tiled_modules import ModuleTiling, hidden_size, tile_candidates
from tiledmlp.patching.native import replaced_note
from tiledmlp.patching.report import ReportParts
from tiledmlp.patching.state import LAYER_KIND, NORM_KIND, PatchState

__all__ = ["TILED_MLP", "FoundModules", "TiledMLPs"]


@dataclass(frozen=True)
class FoundModules:
    """Modules to tile and candidates skipped with a reason."""

    candidates: list[Candidate]
    skipped: list[tuple[str, str]] = field(default_factory=list)


class TiledMLPs(ModuleTiling):
    """Tiled MLPs (module docstring)."""

    name = "tiled_mlp"

    def owns(self, state: PatchState) -> bool:
        return state.kind not in (NORM_KIND, LAYER_KIND)

    def probe(self, model: nn.Module, config: PatchConfig, found: Found) -> FoundModules:
        del found
        return _mlp_candidates(model, hidden_size(model, config), config.generic)

    def apply(
        self, model: nn.Module, config: PatchConfig, probed: FoundModules, report: ReportParts
    ) -> None:
        notes = {c.name: replaced_note(c.module, c.path) for c in probed.candidates}
        tile_candidates(model, probed.candidates, config, report)
        report.skipped += probed.skipped
        report.native += [f"{name}: {note}" for name, note in notes.items() if note is not None]


TILED_MLP = TiledMLPs()


def _mlp_candidates(model: nn.Module, hidden: int, generic: bool) -> FoundModules:
    """The MLPs to tile and the skipped candidates; raises when nothing or something not
    understood was found (see patch_model)."""
    found = detect_mlps(model, hidden)
    candidates = list(found.candidates)
    skipped = list(found.skipped)
    if found.not_understood:
        if not generic:
            names = ", ".join(f"{n or '<root>'} ({why})" for n, why in found.not_understood)
            raise ValueError(
                f"patch_model: these modules look like MLPs but their structure is not "
                f"understood: {names}. Tiling them needs the generic path (per-tile recompute "
                "of the whole module, exact for token-wise modules): pass generic=True."
            )
        modules = dict(model.named_modules())
        candidates += [
            Candidate(n, modules[n], "generic", "custom") for n, _ in found.not_understood
        ]
    if not candidates:
        why = "".join(f"; skipped {n or '<root>'}: {r}" for n, r in skipped)
        raise ValueError(
            f"patch_model: found no MLP to tile in {type(model).__name__} (hidden size "
            f"{hidden}): expected token-wise modules with gate/up/down, fused gate_up or "
            "fc1/fc2 projections, or MoE experts. Is hidden_size right, and are the weights "
            f"materialised (not on the meta device)?{why}"
        )
    return FoundModules(candidates, skipped)
