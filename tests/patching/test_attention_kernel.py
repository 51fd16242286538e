"""The attention_kernel option: parsed once, applied around each decoder layer's forward,
removed exactly; on CUDA the chosen kernel is what SDPA is asked for (a gpu test runs them)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tiledmlp
from tiledmlp.config.patch import PatchConfig
from tiledmlp.ops.attention.buffers import KernelChoice
from tiledmlp.patching.features.attention_kernel import call_context


def _model(heads: int = 4, kv: int = 2) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv, vocab_size=100)  # fmt: skip
    return LlamaForCausalLM(cfg)


def test_option_parses_once() -> None:
    assert PatchConfig.from_kwargs({}).attention_kernel == KernelChoice()
    assert PatchConfig.from_kwargs({"attention_kernel": "FLASH"}).attention_kernel.name == "flash"
    bounded = PatchConfig.from_kwargs({"attention_kernel": "auto:2GB"}).attention_kernel
    assert bounded == KernelChoice("auto", 2 * 2**30)
    with pytest.raises(ValueError, match="must be auto, auto:<GB> or one of"):
        PatchConfig.from_kwargs({"attention_kernel": "fast"})


def test_math_forced_matches_and_unpatches() -> None:
    model = _model()
    ids = torch.randint(0, 100, (1, 16))
    ref = model(ids).logits
    report = tiledmlp.patch_model(model, attention_kernel="math")
    assert report.attention_kernel == "math in 2 decoder layer(s)"
    assert "  attention kernel: math in 2 decoder layer(s)" in str(report).splitlines()
    layer = model.model.layers[0]
    assert "forward" in layer.__dict__
    got = model(ids).logits
    assert (got - ref).abs().max() <= 1e-5
    tiledmlp.unpatch_model(model)
    assert "forward" not in layer.__dict__
    assert tiledmlp.patching.patch_report(model) is None  # nothing left patched


def test_named_kernel_refused_in_one_line_on_the_cpu() -> None:
    model = _model()
    tiledmlp.patch_model(model, attention_kernel="cudnn")
    with pytest.raises(ValueError) as e:
        model(torch.randint(0, 100, (1, 8)))
    assert str(e.value) == (
        "attention_kernel=cudnn: the cudnn attention kernel runs on CUDA GPUs, not on cpu; use "
        "auto or another kernel"
    )


def test_auto_switches_to_flash_where_cudnn_would_not_fit() -> None:
    """The kernel asked of SDPA (the sdpa_kernel context) by length, for a bound of 3 GiB: 32
    query heads of 128 each with its own key/value head, bf16 on a GPU (the tensor is on the
    meta device: only its shape, dtype and the device type the choice reads count)."""
    choice = KernelChoice("auto", 3 * 2**30)
    cuda = torch.backends.cuda

    def enabled(tokens: int) -> tuple[bool, bool, bool]:
        hidden = torch.empty(1, tokens, 4096, dtype=torch.bfloat16, device="meta")
        with call_context(choice, (32, 32, 128), _on_cuda(hidden)):
            return cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.math_sdp_enabled()

    # 64K tokens: cuDNN's 2.0 GiB fit, SDPA's own choice (every backend left enabled)
    assert enabled(65536) == (True, True, True)
    # 128K: cuDNN's 4.0 GiB do not fit, flash's 2.0 do: SDPA is asked for flash alone
    assert enabled(131072) == (False, True, False)
    assert cuda.cudnn_sdp_enabled()  # restored after the call


class _Cuda(torch.Tensor):
    """A meta tensor that reports a CUDA device (for the choice alone; nothing runs)."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda")


def _on_cuda(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(_Cuda)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_both_kernels_run_on_a_gpu() -> None:
    """cuDNN and flash forced in turn: each within 2x the error of SDPA's own choice in bf16
    against the float32 model, and each trains (its backward runs)."""
    model = _model(heads=4, kv=4).cuda()
    ids = torch.randint(0, 100, (1, 256), device="cuda")
    with torch.no_grad():
        ref = model(ids).logits.double()
    model = model.to(torch.bfloat16)
    with torch.no_grad():
        base = float((model(ids).logits.double() - ref).abs().max())
    for kernel in ("cudnn", "flash"):
        tiledmlp.patch_model(model, attention_kernel=kernel)
        out = model(ids).logits
        out.float().sum().backward()
        tiledmlp.unpatch_model(model)
        err = float((out.detach().double() - ref).abs().max())
        assert err <= 2 * base, f"{kernel}: max error {err:.3g} against SDPA's {base:.3g}"
