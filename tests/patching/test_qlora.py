"""QLoRA: a Llama loaded in bitsandbytes 4-bit (NF4) with PEFT LoRA on its MLP projections
patches (MLPs on the generic path, the loss through the PEFT wrapper's causal LM) and trains
exactly like the unpatched model, on bitsandbytes' CPU backend."""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch

from hf_models import BASE
from tiledmlp import patch_model, unpatch_model

from conftest import assert_same_sgd_steps

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes", reason="bitsandbytes (dev extra) not installed")


@pytest.fixture(scope="module")
def checkpoint() -> str:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{**BASE, "hidden_size": 64, "intermediate_size": 96})
    path = tempfile.mkdtemp(prefix="tiledmlp-qlora-")
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def _qlora(path: str) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_compute_dtype=torch.float32,
        llm_int8_skip_modules=["lm_head"],
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=quant, device_map="cpu", dtype=torch.float32
    )
    torch.manual_seed(5)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,
    )
    return get_peft_model(base, lora)


def test_qlora_llama_patches_and_trains_exactly(checkpoint: str) -> None:
    ref, model = _qlora(checkpoint), _qlora(checkpoint)
    mlp = model.base_model.model.model.layers[0].mlp
    assert type(mlp.gate_proj.base_layer).__name__ == "Linear4bit"
    assert mlp.gate_proj.base_layer.weight.dtype == torch.uint8  # really quantised
    # Patched right after from_pretrained (eval mode), as users do.
    report = patch_model(model, num_tiles=3, tiled_loss=True)
    assert set(report.paths.values()) == {"generic: lora-wrapped MLP"}, report
    assert report.loss == "tiled", report.loss
    ids = torch.randint(3, 97, (2, 13), generator=torch.Generator().manual_seed(1))
    for m in (model, ref):
        m.train()
    assert_same_sgd_steps(model, ref, ids)
    assert "<loss>" in unpatch_model(model)
