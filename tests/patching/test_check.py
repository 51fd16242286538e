"""tiledmlp.check from Python: one step unpatched and patched, every gradient against a float64
reference; it passes on real tiny models, fails naming the parameters when a tiled backward is
wrong, and leaves the caller's model as it was."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import tiledmlp
from hf_models import VOCAB, tiny_causal_lm
from tiledmlp.ops.mlp.function import TiledMLPFunction

pytest.importorskip("transformers")


def _batch(n: int = 2, seq: int = 24) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (n, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


# qwen3_moe's grouped matmul refuses float64: its check compares tiled with untiled directly
@pytest.mark.parametrize(("family", "reference"), [
    ("llama", "float64"),
    pytest.param("gpt2", "float64", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", None, marks=pytest.mark.slow),
])  # fmt: skip
def test_it_passes_on_real_models_with_every_tiled_call_running_several_tiles(
    family: str, reference: str | None
) -> None:
    model = tiny_causal_lm(family).train()
    result = tiledmlp.check(model, _batch(), tiled_loss=True, generic=True)
    assert isinstance(result, tiledmlp.CheckResult)
    assert result.passed, result.text()
    assert result.tiles and all(n == 4 for n in result.tiles.values()), result.tiles
    assert not result.untiled_calls
    assert result.micro_batches == 2 and result.reference_dtype == reference
    assert reference or any("does not run in float64" in n for n in result.notes)
    assert len(result.params) == sum(1 for p in model.parameters() if p.requires_grad)
    assert "PASS" in result.text() and "4 tiles per call" in result.text()


def test_bf16_is_held_to_twice_the_untiled_error_against_float64() -> None:
    model = tiny_causal_lm("llama").to(torch.bfloat16).train()
    result = tiledmlp.check(model, _batch(), num_tiles=3)
    assert result.passed, result.text()
    assert result.dtype == "bfloat16" and result.tiles and set(result.tiles.values()) == {3}
    worst = result.params[0]
    assert worst.allowed >= 2 * worst.untiled_max_abs and worst.max_abs <= worst.allowed
    assert not result.notes  # an explicit count is kept as it is


def _doubling_backward(original: Any) -> Any:
    """TiledMLPFunction.backward with the last weight's gradient doubled (a wrong tiling)."""

    def backward(ctx: Any, *grads: Any) -> Any:
        out = list(original(ctx, *grads))
        last = max(i for i, g in enumerate(out) if g is not None)
        out[last] = out[last] * 2
        return tuple(out)

    return staticmethod(backward)


def test_a_wrong_tiled_backward_fails_and_names_the_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(TiledMLPFunction, "backward", _doubling_backward(TiledMLPFunction.backward))
    result = tiledmlp.check(tiny_causal_lm("llama").train(), _batch())
    assert not result.passed
    expected = {f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)}
    assert set(result.failed) == expected, result.failed
    text = result.text()
    assert "FAIL" in text and all(name in text for name in expected)
    assert result.params[0].name in expected and result.params[0].rel > 0.5


def test_the_callers_model_is_left_as_it_was() -> None:
    model = tiny_causal_lm("llama").train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tiledmlp.check(model, [_batch(1), _batch(1)], num_tiles=2)
    assert not tiledmlp.patching.tile_counts(model)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m: tiledmlp.check(m, _batch(1)), ValueError, "cannot be split into 2"),
        (lambda m: tiledmlp.check(m, [_batch(1)]), ValueError, "at least 2 micro-batches"),
        (lambda m: tiledmlp.check(m, _batch(), micro_batches=1), ValueError, "at least 2"),
        (lambda m: tiledmlp.check(m, _batch(), num_tile=2), TypeError, "did you mean 'num_tiles'"),
        (
            lambda m: tiledmlp.check(m, {"input_ids": _batch()["input_ids"]}),
            ValueError,
            "no loss",
        ),
    ],
)
def test_bad_input_is_one_clear_error(call: Any, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        call(tiny_causal_lm("llama").train())


def test_a_patched_model_is_refused() -> None:
    model = tiny_causal_lm("llama")
    tiledmlp.patch_model(model, num_tiles=2)
    with pytest.raises(ValueError, match="unpatched model"):
        tiledmlp.check(model, _batch())


@pytest.mark.slow  # peft's import and three steps of a LoRA model
def test_a_lora_model_passes_with_only_the_adapters_compared() -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,  # nonzero B: every adapter weight gets a gradient
    )  # fmt: skip
    model = peft.get_peft_model(tiny_causal_lm("llama"), config).train()
    result = tiledmlp.check(model, _batch(), num_tiles=3)
    assert result.passed, result.text()
    assert result.params and all("lora_" in c.name for c in result.params)
    assert len(result.params) == 2 * 3 * 2  # A and B of 3 projections in 2 layers
    assert set(result.tiles.values()) == {3} and "generic" in result.report
