"""TRL: the tiled LM head serves TRL's fused-LM-head slot with TRL's numbers.

Real TRL trainers (SFT, DPO, GRPO) on a tiny Llama, 3 optimizer steps, fp32: with patch_model
before or after the trainer is built, with and without LoRA, the logged losses and metrics and
the parameters equal TRL's own path, and TRL's chunked head (counted by wrapping its autograd
Function's apply) is never called. The optimizer is SGD: Adam divides by the gradient's
running RMS, which turns fp32 rounding in near-zero gradient entries into O(lr) parameter
differences whoever computes the head.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

import tiledmlp  # noqa: E402
from tiledmlp.integrations import trl as trl_integration  # noqa: E402
from tiledmlp.integrations.hf import TiledMLPCallback  # noqa: E402
from tiledmlp.ops.loss.cross_entropy import tiled_token_stats  # noqa: E402
from tiledmlp.train.tokenizer import byte_tokenizer  # noqa: E402

from conftest import assert_close_rel  # noqa: E402

pytestmark = pytest.mark.skipif(
    trl_integration.untested_reason() is not None, reason="TRL outside the tested range"
)

_METRICS = ("loss", "grad_norm", "entropy", "mean_token_accuracy")


def _model() -> Any:
    import transformers as tr

    torch.manual_seed(0)
    cfg = tr.LlamaConfig(
        vocab_size=258, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=256,
        eos_token_id=257,
    )  # fmt: skip
    return tr.LlamaForCausalLM(cfg)


@pytest.fixture
def trl_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts calls of TRL's chunked LM head and of ours."""
    import trl.trainer.utils as trl_utils

    calls = {"trl": 0, "ours": 0}
    trl_apply = trl_utils._ChunkedLogProbFunction.apply

    def counted_trl(*args: Any, **kwargs: Any) -> Any:
        calls["trl"] += 1
        return trl_apply(*args, **kwargs)

    def counted_ours(*args: Any, **kwargs: Any) -> Any:
        calls["ours"] += 1
        return tiled_token_stats(*args, **kwargs)

    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply", counted_trl)
    monkeypatch.setattr(trl_integration, "tiled_token_stats", counted_ours)
    return calls


def _common(out: str) -> dict[str, Any]:
    return dict(
        output_dir=out, max_steps=3, per_device_train_batch_size=4, logging_steps=1,
        report_to=[], use_cpu=True, optim="sgd", learning_rate=0.1, save_strategy="no", seed=0,
        data_seed=0, disable_tqdm=True, bf16=False,
    )  # fmt: skip


def _lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _sft(out: str, patch: str, lora: bool) -> tuple[list[dict], Any]:
    from trl import SFTConfig, SFTTrainer

    model = _model()
    if patch == "before":
        tiledmlp.patch_model(model, tiled_loss=True)
    ds = datasets.Dataset.from_dict(
        {"text": [f"hello world, sample number {i}" for i in range(12)]}
    )
    args = SFTConfig(max_length=32, **_common(out))
    callbacks = [TiledMLPCallback(tiled_loss=True)] if patch == "callback" else None
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=ds, processing_class=byte_tokenizer(),
        peft_config=_lora() if lora else None, callbacks=callbacks,
    )  # fmt: skip
    if patch == "after":
        report = tiledmlp.patch_model(trainer.model, tiled_loss=True)
        assert report.loss == "tiled"
    trainer.train()
    return trainer.state.log_history, trainer


def _with_reference(patch: str, lora: bool) -> tuple[Any, Any]:
    """DPO and KTO: the policy and its reference model (None with LoRA: the adapters disabled),
    both patched when the test patches before the trainer."""
    model = _model()
    ref = None if lora else _model()
    if patch == "before":
        tiledmlp.patch_model(model, tiled_loss=True)
        if ref is not None:
            tiledmlp.patch_model(ref, tiled_mlp=False, tiled_loss=True)
    return model, ref


