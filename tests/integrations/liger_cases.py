"""Liger-Kernel's models under patch_model, run in a fresh process under Triton's interpreter
(conftest.run_interpreted; Liger's kernels are Triton, and its apply_liger_kernel_to_* also
patches transformers' modeling classes process-wide).

Two differences between Triton's interpreter (3.9) and its compiler stand in Liger 0.8.5's way
on the CPU; both are bridged here, at import, and nothing else is changed:
- the interpreter passes a Python float argument on as a Python float, where the compiler
  specialises it to an fp32 scalar; Liger's kernels call `.to(tl.float32)` on such arguments
  (SwiGLU's gate multiplier, RMSNorm's eps): floats are handed over as fp32 scalars, as the
  compiler does;
- the interpreter does not interpret libdevice functions bound at import
  (`from triton.language.extra.libdevice import rsqrt` in Liger's RMSNorm returns None):
  that name is bound to a jitted call of `tl.math.rsqrt`, which it interprets.

Every function returns a JSON-able summary; its assertions fail the calling test with the
process's output.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter as _interpreter

assert os.environ.get("TRITON_INTERPRET") == "1", "run through conftest.run_interpreted"

_implicit_cvt = _interpreter._implicit_cvt


def _as_compiled(arg: Any) -> Any:
    if isinstance(arg, float):  # the compiler's fp32 scalar (module docstring)
        handle = _interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32)
        return tl.tensor(handle, tl.float32)
    return _implicit_cvt(arg)


_interpreter._implicit_cvt = _as_compiled


@triton.jit
def _rsqrt(x):  # type: ignore[no-untyped-def]
    return tl.math.rsqrt(x)


import liger_kernel.ops.rms_norm as _liger_rms_norm  # noqa: E402

_liger_rms_norm.rsqrt = _rsqrt

from hf_models import BASE, VOCAB  # noqa: E402
from tiledmlp import patch_model, unpatch_model  # noqa: E402
from tiledmlp.config.stacks import STACK_PATCHES  # noqa: E402
from tiledmlp.patching.features.activation_offloading import enable_checkpointing  # noqa: E402
from tiledmlp.patching.native import liger_kind  # noqa: E402
from tiledmlp.patching.state import STATE  # noqa: E402

from conftest import assert_close_rel  # noqa: E402

FAMILIES = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}


def _config(family: str) -> Any:
    import transformers as tr

    extra: dict[str, Any] = {"num_hidden_layers": 2}
    if family == "qwen3_moe":
        extra |= {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}
        extra |= {"decoder_sparse_step": 1, "mlp_only_layers": []}
    if family != "llama":
        extra |= {"head_dim": 16}
    return getattr(tr, FAMILIES[family])(**{**BASE, **extra})


def _built(family: str, seed: int = 0) -> Any:
    import transformers as tr

    torch.manual_seed(seed)
    return tr.AutoModelForCausalLM.from_config(_config(family)).train()


def _liger(model: Any, family: str) -> Any:
    import liger_kernel.transformers as lk

    getattr(lk, f"apply_liger_kernel_to_{family}")(model=model)  # Liger's defaults
    return model


def _ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCAB, (2, 11), generator=g)


def _step(model: Any, ids: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads), "a parameter got no gradient"
    return [loss.detach(), *(g.clone() for g in grads)]  # type: ignore[union-attr]


def _same(got: list[torch.Tensor], ref: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert_close_rel(a, b, f"{what}: {'loss' if i == 0 else f'grad {i - 1}'}")


def qwen3() -> dict[str, Any]:
    # one stack: the interpreter runs Liger's per-head q/k norms row by row (minutes a stack)
    return each_stack("qwen3", ("tiled_mlp_loss",))


def qwen3_moe() -> dict[str, Any]:
    # not under the interpreter: Liger's fused MoE kernel is autotuned (test_liger.py)
    return each_stack("qwen3_moe", ("tiled_mlp_loss",))


#: the stack whose unpatch + patch cycle is stepped (the one that installs the most per-module
#: forwards over Liger's); every stack is stepped patched and unpatched
_CYCLED = "tiled_mlp_loss_offload_norms"


def each_stack(family: str = "llama", only: tuple[str, ...] = ()) -> dict[str, Any]:
    """A model patched by Liger (its defaults: RoPE, RMSNorm, SwiGLU, fused linear
    cross-entropy), then by patch_model with each stack, against the Liger-only model: loss
    and every gradient; who owns each job in the report; Liger's forwards back after every
    unpatch; one stack's unpatch + patch + unpatch cycle stepped exact again."""
    ids = _ids()
    stacks = [s for s, p in STACK_PATCHES.items() if p is not None and (not only or s in only)]
    base = _built(family)
    ref_model = _liger(copy.deepcopy(base), family)
    enable_checkpointing(ref_model)
    ref = _step(ref_model, ids)
    reports: dict[str, str] = {}
    for stack in stacks:
        model = _liger(copy.deepcopy(base), family)
        enable_checkpointing(model)
        config = STACK_PATCHES[stack]
        assert config is not None
        report = str(patch_model(model, config))
        reports[stack] = report
        _same(_step(model, ids), ref, stack)
        if config.tiled_loss:
            assert "the tiled loss computes it; Liger's fused linear cross-entropy" in report
        else:
            assert "Liger's fused linear cross-entropy (liger_kernel" in report, report
        if config.tiled_norms and not config.tiled_layers:
            assert "Liger's norm is already lean" in report, report
        if family != "qwen3_moe":
            assert "tiled over LigerSwiGLUMLP" in report, report
        if stack == _CYCLED or len(stacks) == 1:
            unpatch_model(model)
            assert not any(STATE in m.__dict__ for m in model.modules())
            patch_model(model, config)
            _same(_step(model, ids), ref, f"{stack} re-patched")
        unpatch_model(model)
        assert not any(STATE in m.__dict__ for m in model.modules())
        if family != "qwen3_moe":  # Liger's own forwards are back
            assert liger_kind(model.model.layers[0].mlp) == "LigerSwiGLUMLP"
        if stack == _CYCLED or len(stacks) == 1:
            _same(_step(model, ids), ref, f"{stack} unpatched")
    return reports


