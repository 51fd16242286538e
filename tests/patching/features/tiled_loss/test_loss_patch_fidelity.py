"""The tiled loss reproduces what the model's own loss reads, or is refused with the reason:
a soft-cap kept in a text config, a loss that drops masked positions, a cap the patch cannot see,
return_dict=False, narrow label dtypes, softcap=0."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tiledmlp import patch_model, tiled_cross_entropy

from conftest import assert_close_rel

transformers = pytest.importorskip("transformers")

TEXT = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def _paligemma_gemma2(cap: float = 5.0) -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.PaliGemmaConfig(
        text_config={
            "model_type": "gemma2",
            **TEXT,
            "head_dim": 16,
            "final_logit_softcapping": cap,
        },
        vision_config={
            "hidden_size": 16,
            "intermediate_size": 24,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 16,
            "patch_size": 8,
        },
        image_token_index=96,
        vocab_size=97,
    )
    return transformers.PaliGemmaForConditionalGeneration(cfg).float().train()


def _loss(model: nn.Module, ids: torch.Tensor, **kw) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, **kw).loss


def test_text_config_softcap_and_hidden_size_are_read() -> None:
    ref = _paligemma_gemma2()
    # The multimodal config's own hidden_size (2048 by default) is not the decoder's.
    assert ref.config.hidden_size != ref.config.get_text_config().hidden_size
    model = copy.deepcopy(ref)
    report = patch_model(model, num_tiles=3, tiled_loss=True)
    if int(transformers.__version__.split(".")[0]) >= 5:
        assert report.loss == "tiled", report.loss
    else:
        # transformers 4.x's PaliGemma builds its attention mask from the labels too: the probe
        # sees a different loss and leaves the model's own loss in charge (still exact below).
        assert report.loss is not None and "differs" in report.loss, report.loss
    assert len(report.patched) == 2 and all("language_model" in n for n in report.patched)
    ids = torch.randint(3, 90, (2, 11), generator=torch.Generator().manual_seed(1))
    for m in (model, ref):
        with torch.no_grad():
            m.lm_head.weight.mul_(300.0)  # logits far beyond the cap
    got, want = _loss(model, ids), _loss(ref, ids)
    assert_close_rel(got.detach(), want.detach(), "loss with capped logits")
    got.backward()
    want.backward()
    assert_close_rel(model.lm_head.weight.grad, ref.lm_head.weight.grad, "lm_head grad")


class CappedLlama(transformers.LlamaForCausalLM):
    """Soft-caps its logits from an attribute the patch cannot know about."""

    def forward(self, input_ids=None, labels=None, attention_mask=None):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask)
        logits = torch.tanh(out.logits / 3.0) * 3.0
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1)
            )
        return transformers.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)


def test_probe_is_sensitive_to_a_cap_it_cannot_read() -> None:
    # At random init the logits are far below 3, so a probe at the model's own weights agrees.
    torch.manual_seed(0)
    model = CappedLlama(transformers.LlamaConfig(**TEXT))
    report = patch_model(model, tiled_loss=True)
    assert report.loss is not None and report.loss != "tiled"
    assert "large logits" in report.loss


def _qwen2_audio() -> nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen2AudioConfig(
        text_config={"model_type": "qwen2", **TEXT},
        audio_config={
            "d_model": 16,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 24,
            "num_mel_bins": 8,
            "max_source_positions": 8,
        },
        audio_token_index=96,
    )
    return transformers.Qwen2AudioForConditionalGeneration(cfg).float().train()


def test_loss_that_drops_masked_positions_is_refused_with_the_reason() -> None:
    model = _qwen2_audio()
    report = patch_model(model, tiled_loss=True)
    assert report.loss is not None and "attention mask with zeros" in report.loss, report.loss
    # The model's own loss stays in charge (and its MLPs are still tiled).
    assert report.patched and "_tiledmlp_loss_patch" not in model.__dict__


def test_return_dict_false_returns_the_models_tuple_layout() -> None:
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TEXT)).float().train()
    model = copy.deepcopy(ref)
    assert patch_model(model, num_tiles=3, tiled_loss=True).loss == "tiled"
    ids = torch.randint(0, 97, (2, 9))
    got = model(input_ids=ids, labels=ids, return_dict=False)
    want = ref(input_ids=ids, labels=ids, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want)
    assert_close_rel(got[0].detach(), want[0].detach(), "loss")
    assert got[1] is None  # where the logits would be: never materialised, positions kept
    assert type(got[2]) is type(want[2])
    # The config's return_dict=False is honoured too.
    model.config.return_dict = False
    assert isinstance(model(input_ids=ids, labels=ids), tuple)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int32, torch.int64])
def test_narrow_integer_labels(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    h = torch.randn(2, 9, 8, requires_grad=True)
    w = torch.randn(200, 8, requires_grad=True)
    labels = torch.randint(0, 200, (2, 9))
    got = tiled_cross_entropy(h, w, labels.to(dtype), num_tiles=3, shift=True)
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], 1)
    want = F.cross_entropy((h @ w.t()).reshape(-1, 200), shifted.reshape(-1))
    assert_close_rel(got.detach(), want.detach(), "loss")
    (dh,) = torch.autograd.grad(got, h)
    (ref_dh,) = torch.autograd.grad(want, h)
    assert_close_rel(dh, ref_dh, "hidden grad")


def test_softcap_zero_means_off() -> None:
    torch.manual_seed(0)
    h, w = torch.randn(9, 8), torch.randn(50, 8)
    labels = torch.randint(0, 50, (9,))
    off = tiled_cross_entropy(h, w, labels, softcap=None)
    assert torch.equal(tiled_cross_entropy(h, w, labels, softcap=0), off)
    assert torch.equal(tiled_cross_entropy(h, w, labels, softcap=0.0), off)
    with pytest.raises(ValueError, match="softcap must be positive"):
        tiled_cross_entropy(h, w, labels, softcap=-1.0)
