"""The reference MLP modules, at their old import path (they live in tiledmlp.models.mlps)."""

from tiledmlp.models.mlps import FusedGatedMLP, GatedMLP, PlainMLP

__all__ = ["FusedGatedMLP", "GatedMLP", "PlainMLP"]
