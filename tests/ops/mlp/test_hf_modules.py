"""Real Hugging Face MLP classes (tiny random configs, nothing downloaded): recognised by
structure with their own activation, and exact against the untiled module."""

from __future__ import annotations

import pytest
import torch

from tiledmlp import tiled_mlp
from tiledmlp.ops import MLPKind, recognise

from conftest import assert_same_grads, grads_of

transformers = pytest.importorskip("transformers")

H, M = 32, 48
ATTN = {"num_attention_heads": 2, "num_key_value_heads": 1}


def _mlp(family: str) -> torch.nn.Module:
    torch.manual_seed(11)
    if family == "llama":
        from transformers.models.llama.modeling_llama import LlamaMLP

        return LlamaMLP(transformers.LlamaConfig(hidden_size=H, intermediate_size=M, **ATTN))
    if family == "llama_bias":
        from transformers.models.llama.modeling_llama import LlamaMLP

        cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=M, mlp_bias=True, **ATTN)
        return LlamaMLP(cfg)
    if family == "gemma":
        from transformers.models.gemma.modeling_gemma import GemmaMLP

        return GemmaMLP(transformers.GemmaConfig(hidden_size=H, intermediate_size=M, **ATTN))
    if family == "gemma2":
        from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP

        return Gemma2MLP(transformers.Gemma2Config(hidden_size=H, intermediate_size=M, **ATTN))
    if family == "phi3":
        from transformers.models.phi3.modeling_phi3 import Phi3MLP

        return Phi3MLP(transformers.Phi3Config(hidden_size=H, intermediate_size=M, **ATTN))
    if family == "gpt_neox":
        from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXMLP

        return GPTNeoXMLP(transformers.GPTNeoXConfig(hidden_size=H, intermediate_size=M, **ATTN))
    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = transformers.Qwen3MoeConfig(
            hidden_size=H, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, **ATTN
        )
        block = Qwen3MoeSparseMoeBlock(cfg)
        for param in block.parameters():  # expert weights are torch.empty until a model inits them
            torch.nn.init.normal_(param, std=0.2)
        return block
    raise ValueError(family)


KINDS = {
    "llama": MLPKind.GATED,
    "llama_bias": MLPKind.GATED,
    "gemma": MLPKind.GATED,
    "gemma2": MLPKind.GATED,
    "phi3": MLPKind.FUSED_GATED,
    "gpt_neox": MLPKind.PLAIN,
    "qwen3_moe": None,
}


@pytest.mark.parametrize("family", list(KINDS))
def test_recognised_with_own_activation(family: str) -> None:
    mlp = _mlp(family)
    s = recognise(mlp)
    want = KINDS[family]
    assert (s.kind if s else None) is want
    if s is not None:
        own = [c for c in mlp.children() if not isinstance(c, torch.nn.Linear)]
        assert own == [s.act]  # the module's own activation object, never a substitute


@pytest.mark.parametrize("family", list(KINDS))
def test_parity_batch2_uneven_tiles(family: str) -> None:
    mlp = _mlp(family)
    x = torch.randn(2, 23, H, requires_grad=True)
    dy = torch.randn(2, 23, H)
    ref = grads_of(mlp, mlp, x, [dy])
    got = grads_of(lambda t: tiled_mlp(mlp, t, num_tiles=5), mlp, x, [dy])
    assert_same_grads(got, ref)


def test_gemma_activation_is_gelu_tanh_not_silu() -> None:
    # Peer bug: non-SwiGLU models silently computed with SiLU.
    mlp = _mlp("gemma")
    x = torch.randn(40, H)
    y = tiled_mlp(mlp, x, num_tiles=3)
    as_silu = mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    assert torch.allclose(y, mlp(x), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(y, as_silu, rtol=1e-3, atol=1e-4)
