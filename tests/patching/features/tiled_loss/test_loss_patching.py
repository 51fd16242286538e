"""patch_model(tiled_loss=True): Hugging Face causal LMs compute their training loss through
tiled_cross_entropy (logits never materialised); outputs without labels are unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_models import FAMILIES, VOCAB, tiny_causal_lm
from tiledmlp import patch_model, unpatch_model

from conftest import assert_close_rel

pytest.importorskip("transformers")

DENSE = [f for f in FAMILIES if f != "qwen3_moe"]


def _labels(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[0, :9] = -100  # a whole tile of ignored tokens, and padding-like prefixes
    return labels


def _step(model, ids, labels, **kw):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.mark.parametrize("family", DENSE)
def test_loss_and_grads_match_and_logits_never_exist(family: str) -> None:
    ref = tiny_causal_lm(family)
    model = copy.deepcopy(ref)
    report = patch_model(model, num_tiles=3, tiled_loss=True)
    assert report.loss == "tiled"
    ids = torch.randint(3, VOCAB, (2, 23))
    out, grads = _step(model, ids, _labels(ids))
    ref_out, ref_grads = _step(ref, ids, _labels(ids))
    assert out.logits is None
    assert_close_rel(out.loss.detach(), ref_out.loss.detach(), "loss")
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert_close_rel(grads[name], ref_grads[name], name)


def test_outputs_without_labels_are_unchanged() -> None:
    ref = tiny_causal_lm("gemma2")  # with final-logit soft-capping
    model = copy.deepcopy(ref)
    patch_model(model, tiled_loss=True)
    ids = torch.randint(3, VOCAB, (2, 9))
    assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_num_items_in_batch_and_shift_labels_like_hugging_face() -> None:
    ref = tiny_causal_lm("llama")
    model = copy.deepcopy(ref)
    patch_model(model, tiled_loss=True, num_tiles=4)
    ids = torch.randint(3, VOCAB, (2, 17))
    n = torch.tensor(20)
    out, grads = _step(model, ids, ids, num_items_in_batch=n)
    ref_out, ref_grads = _step(ref, ids, ids, num_items_in_batch=n)
    assert_close_rel(out.loss.detach(), ref_out.loss.detach(), "loss (sum / num_items)")
    for name in grads:
        assert_close_rel(grads[name], ref_grads[name], name)
    shifted = torch.randint(0, VOCAB, (2, 17))
    a = model(input_ids=ids, labels=ids, shift_labels=shifted).loss
    b = ref(input_ids=ids, labels=ids, shift_labels=shifted).loss
    assert_close_rel(a.detach(), b.detach(), "loss with shift_labels")


def test_moe_aux_loss_is_added_to_the_tiled_loss_exactly() -> None:
    ref = tiny_causal_lm("qwen3_moe")  # output_router_logits=True: its loss adds the aux loss
    model = copy.deepcopy(ref)
    report = patch_model(model, tiled_loss=True, num_tiles=3)
    assert report.loss == "tiled"
    assert report.patched  # the experts are tiled too
    ids = torch.randint(3, VOCAB, (2, 23))
    out, grads = _step(model, ids, _labels(ids))
    ref_out, ref_grads = _step(ref, ids, _labels(ids))
    assert out.logits is None and ref_out.aux_loss is not None
    assert_close_rel(out.aux_loss.detach(), ref_out.aux_loss.detach(), "aux_loss")
    assert_close_rel(out.loss.detach(), ref_out.loss.detach(), "loss")
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert_close_rel(grads[name], ref_grads[name], name)


def test_unpatch_restores_the_model_forward() -> None:
    model = tiny_causal_lm("llama")
    patch_model(model, tiled_loss=True)
    assert "forward" in model.__dict__
    assert "<loss>" in unpatch_model(model)
    assert "forward" not in model.__dict__
    ids = torch.randint(3, VOCAB, (2, 9))
    assert model(input_ids=ids, labels=ids).logits is not None


def test_loss_only_patching_leaves_the_mlps_alone() -> None:
    ref = tiny_causal_lm("llama")
    model = copy.deepcopy(ref)
    report = patch_model(model, tiled_mlp=False, tiled_loss=True, num_tiles=3)
    assert report.patched == [] and report.loss == "tiled"
    assert all("forward" not in m.__dict__ for m in model.modules() if m is not model)
    assert "_tiledmlp_agreement" not in model.__dict__  # no per-step collective for MLP tiles
    ids = torch.randint(3, VOCAB, (2, 23))
    out, grads = _step(model, ids, _labels(ids))
    ref_out, ref_grads = _step(ref, ids, _labels(ids))
    assert out.logits is None
    assert_close_rel(out.loss.detach(), ref_out.loss.detach(), "loss")
    for name in grads:
        assert_close_rel(grads[name], ref_grads[name], name)
    assert unpatch_model(model) == ["<loss>"]


def test_loss_only_patching_needs_something_to_do() -> None:
    with pytest.raises(ValueError, match="nothing to do with tiled_mlp=False"):
        patch_model(tiny_causal_lm("llama"), tiled_mlp=False)
