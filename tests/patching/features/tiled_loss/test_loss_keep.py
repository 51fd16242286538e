"""The tiled loss with `logits_to_keep` in each form transformers and frameworks pass it (None,
0, an int, 1-D and 2-D bool or index tensors): the loss and every gradient equal the unpatched
model's, the logits are never formed; a value of no known form runs the model's own loss with
one warning."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

from hf_models import VOCAB, tiny_causal_lm
from tiledmlp import patch_model
from tiledmlp.patching.patch import patch_report

from conftest import assert_close_rel

pytest.importorskip("transformers")

SEQ = 13


def _ms_swift_mask(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels, logits_to_keep) as ms-swift forms them at batch size 1: a 1-D bool mask over
    the positions that predict a labelled token (and the last), the labels of those tokens."""
    loss_mask = (labels != -100)[0]
    kept_labels = torch.nn.functional.pad(labels[:, loss_mask], (1, 0), value=-100)
    return kept_labels, torch.nn.functional.pad(loss_mask[1:], (0, 1), value=True)


def _cases() -> list[tuple[str, int, object, object]]:
    """(name, batch, logits_to_keep, labels or a function of the full labels)."""
    mask2 = torch.zeros(2, SEQ, dtype=torch.bool)
    mask2[0, 2:9] = True
    mask2[1, 5:] = True
    index2 = torch.tensor([[0, 3, 4, 12], [1, 2, 10, 11]])
    return [
        ("None", 2, None, lambda y: y),
        ("0", 2, 0, lambda y: y),
        ("an int", 2, 6, lambda y: y[:, -6:]),
        ("an int past the sequence", 2, SEQ + 4, lambda y: y),
        ("an int at batch 1 (ms-swift)", 1, 9, lambda y: y[:, -9:]),
        ("a 1-D bool mask at batch 1 (ms-swift)", 1, "ms-swift", None),
        ("a 1-D bool tensor of all True", 1, torch.ones(SEQ, dtype=torch.bool), lambda y: y),
        ("a 1-D index tensor", 2, torch.tensor([1, 4, 5, 12]), lambda y: y[:, [1, 4, 5, 12]]),
        ("a 2-D bool tensor", 2, mask2, lambda y: y[mask2].unsqueeze(0)),
        ("a 2-D index tensor", 2, index2, lambda y: torch.take_along_dim(y, index2, dim=1)),
    ]


def _step(model, **inputs):
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


@pytest.fixture(scope="module")
def pair():
    ref = tiny_causal_lm("llama")
    model = copy.deepcopy(ref)
    report = patch_model(model, num_tiles=3, tiled_loss=True)
    assert report.loss == "tiled"
    return ref, model


@pytest.mark.parametrize(
    ("name", "batch", "keep", "labels_of"), _cases(), ids=[case[0] for case in _cases()]
)
def test_each_form_is_tiled_exactly(pair, name, batch, keep, labels_of) -> None:
    ref, model = pair
    torch.manual_seed(0)
    ids = torch.randint(3, VOCAB, (batch, SEQ))
    full = ids.clone()
    full[0, :4] = -100
    full[-1, 7] = -100
    if keep == "ms-swift":
        labels, keep = _ms_swift_mask(full)
    else:
        labels = labels_of(full)
    out, grads = _step(model, input_ids=ids, labels=labels, logits_to_keep=keep)
    ref_out, ref_grads = _step(ref, input_ids=ids, labels=labels, logits_to_keep=keep)
    assert out.logits is None, f"{name}: the logits were formed"
    assert_close_rel(out.loss.detach(), ref_out.loss.detach(), f"{name}: loss")
    assert grads.keys() == ref_grads.keys()
    for param in grads:
        assert_close_rel(grads[param], ref_grads[param], f"{name}: {param}")


def test_num_items_and_shift_labels_with_kept_positions(pair) -> None:
    ref, model = pair
    ids = torch.randint(3, VOCAB, (2, SEQ))
    n = torch.tensor(9)
    kw = {"input_ids": ids, "labels": ids[:, -5:], "logits_to_keep": 5, "num_items_in_batch": n}
    out, grads = _step(model, **kw)
    ref_out, ref_grads = _step(ref, **kw)
    assert out.logits is None
    assert_close_rel(out.loss.detach(), ref_out.loss.detach(), "loss (sum / num_items)")
    for param in grads:
        assert_close_rel(grads[param], ref_grads[param], param)
    shifted = torch.randint(0, VOCAB, (2, 5))
    kw = {"input_ids": ids, "labels": ids[:, -5:], "shift_labels": shifted, "logits_to_keep": 5}
    assert_close_rel(model(**kw).loss.detach(), ref(**kw).loss.detach(), "with shift_labels")


def test_labels_of_another_length_are_refused_in_one_line(pair) -> None:
    _, model = pair
    ids = torch.randint(3, VOCAB, (2, SEQ))
    with pytest.raises(ValueError, match=r"keeps 8 position\(s\) but the labels hold 26"):
        model(input_ids=ids, labels=ids, logits_to_keep=4)