def liger_tiled_mlp() -> dict[str, Any]:
    """Liger's own tiled SwiGLU MLP in place of the model's: recognised and left alone (one
    line), never tiled twice; the tiled loss beside it is exact."""
    from liger_kernel.transformers.tiled_mlp import LigerTiledSwiGLUMLP

    ids = _ids()
    base = _built("llama")
    torch.manual_seed(5)
    for layer in base.model.layers:
        tiled = LigerTiledSwiGLUMLP(base.config, num_shards=3)
        tiled.load_state_dict(layer.mlp.state_dict())
        layer.mlp = tiled
    ref = _step(copy.deepcopy(base), ids)
    refused = ""
    try:
        patch_model(copy.deepcopy(base), num_tiles=2)
    except ValueError as e:
        refused = str(e)
    assert "found no MLP to tile" in refused and "Liger's own tiled MLP" in refused, refused
    assert "\n" not in refused
    model = copy.deepcopy(base)
    report = str(patch_model(model, tiled_mlp=False, tiled_loss=True))
    assert not any(STATE in m.__dict__ for m in model.modules())
    _same(_step(model, ids), ref, "Liger tiled MLP + tiled loss")
    return {"refused": refused, "report": report}


def auto_model() -> dict[str, Any]:
    """AutoLigerKernelForCausalLM (Liger applied while loading), then patch_model."""
    import tempfile

    from liger_kernel.transformers import AutoLigerKernelForCausalLM

    tmp = tempfile.mkdtemp(prefix="tiledmlp-liger-")
    _built("llama").save_pretrained(tmp)
    ref_model = AutoLigerKernelForCausalLM.from_pretrained(tmp).train()
    model = AutoLigerKernelForCausalLM.from_pretrained(tmp).train()
    ids = _ids()
    ref = _step(ref_model, ids)
    report = str(patch_model(model, num_tiles=3, tiled_loss=True))
    _same(_step(model, ids), ref, "AutoLigerKernelForCausalLM")
    assert "tiled over LigerSwiGLUMLP" in report and "stands aside" in report, report
    return {"report": report}


def _sft(out: str, tiled: bool) -> tuple[list[float], Any, Any]:
    """TRL's SFTTrainer with use_liger_kernel=True (Liger's layer kernels; TRL keeps its fused
    LM head and its default loss), with or without TiledMLPCallback(tiled_loss=True)."""
    import datasets
    import transformers as tr
    from trl import SFTConfig, SFTTrainer

    from tiledmlp.integrations.hf import TiledMLPCallback
    from tiledmlp.train.tokenizer import byte_tokenizer

    torch.manual_seed(0)
    cfg = tr.LlamaConfig(
        vocab_size=258, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=256,
        eos_token_id=257,
    )  # fmt: skip
    model = tr.LlamaForCausalLM(cfg)
    ds = datasets.Dataset.from_dict({"text": [f"hello world, sample {i}" for i in range(8)]})
    args = SFTConfig(
        output_dir=out, max_steps=2, per_device_train_batch_size=2, logging_steps=1,
        report_to=[], use_cpu=True, optim="sgd", learning_rate=0.1, save_strategy="no", seed=0,
        data_seed=0, disable_tqdm=True, bf16=False, max_length=32, use_liger_kernel=True,
    )  # fmt: skip
    callback = TiledMLPCallback(tiled_loss=True) if tiled else None
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=ds, processing_class=byte_tokenizer(),
        callbacks=[callback] if callback else None,
    )  # fmt: skip
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses, trainer, callback


def trl_with_liger() -> dict[str, Any]:
    """TRL's SFTTrainer, use_liger_kernel=True: with TiledMLPCallback(tiled_loss=True) the
    losses equal the run without it; the MLPs tile over Liger's; the tiled loss serves TRL's
    fused head (TRL's chunked head never runs)."""
    import tempfile

    import trl.trainer.utils as trl_utils

    calls = {"trl": 0}
    apply = trl_utils._ChunkedLogProbFunction.apply

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["trl"] += 1
        return apply(*args, **kwargs)

    trl_utils._ChunkedLogProbFunction.apply = counted
    tmp = tempfile.mkdtemp(prefix="tiledmlp-trl-liger-")
    ref, ref_trainer, _ = _sft(f"{tmp}/ref", tiled=False)
    assert calls["trl"] > 0
    assert liger_kind(ref_trainer.model.model.layers[0].mlp) == "LigerSwiGLUMLP"
    calls["trl"] = 0
    got, _, callback = _sft(f"{tmp}/tiled", tiled=True)
    assert calls["trl"] == 0, calls
    report = str(callback.report)
    assert "tiled over LigerSwiGLUMLP" in report, report
    assert "TRL's fused LM head calls included" in report, report
    assert len(got) == len(ref) == 2
    for a, b in zip(got, ref):
        assert abs(a - b) <= 1e-6 * abs(b), (got, ref)
    return {"losses": got, "reference": ref, "report": report}
