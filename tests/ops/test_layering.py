"""Layering: the ops import torch only; the structure probe never mistakes a look-alike."""

from __future__ import annotations

import subprocess
import sys

import torch

from tiledmlp import tiled_mlp
from tiledmlp.ops import recognise

from conftest import assert_same_grads, grads_of
from generic_modules import WeirdGated


def test_importing_tiledmlp_loads_no_transformers_or_deepspeed() -> None:
    code = (
        "import sys, tiledmlp, tiledmlp.ops; "
        "bad = [m for m in ('transformers', 'deepspeed', 'peft') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_look_alike_takes_generic_path_and_stays_exact() -> None:
    # Same child names and shapes as a SwiGLU MLP, different forward: the probe must refuse it.
    mlp = WeirdGated(16, 24)
    assert recognise(mlp) is None
    x = torch.randn(2, 9, 16, requires_grad=True)
    dy = torch.randn(2, 9, 16)
    assert_same_grads(
        grads_of(lambda t: tiled_mlp(mlp, t, num_tiles=3), mlp, x, [dy]),
        grads_of(mlp, mlp, x, [dy]),
    )


def test_swapped_children_are_re_recognised() -> None:
    from tiledmlp.models.mlps import GatedMLP

    mlp = GatedMLP(16, 24)
    assert recognise(mlp) is not None
    mlp.act_fn = torch.nn.Sequential(torch.nn.SiLU(), torch.nn.Dropout(0.5))
    assert recognise(mlp) is None  # new child: re-derived, not served from the cache