def _dpo(out: str, patch: str, lora: bool) -> tuple[list[dict], Any]:
    from trl import DPOConfig, DPOTrainer

    model, ref = _with_reference(patch, lora)
    ds = datasets.Dataset.from_dict(
        {
            "prompt": [f"question {i}: " for i in range(12)],
            "chosen": [f"good answer {i}" for i in range(12)],
            "rejected": [f"bad {i} answer" for i in range(12)],
        }
    )
    args = DPOConfig(max_length=32, **_common(out))
    trainer = DPOTrainer(
        model=model, ref_model=ref, args=args, train_dataset=ds, processing_class=byte_tokenizer(),
        peft_config=_lora() if lora else None,
    )  # fmt: skip
    if patch == "after":
        trl_integration.install(trainer)
    trainer.train()
    return trainer.state.log_history, trainer


def _reward(completions: list[str], **_: Any) -> list[float]:
    return [float(len(set(c))) for c in completions]


def _online(
    config_name: str, trainer_name: str, out: str, patch: str, lora: bool
) -> tuple[list[dict], Any]:
    """GRPO and RLOO: generations scored by `_reward`, the same arguments for both."""
    import trl

    model = _model()
    if patch == "before":
        tiledmlp.patch_model(model, tiled_loss=True)
    ds = datasets.Dataset.from_dict({"prompt": [f"count {i}:" for i in range(12)]})
    args = getattr(trl, config_name)(
        # beta > 0 needs a reference model: with LoRA, the adapters disabled; without, TRL would
        # load one from the hub (offline here), so the KL term is tested with LoRA only
        num_generations=2, max_completion_length=6, temperature=0.9, beta=0.1 if lora else 0.0,
        generation_batch_size=4, **_common(out),
    )  # fmt: skip
    trainer = getattr(trl, trainer_name)(
        model=model, reward_funcs=_reward, args=args, train_dataset=ds,
        processing_class=byte_tokenizer(), peft_config=_lora() if lora else None,
    )  # fmt: skip
    if patch == "after":
        trl_integration.install(trainer)
    trainer.train()
    return trainer.state.log_history, trainer


def _grpo(out: str, patch: str, lora: bool) -> tuple[list[dict], Any]:
    return _online("GRPOConfig", "GRPOTrainer", out, patch, lora)


def _kto(out: str, patch: str, lora: bool) -> tuple[list[dict], Any]:
    from trl import KTOConfig, KTOTrainer

    model, ref = _with_reference(patch, lora)
    ds = datasets.Dataset.from_dict(
        {
            "prompt": [f"question {i}: " for i in range(12)],
            "completion": [f"answer {i}" if i % 2 else f"{i} wrong" for i in range(12)],
            "label": [bool(i % 2) for i in range(12)],
        }
    )
    args = KTOConfig(max_length=32, **_common(out))
    trainer = KTOTrainer(
        model=model, ref_model=ref, args=args, train_dataset=ds, processing_class=byte_tokenizer(),
        peft_config=_lora() if lora else None,
    )  # fmt: skip
    if patch == "after":
        trl_integration.install(trainer)
    trainer.train()
    return trainer.state.log_history, trainer


def _rloo(out: str, patch: str, lora: bool) -> tuple[list[dict], Any]:
    return _online("RLOOConfig", "RLOOTrainer", out, patch, lora)


_RUNS = {"sft": _sft, "dpo": _dpo, "grpo": _grpo, "kto": _kto, "rloo": _rloo}


def _assert_same_run(got: tuple[list[dict], Any], ref: tuple[list[dict], Any]) -> None:
    logs, trainer = got
    ref_logs, ref_trainer = ref
    steps = [entry for entry in logs if "loss" in entry]
    ref_steps = [entry for entry in ref_logs if "loss" in entry]
    assert len(steps) == len(ref_steps) == 3
    for step, (entry, want) in enumerate(zip(steps, ref_steps)):
        keys = [k for k in want if isinstance(want[k], float) and k not in ("learning_rate",)]
        keys = [k for k in keys if not k.startswith(("train_", "step_time", "epoch"))]
        assert set(_METRICS) & set(keys) or "loss" in keys
        for key in keys:
            a, b = float(entry[key]), float(want[key])
            # abs_tol: DPO's rewards are beta x differences of two near-equal log-probability
            # sums (~1e2 in magnitude); fp32 rounding of the sums leaves ~1e-6 there
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5) or (
                math.isnan(a) and math.isnan(b)
            ), f"step {step + 1} {key}: {a} != TRL's {b}"
    params = dict(trainer.model.named_parameters())
    for name, p in ref_trainer.model.named_parameters():
        assert_close_rel(params[name].detach(), p.detach(), name)


