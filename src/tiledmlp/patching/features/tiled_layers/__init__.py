"""The tiled decoder layers feature (tiled_layers=True): the token-wise rest of each decoder
layer (norms, projections, rotary, residuals, MLP around the attention core) runs in tiles.

    recognise.py         finding decoder layers, recognising one (structure and probe),
                         installing the tiled forward
    blocks.py            a recognised layer as two token-wise blocks around its attention call
    latent_attention.py  the pre-attention block of multi-head latent attention
    forward.py           the forward installed on a tiled layer

This module is the door: the feature, and what other code needs of tiled layers
(decoder_layers, layer_parts, LAYER: the key of a layer's recognised parts).

Probe: every decoder layer found by structure must be recognised (recognise.py's layer_parts: on
real values it compares the layer's forward with the tiled blocks; on fake or meta parameters it
only records how the layer calls its attention, so the planner probes this feature too). Apply:
the tiled layer forward on each, from the recognised parts.

Invariant: either every decoder layer is tiled, or kept whole for its own token mixer (a hybrid
stack's linear-attention layers, reported as skipped, with at least one layer tiled), or
patch_model refuses (one line naming the first layer that is not recognised).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tiledmlp.config.patch import PatchConfig
from tiledmlp.patching.agreement import step_tokens
from tiledmlp.patching.features.base import Found
from tiledmlp.patching.features.tiled_layers.forward import tiled_layer_forward
from tiledmlp.patching.features.tiled_layers.recognise import (
    LAYER,
    decoder_layers,
    install_layer,
    layer_parts,
    own_mixer,
)
from tiledmlp.patching.features.tiled_modules import ModuleTiling
from tiledmlp.patching.report import ReportParts
from tiledmlp.patching.state import LAYER_KIND, PatchState

__all__ = ["LAYER", "TILED_LAYERS", "TiledLayers", "decoder_layers", "layer_parts"]

#: (qualified name, the layer, its recognised parts)
FoundLayers = list[tuple[str, nn.Module, Any]]


class TiledLayers(ModuleTiling):
    """Tiled decoder layers (module docstring)."""

    name = "tiled_layers"
    removed_keys = (LAYER,)
    installed_forward = staticmethod(tiled_layer_forward)

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
        out: FoundLayers = []
        kept: FoundLayers = []
        for name, layer in layers:
            own = None if LAYER in layer.__dict__ else own_mixer(layer)
            if own is not None:
                kept.append((name, layer, own))
                continue
            parts = layer.__dict__.get(LAYER) or _recognised(layer)
            if isinstance(parts, str):
                raise ValueError(
                    f"patch_model: tiled_layers cannot tile {name} ({type(layer).__name__}): "
                    f"{parts}; drop tiled_layers (the MLPs, norms and loss can still be tiled)"
                )
            out.append((name, layer, parts))
        if kept and not out:
            name, layer, why = kept[0]
            raise ValueError(
                f"patch_model: tiled_layers cannot tile any decoder layer of "
                f"{type(model).__name__} ({name}: {why}); drop tiled_layers"
            )
        return out + kept

    def apply(
        self, model: nn.Module, config: PatchConfig, probed: FoundLayers, report: ReportParts
    ) -> None:
        tiled = [
            (name, layer, parts) for name, layer, parts in probed if not isinstance(parts, str)
        ]
        if tiled:
            step = step_tokens(model)
            for _, layer, parts in tiled:
                install_layer(layer, parts, config.mlp_config, step)
        report.paths.update({name: f"generic: {LAYER_KIND}" for name, _, _ in tiled})
        report.skipped += [(name, why) for name, _, why in probed if isinstance(why, str)]


def _recognised(layer: nn.Module) -> Any:
    """layer_parts(layer), or why recognising the layer failed: an exception nobody foresaw in
    a family's layer becomes a one-line refusal naming it, never a traceback of patch_model."""
    try:
        return layer_parts(layer)
    except Exception as e:  # any family's layer may hold something unforeseen
        first = (str(e).strip().splitlines() or [""])[0][:160]
        return f"recognising it failed ({type(e).__name__}: {first})"


TILED_LAYERS = TiledLayers()
