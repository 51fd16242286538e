"""QLoRA: a Llama loaded in bitsandbytes 4-bit (NF4) with PEFT LoRA on its MLP projections
patches (MLPs on the generic path, the loss through the PEFT wrapper's causal LM) and trains
exactly like the unpatched model, on bitsandbytes' CPU backend."""

from __future__ import annotations

import logging
import tempfile

import pytest
import torch

from tiledmlp import patch_model, unpatch_model

from conftest import assert_close_rel

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes", reason="bitsandbytes (dev extra) not installed")


@pytest.fixture(scope="module")
def checkpoint() -> str:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
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
    trainable = [[p for p in m.parameters() if p.requires_grad] for m in (model, ref)]
    opts = [torch.optim.SGD(ps, lr=0.5) for ps in trainable]
    for m in (model, ref):
        m.train()
    for step in range(2):
        losses = []
        for m, opt in zip((model, ref), opts):
            opt.zero_grad()
            out = m(input_ids=ids, labels=ids)
            out.loss.backward()
            losses.append(out.loss.detach())
        assert_close_rel(losses[0], losses[1], f"step {step} loss")
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        for name, p, q in zip(names, *trainable):
            assert_close_rel(p.grad, q.grad, f"step {step} {name}.grad")
        for opt in opts:
            opt.step()
    assert "<loss>" in unpatch_model(model)
