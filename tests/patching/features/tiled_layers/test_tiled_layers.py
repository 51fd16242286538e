"""patch_model(tiled_layers=True): the token-wise rest of each Llama-family decoder layer runs as
two tiled blocks around the model's attention, exactly (outputs, input gradients, every
parameter gradient), alone and with checkpointing, offloading and LoRA; other layers are
refused with one line."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from hf_models import VOCAB, tiny_causal_lm
from tiledmlp import patch_model, unpatch_model
from tiledmlp.config.stacks import STACK_PATCHES, STACKS, stack_patch
from tiledmlp.integrations import trl
from tiledmlp.patching.features.activation_offloading import enable_checkpointing
from tiledmlp.patching.features.tiled_layers import LAYER, layer_parts
from tiledmlp.patching.patch import tile_counts

from conftest import (
    assert_close_rel,
    assert_same_sgd_steps,
    assert_tiled_layers_bf16_within_twice_untiled,
)

# Families whose decoder layer is norm -> attention -> residual -> norm -> MLP -> residual
# (Qwen3 with per-head q/k norms; Mistral and Qwen2 pass a sliding window to the attention).
# Beyond it (tests/patching/features/tiled_layers/test_tiled_layer_families.py has more): Gemma 2/3 with norms after
# the attention and the MLP, Phi-3's fused q/k/v, Qwen3-MoE's experts.
RECOGNISED = [
    "llama",
    "qwen3",
    "mistral",
    "qwen2",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "qwen3_moe",
]
REFUSED = {
    "gpt_neox": "no self_attn",
    "gpt2": "no self_attn",
}


def _ids(batch: int = 2, seq: int = 19) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(3, VOCAB, (batch, seq), generator=g)


def _layer_tiles(model: torch.nn.Module) -> list[int]:
    return [c.tiles for n, c in tile_counts(model).items() if n.endswith(tuple("0123456789"))]


@pytest.mark.parametrize("family", RECOGNISED)
def test_tiled_layers_train_exactly_like_untiled(family: str) -> None:
    model = tiny_causal_lm(family)
    ref = copy.deepcopy(model)
    report = patch_model(model, num_tiles=3, tiled_layers=True, tiled_norms=True, tiled_loss=True)
    layers = [n for n in report.patched if report.paths[n] == "generic: decoder layer"]
    assert layers == [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    assert "decoder layer(s)" in str(report)
    assert_same_sgd_steps(model, ref, _ids())
    assert _layer_tiles(model) == [2 * 3] * model.config.num_hidden_layers  # 2 steps x 3 tiles


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_other_layers_are_refused_in_one_line(family: str) -> None:
    model = tiny_causal_lm(family)
    with pytest.raises(ValueError, match=REFUSED[family]) as err:
        patch_model(model, tiled_layers=True)
    assert "\n" not in str(err.value) and "drop tiled_layers" in str(err.value)
    assert all(LAYER not in m.__dict__ and "forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("num_tiles", [1, 4, 100])  # one tile, uneven, more tiles than tokens
def test_layer_output_and_every_gradient_match(num_tiles: int) -> None:
    model = tiny_causal_lm("qwen3")
    layer = model.model.layers[0]
    ref = copy.deepcopy(layer)
    patch_model(model, num_tiles=num_tiles, tiled_layers=True, tiled_mlp=False)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, 32, generator=g)
    positions = torch.arange(9)[None]
    emb = model.model.rotary_emb(x, positions)
    dy = torch.randn(2, 9, 32, generator=g)  # a non-uniform upstream gradient
    results = []
    for m in (layer, ref):
        xi = x.clone().requires_grad_()
        y = m(xi, position_embeddings=emb, position_ids=positions)
        y.backward(dy)
        results.append((y.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters()}))
    (y, dx, grads), (y_ref, dx_ref, grads_ref) = results
    assert_close_rel(y, y_ref, "output")
    assert_close_rel(dx, dx_ref, "input grad")
    assert grads.keys() == grads_ref.keys() and all(v is not None for v in grads.values())
    for name in grads:
        assert_close_rel(grads[name], grads_ref[name], f"{name}.grad")


def test_input_without_grad_still_trains_the_weights() -> None:
    model = tiny_causal_lm("llama")
    layer = model.model.layers[0]
    ref = copy.deepcopy(layer)
    patch_model(model, num_tiles=2, tiled_layers=True, tiled_mlp=False)
    x = torch.randn(1, 8, 32)
    positions = torch.arange(8)[None]
    emb = model.model.rotary_emb(x, positions)
    for m in (layer, ref):
        m(x, position_embeddings=emb, position_ids=positions).square().sum().backward()
    for (name, p), q in zip(layer.named_parameters(), ref.parameters()):
        assert_close_rel(p.grad, q.grad, f"{name}.grad")


@pytest.mark.parametrize("offload", [False, True])
def test_tiled_layers_with_checkpointing_and_offloading_are_exact(offload: bool) -> None:
    model = tiny_causal_lm("llama")
    ref = copy.deepcopy(model)
    for m in (model, ref):
        enable_checkpointing(m)
    patch_model(
        model,
        num_tiles=3,
        tiled_loss=True,
        tiled_norms=True,
        tiled_layers=True,
        activation_offloading=offload,
    )
    assert_same_sgd_steps(model, ref, _ids())
    assert all(t > 0 for t in _layer_tiles(model))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_checkpointing_recomputes_the_pre_attention_block_only(checkpointing: bool) -> None:
    model = tiny_causal_lm("llama")
    if checkpointing:
        enable_checkpointing(model)
    patch_model(model, num_tiles=2, tiled_layers=True, tiled_mlp=False)
    calls = {"pre": 0, "post": 0}
    for layer in model.model.layers:
        parts = layer.__dict__[LAYER]
        for name, block in (("pre", parts.pre), ("post", parts.post)):
            block.register_forward_hook(lambda *_, n=name: calls.__setitem__(n, calls[n] + 1))
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    layers = model.config.num_hidden_layers
    # 2 tiles each: forward, the tiled backward's recompute, and with checkpointing the
    # layer's recompute, which stops after the attention core (the post block's anchor).
    assert calls == {"pre": layers * 2 * (3 if checkpointing else 2), "post": layers * 2 * 2}


def test_peft_lora_projections_are_exact() -> None:
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
        init_lora_weights=False,
    )
    ref = peft.get_peft_model(tiny_causal_lm("llama"), cfg)
    model = copy.deepcopy(ref)
    report = patch_model(model, num_tiles=3, tiled_layers=True)
    assert sum(p == "generic: decoder layer" for p in report.paths.values()) == 2
    assert_same_sgd_steps(model, ref, _ids())
    assert all(t > 0 for t in _layer_tiles(model))


def test_generation_with_a_cache_matches_untiled() -> None:
    model = tiny_causal_lm("mistral").eval()
    ref = copy.deepcopy(model)
    patch_model(model, num_tiles=2, tiled_layers=True)
    prompt = _ids(1, 6)
    kwargs = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(model.generate(prompt, **kwargs), ref.generate(prompt, **kwargs))


def test_unpatch_restores_the_layers_and_state_dict_is_unchanged() -> None:
    model = tiny_causal_lm("qwen3")
    keys = list(model.state_dict())
    report = patch_model(model, num_tiles=2, tiled_layers=True, tiled_mlp=False)
    assert list(model.state_dict()) == keys
    restored = unpatch_model(model)
    assert set(report.patched) <= set(restored)
    assert all("forward" not in m.__dict__ and LAYER not in m.__dict__ for m in model.modules())


def test_the_probe_leaves_weights_modes_and_rng_alone() -> None:
    model = tiny_causal_lm("llama").eval()
    layer = model.model.layers[0]
    before = {n: p.detach().clone() for n, p in layer.named_parameters()}
    rng = torch.random.get_rng_state()
    assert not isinstance(layer_parts(layer), str)
    assert torch.equal(rng, torch.random.get_rng_state())
    assert not any(m.training for m in layer.modules())
    assert model.config._attn_implementation == "sdpa"
    for n, p in layer.named_parameters():
        assert torch.equal(p, before[n]), n


# Qwen3-MoE's experts (grouped matmuls) do not run in float64 on CPU: no float64 reference.
@pytest.mark.parametrize("family", [f for f in RECOGNISED if f != "qwen3_moe"])
def test_bf16_error_at_most_twice_the_untiled_error(family: str) -> None:
    assert_tiled_layers_bf16_within_twice_untiled(tiny_causal_lm(family), _ids())


@pytest.mark.parametrize("stack", [s for s in STACKS if STACK_PATCHES[s] is not None])
def test_a_dropped_patched_model_frees_its_tensors_at_once(stack: str) -> None:
    # A patched forward lives in its module's __dict__; holding the module strongly made a cycle
    # that only the cycle collector frees, so a process measuring one stack after another kept
    # the earlier models' weights allocated (on a GPU: the tiled-layer step at 32K held two
    # dropped models' weights beside its own). Dropped, a patched model goes as an unpatched one.
    # Third-party modules first imported inside patch_model can keep their importer's frames
    # (bitsandbytes keeps a traceback): import what the TRL hook imports before the model exists.
    trl.ready()
    gc.disable()
    try:
        model = tiny_causal_lm("llama")
        enable_checkpointing(model)
        patch_model(model, stack_patch(stack, 2))
        ids = _ids()
        model(input_ids=ids, labels=ids).loss.backward()
        tensors = [weakref.ref(t) for p in model.parameters() for t in (p, p.grad) if t is not None]
        del model
        alive = [t for t in (r() for r in tensors) if t is not None]
        assert not alive, f"{len(alive)} of {len(tensors)} weights and gradients still alive"
    finally:
        gc.enable()
