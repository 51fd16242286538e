"""Liger-Kernel's models under patch_model: every stack exact against the Liger-only model
(loss and every gradient), one owner per job in the report (Liger's SwiGLU tiled over, its
RMSNorm left alone as already lean, its fused linear cross-entropy set aside by the tiled loss
or computing the loss without it), Liger's own tiled MLP left alone, unpatch + patch exact.

Liger's kernels are Triton: each case runs in a fresh process under Triton's interpreter
(liger_cases.py says which two interpreter gaps it bridges). What needs no kernel to run (the
recognition of Liger's forwards) is tested here in-process.

What cannot run on the CPU: Liger 0.8.5's fused MoE experts kernel (`apply_liger_kernel_to_qwen3_moe`
with its defaults, liger_kernel/ops/fused_moe.py) is autotuned, and Triton's autotuner times its
configurations through a GPU driver the interpreter does not have ("0 active drivers"); Qwen3-MoE
under Liger is therefore not tested here (liger_cases.qwen3_moe runs it where a GPU is).
"""

from __future__ import annotations

import pytest
from torch import nn

from conftest import run_interpreted

pytest.importorskip("liger_kernel", reason="liger-kernel is not installed")


@pytest.mark.slow  # each case: a fresh process, Liger's kernels interpreted (~40-120 s on 2 cores)
@pytest.mark.parametrize(
    "case", ["each_stack", "qwen3", "liger_tiled_mlp", "auto_model", "trl_with_liger"]
)
def test_liger_models_under_patch_model(case: str) -> None:
    # whole models with Liger's kernels interpreted: minutes on 2 loaded cores
    run_interpreted("liger_cases", case, timeout=3600)


def test_liger_forwards_are_recognised_without_running_them() -> None:
    import transformers as tr
    from liger_kernel.transformers.rms_norm import LigerRMSNorm
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    from liger_kernel.transformers.tiled_mlp import LigerTiledSwiGLUMLP

    from hf_models import BASE
    from tiledmlp.patching.native import left_alone, liger_kind, liger_loss, replaced_note

    config = tr.LlamaConfig(**BASE)
    mlp = tr.models.llama.modeling_llama.LlamaMLP(config)
    assert liger_kind(mlp) is None and left_alone(mlp, "MLP") is None
    # Liger's instance patching binds its forward on transformers' module (model=...)
    mlp.__dict__["forward"] = LigerSwiGLUMLP.forward.__get__(mlp)
    assert liger_kind(mlp) == "LigerSwiGLUMLP" and left_alone(mlp, "MLP") is None
    assert "Liger's kernel no longer runs" in (replaced_note(mlp, "fast") or "")
    tiled = LigerTiledSwiGLUMLP(config)
    assert "already tiled; left alone" in (left_alone(tiled, "MLP") or "")
    norm = LigerRMSNorm(BASE["hidden_size"])
    assert "already lean" in (left_alone(norm, "norm") or "")
    from liger_kernel.transformers.model.llama import lce_forward

    assert liger_loss(lce_forward) == "liger_kernel.transformers.model.llama"
    assert liger_loss(nn.Linear.forward) is None


def test_liger_applied_after_patching_is_named_in_the_report() -> None:
    # a Trainer with use_liger_kernel=True binds Liger's forwards when training starts (the
    # way Liger's instance patching does, reproduced here without running a kernel)
    import transformers as tr
    from liger_kernel.transformers.swiglu import LigerSwiGLUMLP

    from hf_models import BASE
    from tiledmlp import patch_model, unpatch_model
    from tiledmlp.patching.patch import patch_report

    model = tr.LlamaForCausalLM(tr.LlamaConfig(**BASE))
    patch_model(model, num_tiles=2)
    mlp = model.model.layers[0].mlp
    mlp.__dict__["forward"] = LigerSwiGLUMLP.forward.__get__(mlp)
    report = patch_report(model)
    assert report is not None
    path = report.paths["model.layers.0.mlp"]
    assert "covered: liger_kernel.transformers.swiglu.LigerSwiGLUMLP.forward" in path, path
    assert report.paths["model.layers.1.mlp"] == "fast: gated"
    with pytest.raises(RuntimeError, match="another forward was installed over the tiled one"):
        unpatch_model(model)