_SLOW = pytest.mark.slow  # three trainers built and run 3 steps each: 20-45 s on 2 cores


@pytest.mark.parametrize(
    ("trainer", "lora"),
    [
        pytest.param("sft", False, id="sft-full"),
        pytest.param("sft", True, id="sft-lora", marks=_SLOW),
        pytest.param("dpo", False, id="dpo-full", marks=_SLOW),
        pytest.param("dpo", True, id="dpo-lora", marks=_SLOW),
        pytest.param("grpo", False, id="grpo-full", marks=_SLOW),
        pytest.param("grpo", True, id="grpo-lora", marks=_SLOW),
        pytest.param("kto", False, id="kto-full", marks=_SLOW),
        pytest.param("rloo", True, id="rloo-lora", marks=_SLOW),
    ],
)
def test_tiled_head_serves_trl_with_its_numbers(
    trainer: str, lora: bool, tmp_path: Any, trl_calls: dict[str, int]
) -> None:
    run = _RUNS[trainer]
    ref = run(str(tmp_path / "ref"), "none", lora)
    assert trl_calls["trl"] > 0 and trl_calls["ours"] == 0
    # the Trainer callback patches at the end of Trainer.__init__, before TRL adds its head
    ways = ("callback", "before", "after") if trainer == "sft" else ("before", "after")
    for patch in ways:
        trl_calls["trl"] = trl_calls["ours"] = 0
        got = run(str(tmp_path / patch), patch, lora)
        assert trl_calls["trl"] == 0, f"{patch}: TRL's chunked head ran {trl_calls['trl']} times"
        assert trl_calls["ours"] > 0
        _assert_same_run(got, ref)


@pytest.mark.slow  # two training runs
def test_unpatch_leaves_trl_working(tmp_path: Any, trl_calls: dict[str, int]) -> None:
    _, trainer = _sft(str(tmp_path / "a"), "after", lora=False)
    assert "<loss>" in tiledmlp.unpatch_model(trainer.model)
    trl_calls["trl"] = trl_calls["ours"] = 0
    trainer.args.max_steps = 4
    trainer.train()
    assert trl_calls["trl"] > 0 and trl_calls["ours"] == 0


def test_unpatch_keeps_a_forward_installed_over_ours() -> None:
    """Over the loss: the wrapper stays and ours becomes a pass-through (the model computes what
    it computed before patching). Over an MLP: unpatch_model refuses, changing nothing."""
    import types

    model = _model()
    ids = torch.randint(3, 258, (2, 9))
    with torch.no_grad():
        want = model(input_ids=ids, labels=ids)
    tiledmlp.patch_model(model, tiled_loss=True)
    ours = model.forward

    def on_top(self: Any, *args: Any, **kwargs: Any) -> Any:
        return ours(*args, **kwargs)

    model.forward = types.MethodType(on_top, model)
    mlp = model.model.layers[0].mlp
    mlp_ours = mlp.forward
    mlp.forward = lambda x: mlp_ours(x)
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.mlp .*another forward"):
        tiledmlp.unpatch_model(model)
    assert model.forward.__func__ is on_top and mlp.forward is not mlp_ours  # nothing changed
    mlp.forward = mlp_ours
    assert "<loss>" in tiledmlp.unpatch_model(model)
    assert model.forward.__func__ is on_top  # kept
    with torch.no_grad():
        got = model(input_ids=ids, labels=ids)
    assert got.logits is not None  # the model's own forward again, not the tiled loss
    assert_close_rel(got.loss, want.loss, "loss")
    assert tiledmlp.patch_model(model, tiled_loss=True).loss == "tiled"  # and back on
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).logits is None


def test_trl_settings_read_from_its_forward() -> None:
    """TRL's private layout (the closure of the forward add_fused_lm_head installs): fails
    loudly when a TRL release moves it."""
    assert trl_integration.ready()
    model = _model()
    tiledmlp.patch_model(model, tiled_mlp=False, tiled_loss=True)
    import trl.trainer.utils as trl_utils

    trl_utils.add_fused_lm_head(
        model, temperature=0.7, cast_lm_head_to_fp32=True, outputs=("log_probs", "is_top1")
    )
    settings = trl_integration.settings_of(model)
    assert settings == trl_integration.HeadSettings(
        temperature=0.7, outputs=("log_probs", "is_top1"), cast_lm_head_to_fp32=True
    )


