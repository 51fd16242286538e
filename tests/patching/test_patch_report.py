"""What patch_model tells: norms counted as norms, a fresh report after PEFT changed the model,
and the offloading message that a Trainer user can act on."""

from __future__ import annotations

import pytest
import torch

import tiledmlp
from hf_models import tiny_causal_lm
from tiledmlp.patching import patch_report


def test_report_counts_norms_apart_from_mlps() -> None:
    report = tiledmlp.patch_model(tiny_causal_lm("llama"), tiled_norms=True)
    assert str(report).splitlines()[0].startswith("tiled 2 MLP(s) and 5 norm(s) with ")


def test_patch_report_describes_the_model_as_it_is_now() -> None:
    peft = pytest.importorskip("peft")
    model = tiny_causal_lm("llama")
    assert patch_report(model) is None
    report = tiledmlp.patch_model(model, tiled_loss=True)
    assert report.paths["model.layers.0.mlp"] == "fast: gated"
    wrapped = peft.get_peft_model(model, peft.LoraConfig(target_modules=["gate_proj", "up_proj"]))
    now = patch_report(wrapped)
    assert now is not None and now.loss == "tiled"
    assert now.paths["base_model.model.model.layers.0.mlp"].startswith("generic: changed")
    ids = torch.randint(3, 97, (1, 8))
    wrapped(input_ids=ids, labels=ids).loss.backward()  # and it trains on that path


def test_offloading_error_tells_trainer_users_the_arguments() -> None:
    model = tiny_causal_lm("llama")
    tiledmlp.patch_model(model, activation_offloading=True)
    ids = torch.randint(3, 97, (1, 8))
    with pytest.raises(
        ValueError,
        match=r"TrainingArguments\(gradient_checkpointing=True, "
        r"gradient_checkpointing_kwargs=\{'use_reentrant': False\}\)",
    ):
        model(input_ids=ids, labels=ids)
