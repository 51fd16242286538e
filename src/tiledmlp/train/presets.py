"""The model presets, at their old import path (they live in tiledmlp.models.presets)."""

from tiledmlp.models.presets import FINE_TUNE_LR, PRESETS, build_preset, default_learning_rate

__all__ = ["FINE_TUNE_LR", "PRESETS", "build_preset", "default_learning_rate"]
