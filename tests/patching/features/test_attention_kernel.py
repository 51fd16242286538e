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


def test_auto_switches_to_by_heads_where_cudnn_would_not_fit() -> None:
    """The context of a layer's call by length, for a bound of 3 GiB: 32 query heads of 128
    each with its own key/value head, bf16 on a GPU (the tensor is on the meta device: only its
    shape, dtype and the device type the choice reads count)."""
    from tiledmlp.patching.attention_core import active

    choice = KernelChoice("auto", 3 * 2**30)
    cuda = torch.backends.cuda

    def within(tokens: int) -> tuple[bool, bool, bool, bool]:
        hidden = torch.empty(1, tokens, 4096, dtype=torch.bfloat16, device="meta")
        with call_context(choice, (32, 32, 128), _on_cuda(hidden)):
            enabled = cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled(), cuda.math_sdp_enabled()
            return (*enabled, active())

    # 64K tokens: cuDNN's 2.0 GiB fit, SDPA's own choice (every backend left enabled)
    assert within(65536) == (True, True, True, False)
    # 128K: cuDNN's 4.0 GiB do not fit; the attention by head groups (SDPA's own kernel per
    # group, the faster of the rest) does
    assert within(131072) == (True, True, True, True)
    assert not active()  # left after the call
    # flash forced: SDPA is asked for flash alone
    flash = torch.empty(1, 128, 4096, dtype=torch.bfloat16, device="meta")
    with call_context(KernelChoice("flash"), (32, 32, 128), _on_cuda(flash)):
        assert (cuda.cudnn_sdp_enabled(), cuda.flash_sdp_enabled()) == (False, True)
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


@pytest.fixture
def small_groups(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Tiny sequences split into groups like long ones (no minimum of waves per call, no
    memory floor); returns the groups of every call by heads."""
    from tiledmlp.ops.attention import heads as attention_heads
    from tiledmlp.patching import attention_core

    monkeypatch.setattr(attention_heads, "MIN_WAVES", 0)
    monkeypatch.setattr(attention_heads, "BUFFER_FLOOR", 0)
    seen: list[int] = []
    real = attention_core.causal_attention_by_heads

    def counted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, groups: int,
                kernel: object) -> torch.Tensor:  # fmt: skip
        seen.append(groups)
        return real(q, k, v, scale, groups, kernel)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_core, "causal_attention_by_heads", counted)
    return seen


def test_auto_switches_the_models_attention_to_by_heads_exactly(small_groups: list[int]) -> None:
    """auto:<GB> on the CPU, where SDPA's own choice is counted as the math path's
    2 x heads x tokens^2 float32 values: a bound of 99,965 bytes holds them at 32 tokens
    (32,768 bytes; SDPA's own choice stays) and not at 64 (131,072), where the model's own
    attention runs by head groups (4 groups of one query head: 8,704 bytes). The checkpointed
    model trains as the unpatched one (the recompute runs the kernel the forward ran: the
    saved tensors match), and unpatching restores its attention implementation."""
    from tiledmlp.patching.features.activation_offloading import enable_checkpointing

    for tokens, grouped in ((32, False), (64, True)):
        small_groups.clear()
        model, ref = _model(), _model()
        for m in (model, ref):
            enable_checkpointing(m)
        ids = torch.randint(0, 100, (1, tokens), generator=torch.Generator().manual_seed(1))
        want = ref(ids, labels=ids)
        want.loss.backward()
        report = tiledmlp.patch_model(model, attention_kernel="auto:0.0000931")  # 99,965 bytes
        assert str(report.attention_kernel).endswith(" (per call) in 2 decoder layer(s)")
        got = model(ids, labels=ids)
        got.loss.backward()
        assert small_groups == ([4, 4, 4, 4] if grouped else [])  # forward and recompute
        assert (got.logits - want.logits).abs().max() <= 1e-5
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad is not None and q.grad is not None
            diff = (p.grad - q.grad).abs()
            assert diff.max() <= 1e-5, f"{name}: max {diff.max():.3g}, mean {diff.mean():.3g}"
        assert model.config._attn_implementation == "tiledmlp_sdpa"
        tiledmlp.unpatch_model(model)
        assert model.config._attn_implementation == "sdpa"
        assert "forward" not in model.model.layers[0].self_attn.__dict__


def test_by_heads_named_runs_the_models_attention_by_groups(small_groups: list[int]) -> None:
    model = _model()
    ids = torch.randint(0, 100, (1, 24))
    ref = model(ids).logits
    tiledmlp.patch_model(model, attention_kernel="by-heads")
    got = model(ids).logits
    assert small_groups == [4, 4]
    assert (got - ref).abs().max() <= 1e-5
    tiledmlp.unpatch_model(model)
