"""What `tiledmlp train` patches when no key says otherwise: the tiled MLPs and the tiled loss.

Invariant: imports the configuration only (no torch), so the commands that describe a run
(`tiledmlp plan`'s bottom line, `train --help`) read the defaults without loading the trainer.
"""

from __future__ import annotations

from tiledmlp.config.patch import PatchConfig

__all__ = ["DEFAULT_PATCH"]

DEFAULT_PATCH = PatchConfig(tiled_loss=True)