def test_untested_trl_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trl_integration, "TESTED", ("0.1", "0.2"))
    model = _model()
    tiledmlp.patch_model(model, tiled_mlp=False, tiled_loss=True)
    import trl.trainer.utils as trl_utils

    with pytest.raises(RuntimeError, match=r"outside the range the tiled loss is tested with"):
        trl_utils.add_fused_lm_head(model)


@pytest.mark.parametrize(
    ("temperature", "softcap", "scale", "frozen"),
    [(1.0, None, 1.0, False), (0.7, 3.0, 1.3, False), (1.0, None, 1.0, True)],
)
def test_token_stats_equal_trl_chunked_head(
    temperature: float, softcap: float | None, scale: float, frozen: bool
) -> None:
    from trl.kernels import ChunkedLogProbFunction

    torch.manual_seed(0)
    n, h, v = 37, 16, 50
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=not frozen)
    bias = torch.randn(v, requires_grad=not frozen)
    tokens = torch.randint(0, v, (n,))
    up_lp, up_ent = torch.randn(n), torch.randn(n)
    wrt = (hidden,) if frozen else (hidden, weight, bias)
    stats = ("log_sum_sq_probs", "mean_logits", "is_top1")
    ref = ChunkedLogProbFunction.apply(
        hidden,
        weight,
        bias,
        tokens,
        temperature,
        16,
        softcap,
        scale,
        ("log_probs", "entropy", *stats),
    )
    ref_grads = torch.autograd.grad((ref[0] * up_lp).sum() + (ref[1] * up_ent).sum(), wrt)
    got = tiled_token_stats(
        hidden, weight, tokens, bias=bias, temperature=temperature, softcap=softcap,
        logit_scale=scale, entropy=True, stats=stats, num_tiles=3,
    )  # fmt: skip
    grads = torch.autograd.grad((got.log_probs * up_lp).sum() + (got.entropy * up_ent).sum(), wrt)
    for name, a, b in zip(("log_probs", "entropy", *stats[:2]), got, ref):
        assert_close_rel(a.detach(), b.detach(), name)
    assert torch.equal(got.is_top1, ref[4])
    for name, a, b in zip(("d hidden", "d weight", "d bias"), grads, ref_grads):
        assert_close_rel(a, b, name)


@pytest.mark.parametrize("trl_head", [False, True], ids=["alone", "over-trl-head"])
def test_fused_lm_head_never_reaches_the_decoder(trl_head: bool) -> None:
    model = _model()
    tiledmlp.patch_model(model, tiled_loss=True)
    if trl_head:
        import trl.trainer.utils as trl_utils

        trl_utils.add_fused_lm_head(model, outputs=("log_probs", "entropy"))
    seen: list[dict[str, Any]] = []
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True
    )
    ids = torch.randint(3, 258, (2, 9))
    for fused in (True, False):
        out = model(input_ids=ids, labels=ids, fused_lm_head=fused)
        assert (out.log_probs is not None) if fused else (out.loss is not None)
    assert len(seen) == 2 and not any("fused_lm_head" in kwargs for kwargs in seen)


def test_fused_head_with_moe_router_logits_runs_trls_head_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An MoE model whose loss adds the router's auxiliary loss: its loss is tiled, but TRL's
    fused slot (which the tiled head does not serve with router logits) goes to TRL's head."""
    import copy
    import logging

    import transformers as tr
    import trl.trainer.utils as trl_utils

    torch.manual_seed(0)
    cfg = tr.Qwen3MoeConfig(
        vocab_size=258, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, output_router_logits=True,
        router_aux_loss_coef=0.1,
    )  # fmt: skip
    ref = tr.Qwen3MoeForCausalLM(cfg).train()
    model = copy.deepcopy(ref)
    assert tiledmlp.patch_model(model, tiled_mlp=False, tiled_loss=True).loss == "tiled"
    for m in (model, ref):
        trl_utils.add_fused_lm_head(m, outputs=("log_probs",))
    ids = torch.randint(3, 258, (2, 9))
    with caplog.at_level(logging.WARNING, logger="tiledmlp.patching.features.tiled_loss"):
        outs = [model(input_ids=ids, labels=ids, fused_lm_head=True) for _ in range(2)]
    told = [r.getMessage() for r in caplog.records if "fused_lm_head=True" in r.getMessage()]
    assert len(told) == 1 and "output_router_logits=False" in told[0]
    want = ref(input_ids=ids, labels=ids, fused_lm_head=True)
    assert_close_rel(outs[0].log_probs.detach(), want.log_probs.detach(), "log_probs")


