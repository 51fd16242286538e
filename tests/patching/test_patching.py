"""patch_model on real Hugging Face models: exact loss and grads per family, reversibility,
state_dict, idempotence, errors, PEFT LoRA, other frameworks' option names."""

from __future__ import annotations

import argparse
import copy

import pytest
import torch
from torch import nn

from hf_models import EXPECTED_KIND, FAMILIES, VOCAB, tiny_causal_lm
from tiledmlp import patch_from_args, patch_model, unpatch_model

from conftest import assert_close_rel
from generic_modules import WeirdGated

pytest.importorskip("transformers")


def loss_and_grads(
    model: nn.Module, ids: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def assert_same_training_step(got: nn.Module, ref: nn.Module, ids: torch.Tensor) -> None:
    loss, grads = loss_and_grads(got, ids)
    ref_loss, ref_grads = loss_and_grads(ref, ids)
    assert_close_rel(loss, ref_loss, "loss")
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        assert_close_rel(grads[name], ref_grads[name], name)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_loss_and_every_grad_match(family: str) -> None:
    ref = tiny_causal_lm(family)
    model = copy.deepcopy(ref)
    report = patch_model(model, num_tiles=3)  # 23 tokens x batch 2 = 46 -> 16, 15, 15
    if family == "qwen3_moe" and set(report.paths.values()) == {"fast: gated"}:
        # transformers 4.x: experts are a list of MLPs, each tiled on the tokens routed to it.
        assert len(report.patched) == 2 * 4, report
    else:
        assert len(report.patched) == 2, report
        assert set(report.paths.values()) == {EXPECTED_KIND[family]}
    ids = torch.randint(3, VOCAB, (2, 23))
    assert_same_training_step(model, ref, ids)


def test_moe_aux_loss_keeps_router_gradients() -> None:
    ref = tiny_causal_lm("qwen3_moe")
    model = copy.deepcopy(ref)
    patch_model(model, num_tiles=4)
    ids = torch.randint(3, VOCAB, (2, 19))
    out, ref_out = model(input_ids=ids, labels=ids), ref(input_ids=ids, labels=ids)
    assert out.aux_loss is not None and out.aux_loss.requires_grad
    (g,) = torch.autograd.grad(out.aux_loss, model.model.layers[0].mlp.gate.weight)
    (rg,) = torch.autograd.grad(ref_out.aux_loss, ref.model.layers[0].mlp.gate.weight)
    assert g.abs().max() > 0
    assert_close_rel(g, rg, "router grad from the aux loss")


def test_state_dict_unchanged_and_save_pretrained_round_trip(tmp_path) -> None:
    import transformers as tr

    ref = tiny_causal_lm("llama")
    model = copy.deepcopy(ref)
    patch_model(model, num_tiles=2)
    sd, ref_sd = model.state_dict(), ref.state_dict()
    assert list(sd) == list(ref_sd)
    assert all(torch.equal(sd[k], ref_sd[k]) for k in sd)
    model.save_pretrained(tmp_path)
    loaded = tr.LlamaForCausalLM.from_pretrained(tmp_path).float().train()
    assert all(torch.equal(loaded.state_dict()[k], ref_sd[k]) for k in ref_sd)
    patch_model(loaded, num_tiles=2)
    ids = torch.randint(3, VOCAB, (2, 9))
    assert_same_training_step(loaded, ref, ids)


def test_unpatch_restores_original_forwards_exactly() -> None:
    model = tiny_causal_lm("llama")
    mlp = model.model.layers[0].mlp
    cls_forward = type(mlp).forward
    report = patch_model(model)
    assert "forward" in mlp.__dict__ and type(mlp).forward is cls_forward  # instance, not class
    restored = unpatch_model(model)
    assert sorted(restored) == report.patched
    assert "forward" not in mlp.__dict__
    assert all(not k.startswith("_tiledmlp") for m in model.modules() for k in m.__dict__)


def test_unpatch_restores_a_pre_existing_instance_forward() -> None:
    # e.g. accelerate's hooks replace module.forward on the instance
    model = tiny_causal_lm("llama")
    mlp = model.model.layers[0].mlp
    own = mlp.forward
    mlp.forward = lambda x: own(x)
    wrapper = mlp.forward
    patch_model(model)
    assert mlp.forward is not wrapper
    unpatch_model(model)
    assert mlp.forward is wrapper


def test_patch_is_idempotent_and_updates_policy() -> None:
    model = tiny_causal_lm("llama")
    first = patch_model(model, num_tiles=2)
    fwd = model.model.layers[0].mlp.forward
    second = patch_model(model, num_tiles=2)
    assert first.patched == second.patched and model.model.layers[0].mlp.forward is fwd
    third = patch_model(model, num_tiles=5)
    assert third.config.num_tiles == 5 and model.model.layers[0].mlp.forward is fwd
    ref = tiny_causal_lm("llama")
    assert_same_training_step(model, ref, torch.randint(3, VOCAB, (2, 11)))


def test_nothing_to_patch_is_an_error() -> None:
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 10))
    with pytest.raises(ValueError, match="found no MLP to tile in Sequential"):
        patch_model(model)


