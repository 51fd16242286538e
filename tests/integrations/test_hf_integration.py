"""One switch for any stack (tiledmlp.enable), the Trainer callback, and evaluation under the
tiled loss: real transformers models, the real Trainer, nothing mocked."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import tiledmlp  # noqa: E402
from tiledmlp.integrations import hf  # noqa: E402

from conftest import assert_close_rel  # noqa: E402

_CFG = dict(
    vocab_size=258, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
)  # fmt: skip


def _model() -> Any:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_CFG))


@pytest.fixture
def switch() -> Any:
    yield tiledmlp.enable
    tiledmlp.disable()


def test_enable_patches_every_causal_lm_built_after(switch: Any, tmp_path: Any) -> None:
    from transformers import AutoModel, AutoModelForCausalLM, PreTrainedModel

    before = {n: PreTrainedModel.__dict__[n] for n in ("from_pretrained", "_from_config")}
    _model().save_pretrained(tmp_path)
    switch(tiled_loss=True, num_tiles=2)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    built = AutoModelForCausalLM.from_config(transformers.LlamaConfig(**_CFG))
    for model in (loaded, built):
        assert hf.is_patched(model)
        assert tiledmlp.patching.tile_counts(model)  # the MLPs
        ids = torch.randint(3, 258, (2, 9))
        assert model(input_ids=ids, labels=ids).logits is None  # the tiled loss
    assert not hf.is_patched(AutoModel.from_pretrained(tmp_path))  # no LM head: left alone
    tiledmlp.disable()
    assert {n: PreTrainedModel.__dict__[n] for n in before} == before
    assert not hf.is_patched(AutoModelForCausalLM.from_pretrained(tmp_path))


def test_enable_checks_its_options_now(switch: Any) -> None:
    with pytest.raises(TypeError, match=r"unknown option.*tiled_los"):
        switch(tiled_los=True)
    assert hf.enabled() is None


def _train(tmp: str, callbacks: list[Any]) -> tuple[list[float], Any]:
    ids = torch.randint(3, 258, (8, 16), generator=torch.Generator().manual_seed(1))
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = transformers.TrainingArguments(
        tmp, max_steps=3, per_device_train_batch_size=4, logging_steps=1, report_to=[],
        use_cpu=True, optim="sgd", learning_rate=0.1, save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    model = _model()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=ds, callbacks=callbacks)
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e], model


@pytest.mark.slow  # two Trainer runs
def test_trainer_callback_patches_and_trains_the_same(tmp_path: Any) -> None:
    callback = hf.TiledMLPCallback(tiled_loss=True)
    losses, model = _train(str(tmp_path / "a"), [callback])
    ref_losses, ref_model = _train(str(tmp_path / "b"), [])
    assert callback.report is not None and callback.report.loss == "tiled"
    assert hf.is_patched(model)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert_close_rel(p.detach(), q.detach(), name)


def test_compute_metrics_gets_argmax_predictions_under_the_tiled_loss(tmp_path: Any) -> None:
    ids = torch.randint(3, 258, (6, 12), generator=torch.Generator().manual_seed(2))
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    seen: dict[str, Any] = {}

    def metrics(p: Any) -> dict[str, float]:
        seen["predictions"] = p.predictions
        return {"n": float(p.predictions.size)}

    def evaluate(callbacks: list[Any], preprocess: Any) -> dict[str, float]:
        args = transformers.TrainingArguments(
            str(tmp_path), report_to=[], use_cpu=True, per_device_eval_batch_size=4
        )
        trainer = transformers.Trainer(
            model=_model(), args=args, eval_dataset=ds, compute_metrics=metrics,
            preprocess_logits_for_metrics=preprocess, callbacks=callbacks,
        )  # fmt: skip
        return trainer.evaluate()

    ref = evaluate([], lambda logits, labels: logits.argmax(-1))
    want = seen.pop("predictions")
    got = evaluate([hf.TiledMLPCallback(tiled_loss=True)], None)
    np.testing.assert_array_equal(seen["predictions"], want)
    assert got["eval_n"] == ref["eval_n"] == ids.numel()
    assert got["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)


def test_enable_serves_trl_built_from_a_path(switch: Any, tmp_path: Any) -> None:
    """SFTTrainer(model="<path>") loads the model itself: the switch is the one way in before
    the trainer exists; TRL's chunked head is never called."""
    trl = pytest.importorskip("trl")
    import trl.trainer.utils as trl_utils

    from tiledmlp.train.tokenizer import byte_tokenizer

    _model().save_pretrained(tmp_path / "m")
    switch(tiled_loss=True)
    calls = []
    apply = trl_utils._ChunkedLogProbFunction.apply
    trl_utils._ChunkedLogProbFunction.apply = lambda *a: calls.append(1) or apply(*a)
    try:
        ds = datasets.Dataset.from_dict({"text": [f"sample {i} of text" for i in range(8)]})
        args = trl.SFTConfig(
            str(tmp_path / "o"), max_steps=2, per_device_train_batch_size=4, report_to=[],
            use_cpu=True, bf16=False, save_strategy="no", max_length=24, disable_tqdm=True,
        )  # fmt: skip
        trainer = trl.SFTTrainer(
            model=str(tmp_path / "m"), args=args, train_dataset=ds,
            processing_class=byte_tokenizer(),
        )  # fmt: skip
        assert hf.is_patched(trainer.model)
        trainer.train()
    finally:
        trl_utils._ChunkedLogProbFunction.apply = apply
    assert not calls