def test_a_value_of_no_known_form_runs_the_models_own_loss_and_warns_once(
    pair, caplog: pytest.LogCaptureFixture
) -> None:
    ref, model = pair
    ids = torch.randint(3, VOCAB, (2, SEQ))
    keep = torch.tensor(SEQ - 1)  # a 0-d tensor: none of transformers' forms
    labels = ids[:, 5]  # (batch,): one logit row per sequence, the first scored
    with caplog.at_level(logging.WARNING, logger="tiledmlp.patching.features.tiled_loss"):
        out = model(input_ids=ids, labels=labels, logits_to_keep=keep)
        model(input_ids=ids, labels=labels, logits_to_keep=keep)
    told = [r for r in caplog.records if "runs the model's own loss" in r.getMessage()]
    assert len(told) == 1, [r.getMessage() for r in caplog.records]
    assert "a 0-D torch.int64 tensor" in told[0].getMessage()
    assert out.logits is not None  # the model's own forward ran
    ref_loss = ref(input_ids=ids, labels=labels, logits_to_keep=keep).loss
    assert_close_rel(out.loss.detach(), ref_loss.detach(), "loss")


def _old_style_llama():
    """A Llama whose forward slices as transformers 4.5x's causal LMs (and the remote code
    written after them) did: hidden[:, keep, :] for any tensor, which for a 2-D tensor selects
    other positions than slice_logits_to_keep (and fails for a 2-D bool mask)."""
    import transformers as tr

    class OldStyleLlama(tr.LlamaForCausalLM):
        def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
            num_items = kwargs.pop("num_items_in_batch", None)
            hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            rows = (
                slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            )
            logits = self.lm_head(hidden[:, rows, :])
            loss = None
            if labels is not None:
                loss = self.loss_function(
                    logits=logits, labels=labels, vocab_size=VOCAB, num_items_in_batch=num_items
                )
            return tr.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)

    ref = tiny_causal_lm("llama")
    model = OldStyleLlama(ref.config)
    model.load_state_dict(ref.state_dict())
    return model.train()


def test_a_model_that_slices_otherwise_keeps_its_own_loss_for_that_form(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ref = _old_style_llama()
    model = copy.deepcopy(ref)
    with caplog.at_level(logging.DEBUG, logger="tiledmlp.patching.features.tiled_loss"):
        report = patch_model(model, tiled_loss=True, num_tiles=2)
    # the report says what a run will do: forms no framework passes, and the probe's
    # exceptions, are in the debug log only
    assert report.loss == "tiled" and "Error" not in str(report)
    assert patch_report(model).loss == report.loss
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    for form in ("a 2-D bool tensor", "a 2-D index tensor"):
        assert any(f"as {form} runs the model's own loss, whose forward fails" in m and "Error"
                   in m for m in debug), debug  # fmt: skip
    caplog.clear()
    ids = torch.randint(3, VOCAB, (2, SEQ))
    out, grads = _step(model, input_ids=ids, labels=ids[:, -4:], logits_to_keep=4)
    ref_out, ref_grads = _step(ref, input_ids=ids, labels=ids[:, -4:], logits_to_keep=4)
    assert out.logits is None  # an int: tiled
    assert_close_rel(out.loss.detach(), ref_out.loss.detach(), "loss (an int)")
    for param in grads:
        assert_close_rel(grads[param], ref_grads[param], param)
    index = torch.tensor([[0, 3, 4, 12], [1, 2, 10, 11]])
    with caplog.at_level(logging.WARNING, logger="tiledmlp.patching.features.tiled_loss"):
        for _ in range(2):  # the model's own forward runs, and fails as without the patch
            with pytest.raises(ValueError, match="Expected input batch_size"):
                model(input_ids=ids, labels=ids[:, :4], logits_to_keep=index)
    told = [r.getMessage() for r in caplog.records if "own loss" in r.getMessage()]
    assert len(told) == 1 and "a 2-D index tensor" in told[0] and "fails with it too" in told[0]


def test_a_form_frameworks_pass_that_runs_the_models_own_loss_is_in_the_report() -> None:
    import transformers as tr

    class FirstPositions(tr.LlamaForCausalLM):
        """Keeps the FIRST k positions for an int (transformers keeps the last k)."""

        def forward(self, input_ids=None, labels=None, logits_to_keep=0, **kwargs):
            num_items = kwargs.pop("num_items_in_batch", None)
            hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            if isinstance(logits_to_keep, int) and logits_to_keep > 0:
                hidden = hidden[:, :logits_to_keep, :]
            logits = self.lm_head(hidden)
            loss = None
            if labels is not None:
                loss = self.loss_function(
                    logits=logits, labels=labels, vocab_size=VOCAB, num_items_in_batch=num_items
                )
            return tr.modeling_outputs.CausalLMOutputWithPast(loss=loss, logits=logits)

    ref = tiny_causal_lm("llama")
    model = FirstPositions(ref.config)
    model.load_state_dict(ref.state_dict())
    report = patch_model(model.train(), tiled_loss=True, num_tiles=2)
    assert report.loss == (
        "tiled, except calls with logits_to_keep as an int: the model keeps other positions "
        "than transformers' slice_logits_to_keep (these run the model's own loss)"
    )
