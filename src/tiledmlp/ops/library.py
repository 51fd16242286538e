"""The tiled ops' PyTorch custom operators (namespace `tiledmlp`), listed in one place.

`torch.compile` cannot trace the tiled ops' autograd Functions (their tile loops, Python-side
plans and anchors), so a compiled model reaches them through custom operators instead: each has
a fake (meta) implementation, so dynamo and AOTAutograd see its output shapes without running it,
and an autograd formula whose backward is itself a custom operator, so the compiled backward
graph calls the same tile loop as the eager backward. Eager code keeps calling the autograd
Functions; the operators run the same tile math.

    tiledmlp::mlp              the recognised MLP (gated, fused gated, plain), forward
    tiledmlp::mlp_backward     its backward: d(x) and every weight's gradient, each once
                               (both in ops/mlp/operator.py)
    tiledmlp::lm_head_loss     the tiled LM-head cross-entropy reduced by "mean" / "sum"
                               (ops/loss/operator.py)

Traced instead, by decision (tests/ops/test_library.py holds each): the tiled norms (the
generic path's per-tile checkpoints, any norm class; the compiled step saves only the norm's
input and weight) and the attention core by heads (its autograd Function, traced group by
group; its plan is not traceable: patching/attention_core.py).

Each operator is defined beside its op, whose compiled path imports it; importing this module
registers them all. Invariant: an operator takes tensors, ints, floats, bools, strings and lists
of them (the tile plan is a list of split sizes, computed once by the caller); nothing else
registers into the namespace.
"""

from __future__ import annotations

from typing import Any

from tiledmlp.ops.loss.operator import lm_head_loss
from tiledmlp.ops.mlp.operator import mlp, mlp_backward

__all__ = ["OPS", "lm_head_loss", "mlp", "mlp_backward"]

#: every operator in the `tiledmlp` namespace
OPS: tuple[Any, ...] = (mlp, mlp_backward, lm_head_loss)
