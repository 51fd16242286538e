"""Model patching: find the MLPs of a model by structure and make them tiled, reversibly.

Patching swaps behaviour on module instances (an instance-level forward), never on classes;
state_dict keys and values are untouched; unpatch_model restores the original forwards exactly.
"""

from tiledmlp.patching.args import patch_from_args
from tiledmlp.patching.patch import (
    PatchReport,
    patch_model,
    patch_report,
    tile_counts,
    unpatch_model,
)

__all__ = [
    "PatchReport",
    "patch_from_args",
    "patch_model",
    "patch_report",
    "tile_counts",
    "unpatch_model",
]
