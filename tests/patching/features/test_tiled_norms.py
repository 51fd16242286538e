"""patch_model(tiled_norms=True): every LayerNorm/RMSNorm over the hidden size takes the generic
tiled path, exactly, alone and with checkpointing + offloading, and unpatches."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_models import VOCAB, tiny_causal_lm
from tiledmlp import patch_model, unpatch_model
from tiledmlp.patching.features.activation_offloading import enable_checkpointing

from conftest import assert_same_sgd_steps


def _ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(3, VOCAB, (2, 19), generator=g)


@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3", "gpt_neox"])
def test_tiled_norms_train_exactly_like_untiled(family: str) -> None:
    model = tiny_causal_lm(family)
    ref = copy.deepcopy(model)
    report = patch_model(model, num_tiles=3, tiled_loss=True, tiled_norms=True)
    norms = [n for n in report.patched if report.paths[n] == "generic: norm"]
    layers = model.config.num_hidden_layers
    per_layer = 4 if family == "gemma3" else 2  # Gemma-3: pre/post norms around both blocks
    assert len(norms) == per_layer * layers + 1  # and the final norm
    assert not any("q_norm" in n or "k_norm" in n for n in norms)  # per-head norms stay
    assert_same_sgd_steps(model, ref, _ids())


def test_tiled_norms_with_checkpointing_and_offloading_are_exact() -> None:
    model = tiny_causal_lm("llama")
    ref = copy.deepcopy(model)
    for m in (model, ref):
        enable_checkpointing(m)
    patch_model(model, num_tiles=3, tiled_loss=True, activation_offloading=True, tiled_norms=True)
    assert_same_sgd_steps(model, ref, _ids())


def test_unpatch_restores_the_norms() -> None:
    model = tiny_causal_lm("llama")
    report = patch_model(model, num_tiles=2, tiled_norms=True)
    restored = unpatch_model(model)
    assert set(report.patched) <= set(restored)
    assert all("forward" not in m.__dict__ for m in model.modules())
