"""The tiled decoder layers feature (tiled_layers=True): the token-wise rest of each decoder
layer (norms, projections, rotary, residuals, MLP around the attention core) runs in tiles
(patching/layers.py).

Probe: every decoder layer found by structure must be recognised (layers.py's layer_parts: on
real values it compares the layer's forward with the tiled blocks; on fake or meta parameters it
only records how the layer calls its attention, so the planner probes this feature too). Apply:
the tiled layer forward on each, from the recognised parts.

Invariant: either every decoder layer is tiled or patch_model refuses (one line naming the
first layer that is not recognised).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.patching.agreement import step_tokens
from tiledmlp.patching.features.base import Found
from tiledmlp.patching.features.tiled_modules import ModuleTiling
from tiledmlp.patching.layers import LAYER, LAYER_KIND, decoder_layers, install_layer, layer_parts
from tiledmlp.patching.report import ReportParts
from tiledmlp.patching.state import PatchState

__all__ = ["TILED_LAYERS", "TiledLayers"]

#: (qualified name, the layer, its recognised parts)
FoundLayers = list[tuple[str, nn.Module, Any]]


class TiledLayers(ModuleTiling):
    """Tiled decoder layers (module docstring)."""

    name = "tiled_layers"
    removed_keys = (LAYER,)

    def owns(self, state: PatchState) -> bool:
        return state.kind == LAYER_KIND

    def probe(self, model: nn.Module, config: PatchConfig, found: Found) -> FoundLayers:
        del config, found
        layers = decoder_layers(model)
        if not layers:
            raise ValueError(
                f"patch_model: tiled_layers=True but {type(model).__name__} has no decoder "
                "layers (modules with an attention and an MLP child); drop tiled_layers"
            )
        out = []
        for name, layer in layers:
            parts = layer.__dict__.get(LAYER) or _recognised(layer)
            if isinstance(parts, str):
                raise ValueError(
                    f"patch_model: tiled_layers cannot tile {name} ({type(layer).__name__}): "
                    f"{parts}; only Llama-family decoder layers are tiled, drop tiled_layers "
                    "(the MLPs, norms and loss can still be tiled)"
                )
            out.append((name, layer, parts))
        return out

    def apply(
        self, model: nn.Module, config: PatchConfig, probed: FoundLayers, report: ReportParts
    ) -> None:
        if probed:
            step = step_tokens(model)
            for _, layer, parts in probed:
                install_layer(layer, parts, config.mlp_config, step)
        report.paths.update({name: f"generic: {LAYER_KIND}" for name, _, _ in probed})


def _recognised(layer: nn.Module) -> Any:
    """layer_parts(layer), or why recognising the layer failed: an exception nobody foresaw in
    a family's layer becomes a one-line refusal naming it, never a traceback of patch_model."""
    try:
        return layer_parts(layer)
    except Exception as e:  # any family's layer may hold something unforeseen
        first = (str(e).strip().splitlines() or [""])[0][:160]
        return f"recognising it failed ({type(e).__name__}: {first})"


TILED_LAYERS = TiledLayers()