def test_not_understood_mlp_is_an_error_unless_generic() -> None:
    model = nn.Sequential(nn.Embedding(10, 16), WeirdGated(16, 24), nn.Linear(16, 10))
    with pytest.raises(
        ValueError, match=r"look like MLPs but their structure is not understood: 1 "
    ):
        patch_model(model)
    report = patch_model(model, generic=True, num_tiles=2)
    assert report.paths == {"1": "generic: custom"}
    ref = copy.deepcopy(model)
    unpatch_model(ref)
    x = torch.randint(0, 10, (2, 7))
    torch.manual_seed(0)
    dy = torch.randn(2, 7, 10)
    model(x).backward(dy)
    ref(x).backward(dy)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close_rel(p.grad, q.grad, n)


def test_unknown_hidden_size_is_an_error() -> None:
    with pytest.raises(ValueError, match="pass hidden_size"):
        patch_model(nn.Sequential(WeirdGated(16, 24)))


def test_bad_policy_is_an_error() -> None:
    with pytest.raises(ValueError, match="num_tiles must be"):
        patch_model(tiny_causal_lm("llama"), num_tiles=0)


def test_peft_lora_on_mlp_projections_exact() -> None:
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["gate_proj", "up_proj", "down_proj"],
        init_lora_weights=False,
    )
    ref = peft.get_peft_model(tiny_causal_lm("llama"), cfg)
    model = copy.deepcopy(ref)
    report = patch_model(model, num_tiles=3)
    assert set(report.paths.values()) == {"generic: lora-wrapped MLP"}
    ids = torch.randint(3, VOCAB, (2, 17))
    loss, grads = loss_and_grads(model, ids)
    ref_loss, ref_grads = loss_and_grads(ref, ids)
    assert all("lora_" in n for n in grads)  # the frozen base gets no gradient
    assert grads.keys() == ref_grads.keys() and len(grads) == 2 * 3 * 2
    assert_close_rel(loss, ref_loss, "loss")
    for n in grads:
        assert_close_rel(grads[n], ref_grads[n], n)


def test_other_frameworks_option_names() -> None:
    model = tiny_causal_lm("llama")
    assert patch_from_args(model, {"use_tiled_mlp": False}) is None
    assert patch_from_args(model, {}) is None
    report = patch_from_args(model, {"use_tiled_mlp": "true", "tiled_mlp_num_shards": "4"})
    assert report is not None and report.config.num_tiles == 4
    ns = argparse.Namespace(use_tiled_mlp=True, tiled_mlp_num_shards=None)
    assert patch_from_args(model, ns).config.num_tiles == "auto"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="use_tiled_mlp must be true or false"):
        patch_from_args(model, {"use_tiled_mlp": "maybe"})
    with pytest.raises(ValueError, match="tiled_mlp_num_shards must be"):
        patch_from_args(model, {"use_tiled_mlp": True, "tiled_mlp_num_shards": "-3"})


def test_deepcopy_of_a_patched_model_uses_its_own_weights() -> None:
    model = tiny_causal_lm("llama")
    patch_model(model, num_tiles=3)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.model.layers[0].mlp.parameters():
            p.mul_(2.0)
    ref = copy.deepcopy(clone)
    unpatch_model(ref)
    ids = torch.randint(3, VOCAB, (2, 13))
    assert clone.model.layers[0].mlp.forward.__self__ is clone.model.layers[0].mlp
    assert_same_training_step(clone, ref, ids)


class _MixesTokens(nn.Module):
    """MLP-shaped (two projections and an activation) but mixes tokens: must be skipped."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * hidden)
        self.fc2 = nn.Linear(2 * hidden, hidden)
        self.act = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x.cumsum(dim=-2))))


def test_mlp_shaped_but_not_token_wise_is_skipped_with_a_reason() -> None:
    from tiledmlp.models.mlps import GatedMLP

    model = nn.Sequential(
        nn.Embedding(10, 16), _MixesTokens(16), GatedMLP(16, 24), nn.Linear(16, 10)
    )
    report = patch_model(model, num_tiles=2)
    assert report.patched == ["2"]
    assert [name for name, _ in report.skipped] == ["1"]
    assert "not token-wise" in report.skipped[0][1]
    assert "skipped 1:" in str(report)


def test_meta_device_weights_are_skipped_not_probed() -> None:
    from tiledmlp.models.mlps import GatedMLP

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 16), GatedMLP(16, 24))
    with pytest.raises(ValueError, match=r"found no MLP.*skipped 1: weights on the meta device"):
        patch_model(model)


def test_tile_counts_count_the_models_calls_not_patch_models_probes() -> None:
    from tiledmlp.patching import tile_counts

    model = tiny_causal_lm("llama")
    report = patch_model(model, num_tiles=3, tiled_loss=True, tiled_norms=True)
    counts = tile_counts(model)
    assert set(counts) == set(report.patched) and report.loss == "tiled"
    assert all(c.calls == 0 and c.tiles == 0 for c in counts.values()), counts
    ids = torch.randint(0, VOCAB, (2, 23))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(c.calls == 1 and c.last == 3 for c in tile_counts(model).values())
