"""unsloth: the documented route (patch_model on the model unsloth returns, after its own
patches) trains a step exactly like unsloth alone, with the logits never formed.

unsloth needs a CUDA GPU (it refuses to import without one) and is not part of the dev install:
the test is marked gpu (skipped without a CUDA device, tests/conftest.py) and skipped where
unsloth is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


def _step(
    model: torch.nn.Module, ids: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def test_patch_after_unsloth_equals_unsloth_alone(tmp_path: Path) -> None:
    if not torch.cuda.is_available():  # the gpu marker skips first; this keeps the import safe
        pytest.skip("gpu: needs a CUDA device")
    unsloth = pytest.importorskip("unsloth", reason="unsloth is not installed")
    import transformers as tr

    import tiledmlp

    torch.manual_seed(0)
    cfg = tr.LlamaConfig(
        vocab_size=512, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    tr.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    model, _ = unsloth.FastLanguageModel.from_pretrained(
        str(tmp_path / "model"), max_seq_length=256, dtype=torch.float32, load_in_4bit=False
    )
    model = unsloth.FastLanguageModel.get_peft_model(
        model, r=4, lora_alpha=8, lora_dropout=0, bias="none",
        target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
    )  # fmt: skip
    model.train()
    ids = torch.randint(0, 512, (2, 192), device="cuda")
    ref_loss, ref_grads = _step(model, ids)

    report = tiledmlp.patch_model(model, tiled_loss=True, num_tiles=3)
    assert report.loss == "tiled", report
    loss, grads = _step(model, ids)
    assert model(input_ids=ids, labels=ids).logits is None  # the tiled loss
    counts = tiledmlp.patching.tile_counts(model)
    assert counts and all(c.last == 3 for c in counts.values()), counts
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
