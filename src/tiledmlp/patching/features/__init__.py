"""The features of patch_model, one home each, in the order they are applied.

    activation_offloading.py   checkpointed layer inputs to host memory
    tiled_mlp.py               the MLPs through tiled_mlp (found by structure, probed)
    tiled_norms.py             the norms over the hidden size through the generic path
    tiled_layers/              the token-wise rest of each decoder layer
    attention_kernel.py        each decoder layer's attention kernel (around its forward)
    tiled_loss/                the training loss through tiled_cross_entropy
    sequence_parallel.py       Ulysses attention over P ranks

Each implements base.Feature (probe / apply / remove / describe); tiled_modules.py holds what
the three module-tiling features share. A feature's module (a sub-package's __init__) holds
its implementation or is the only door to it: code elsewhere imports a feature's pieces from
there, never from the files behind it. patch_model probes then applies them in this order,
unpatch_model removes them in the reverse order, patch_report asks each to describe itself.

Invariant: the order is the one the root's forward hooks need: offloading's pre-hook before
the per-step token agreement (installed with the first tiled module), sequence parallelism's
checks installed last (they put themselves before every other pre-hook); the attention kernel
after the tiled layers, around the forward they install.
"""

from tiledmlp.patching.features.activation_offloading import ACTIVATION_OFFLOADING
from tiledmlp.patching.features.attention_kernel import ATTENTION_KERNEL
from tiledmlp.patching.features.base import Feature, Found
from tiledmlp.patching.features.sequence_parallel import SEQUENCE_PARALLEL
from tiledmlp.patching.features.tiled_layers import TILED_LAYERS
from tiledmlp.patching.features.tiled_loss import TILED_LOSS
from tiledmlp.patching.features.tiled_mlp import TILED_MLP
from tiledmlp.patching.features.tiled_norms import TILED_NORMS

__all__ = ["FEATURES", "Feature", "Found"]

FEATURES: tuple[Feature, ...] = (
    ACTIVATION_OFFLOADING,
    TILED_MLP,
    TILED_NORMS,
    TILED_LAYERS,
    ATTENTION_KERNEL,
    TILED_LOSS,
    SEQUENCE_PARALLEL,
)
