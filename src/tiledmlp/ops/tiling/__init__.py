"""What every tiled op shares: tile plans and policies, per-parameter gradient accumulators, the
state carried into a tile's recompute, the guards of a tiled backward, probes on stand-in tensors,
the engine-backend object and the checks of plain values.

Invariant: nothing here knows which op it serves; the ops import it, never the reverse.
"""