def test_logits_to_keep_is_tiled_with_trls_head_below_ours() -> None:
    """TRL's head added after the patch sits below the tiled loss: the forward below ours takes
    **kwargs, and logits_to_keep is still the model's (its class's forward names it), tiled
    exactly."""
    import copy

    import trl.trainer.utils as trl_utils

    ref = _model()
    model = copy.deepcopy(ref)
    assert tiledmlp.patch_model(model, tiled_mlp=False, tiled_loss=True).loss == "tiled"
    trl_utils.add_fused_lm_head(model)
    ids = torch.randint(3, 258, (2, 9))
    for keep, labels in ((4, ids[:, -4:]), (torch.tensor([1, 5, 8]), ids[:, [1, 5, 8]])):
        out = model(input_ids=ids, labels=labels, logits_to_keep=keep)
        want = ref(input_ids=ids, labels=labels, logits_to_keep=keep)
        assert out.logits is None
        assert_close_rel(out.loss.detach(), want.loss.detach(), f"loss, logits_to_keep={keep}")


class _VocabRows(torch.utils._python_dispatch.TorchDispatchMode):
    """The most rows of any tensor an op returns whose last dimension is the vocabulary (a
    block of logits, or of their gradient: rows = numel / vocab)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.most = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.vocab:
                self.most = max(self.most, t.numel() // self.vocab)
        return out


@pytest.mark.slow  # two SFT runs of 3 steps under a dispatch mode (~30 s on 2 cores)
def test_sft_default_loss_has_one_owner_and_never_forms_the_logits(
    tmp_path: Any, trl_calls: dict[str, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # TRL's default loss (loss_type="nll") asks the model for per-token log-probabilities in
    # chunks of 32,768 tokens; scaled down to this run's size (4 x ~30 tokens a batch) so that
    # "never the whole logits" can be seen: chunks of 32 tokens, and 4 tiles for ours
    import trl.trainer.utils as trl_utils
    from trl import SFTConfig, SFTTrainer

    monkeypatch.setattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32)
    runs = {}
    for patch in ("none", "after"):
        trl_calls["trl"] = trl_calls["ours"] = 0
        model = _model()
        tokens: list[int] = []
        model.model.embed_tokens.register_forward_pre_hook(
            lambda _m, args, seen=tokens: seen.append(args[0].numel())
        )
        ds = datasets.Dataset.from_dict(
            {"text": [f"hello world, sample number {i}" for i in range(12)]}
        )
        args = SFTConfig(max_length=32, **_common(str(tmp_path / patch)))
        assert args.loss_type == "nll" and not args.use_liger_kernel  # TRL's defaults
        trainer = SFTTrainer(
            model=model, args=args, train_dataset=ds, processing_class=byte_tokenizer()
        )
        if patch == "after":
            report = tiledmlp.patch_model(trainer.model, tiled_loss=True, loss_num_tiles=4)
            assert "loss: the tiled loss computes it, TRL's fused LM head calls included" in (
                str(report)
            )
        rows = _VocabRows(model.config.vocab_size)
        tokens.clear()  # (patch_model's probes ran the model on a few tokens)
        with rows:
            trainer.train()
        # one owner: TRL's chunked head or ours, never both
        owner = "trl" if patch == "none" else "ours"
        assert trl_calls[owner] > 0 and trl_calls["ours" if owner == "trl" else "trl"] == 0
        assert min(tokens) >= 100 and rows.most <= 32, (rows.most, min(tokens))
        runs[patch] = trainer.state.log_history
    got = [e["loss"] for e in runs["after"] if "loss" in e]
    ref = [e["loss"] for e in runs["none"] if "loss" in e]
    assert len(got) == len(ref) == 3
    for a, b in zip(got, ref):
        assert math.isclose(a, b, rel_tol=1e-6), (a, b)
