"""The typed configuration: TilePolicy, PatchConfig, the value parsers and the one key parser
(ours and other frameworks' keys) behind patch_model, patch_from_args and the train options."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import logging

import pytest
import torch
from torch import nn

from hf_models import VOCAB, tiny_causal_lm
from tiledmlp import patch_from_args, patch_model, unpatch_model
from tiledmlp.config import (
    PatchConfig,
    TilePolicy,
    parse_budget_gb,
    parse_dtype,
    parse_tile_policy,
    read_keys,
)
from tiledmlp.ops.mlp.tile_rules import resolve_tiles
from tiledmlp.ops.tiling.tiles import split_by_tile_tokens, split_even
from tiledmlp.patching import tile_counts

from conftest import assert_close_rel

pytest.importorskip("transformers")


@pytest.mark.parametrize(
    ("num_tiles", "tile_tokens", "rule", "spelled"),
    [
        ("auto", None, "auto", "auto"),
        ("arctic", None, "arctic", "arctic"),
        (4, None, "count", 4),
        ("target:0.5", None, "target", "target:0.5"),
        ("auto", 128, "tokens", "auto"),
    ],
)
def test_tile_policy_spellings(
    num_tiles: object, tile_tokens: object, rule: str, spelled: object
) -> None:
    policy = TilePolicy.of(num_tiles, tile_tokens)  # type: ignore[arg-type]
    assert policy.rule == rule and policy.num_tiles == spelled
    assert policy.tile_tokens == tile_tokens
    assert TilePolicy.of(policy) is policy  # a policy is taken as it is, not checked again
    assert TilePolicy.of(policy.num_tiles, policy.tile_tokens) == policy


def test_tile_policy_resolves_and_derives_the_loss_policy() -> None:
    assert resolve_tiles(TilePolicy.of(3), 10, 4, None) == split_even(10, 3)
    assert resolve_tiles(TilePolicy.of(tile_tokens=4), 10, 4, None) == split_by_tile_tokens(10, 4)
    assert resolve_tiles(TilePolicy.of("arctic"), 10, 4, None) == split_even(10, 3)  # ceil(10 / 4)
    assert TilePolicy.budget(2).target_bytes == 2 * 2**30
    assert TilePolicy.of(6).for_loss() == TilePolicy.of(6)
    for mlp_only in ("arctic", "target:2"):
        assert TilePolicy.of(mlp_only).for_loss() == TilePolicy()
    assert TilePolicy.of(tile_tokens=64).for_loss() == TilePolicy()
    with pytest.raises(ValueError, match=r"build it with TilePolicy\.of"):
        TilePolicy("count", 0)


def test_edge_spellings_parse_to_the_same_objects() -> None:
    assert parse_tile_policy(" Target: 2GB") == TilePolicy.of("target:2") == parse_budget_gb("2gb")
    assert parse_tile_policy("8") == TilePolicy.of(8) and parse_tile_policy(None) == TilePolicy()
    assert parse_tile_policy("ARCTIC") == TilePolicy.of("arctic")
    with pytest.raises(ValueError, match="shards must be a positive int, 'auto'"):
        parse_tile_policy("-3", "shards")
    for bad in (0, -1, "x", True, float("inf")):
        with pytest.raises(ValueError, match="budget must be a positive number of GiB"):
            parse_budget_gb(bad, "budget")
    # one dtype table for train, bench and plan
    assert [parse_dtype(s) for s in ("half", "bf16", "torch.float32", "FP16")] == [
        "float16",
        "bfloat16",
        "float32",
        "float16",
    ]
    with pytest.raises(ValueError, match="--dtype must be one of float32, fp32"):
        parse_dtype("fp8", "--dtype")


def test_patch_config_checks_once_with_one_message() -> None:
    with pytest.raises(
        TypeError, match="unknown option 'num_tile' for patch_model; did you mean 'num_tiles'"
    ):
        PatchConfig.from_kwargs({"num_tile": 4})
    with pytest.raises(ValueError, match="nothing to do with tiled_mlp=False"):
        PatchConfig(tiled_mlp=False)
    with pytest.raises(ValueError, match="sequence_parallel_size must be an integer >= 1, got 0"):
        PatchConfig(sequence_parallel_size=0)
    with pytest.raises(ValueError, match="hidden_size must be an integer >= 1"):
        PatchConfig(hidden_size=True)
    with pytest.raises(ValueError, match="tiled_loss must be True or False"):
        PatchConfig(tiled_loss="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a number of tiles, tokens per tile or 'auto'"):
        PatchConfig(loss_tiles=TilePolicy.of("arctic"))
    config = PatchConfig.from_kwargs({"num_tiles": 4, "tiled_loss": True})
    assert config.tiles == TilePolicy.of(4) and config.loss_policy == TilePolicy.of(4)
    assert PatchConfig.from_kwargs({"loss_num_tiles": 2}).loss_policy == TilePolicy.of(2)


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_patch_model_takes_a_config_or_keywords() -> None:
    model = tiny_causal_lm("llama")
    ref = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (2, 40))
    report = patch_model(model, PatchConfig(tiles=TilePolicy.of(3), tiled_loss=True))
    assert report.config.num_tiles == 3 and report.loss == "tiled"
    loss, grads = _loss_and_grads(model, ids)
    assert {c.last for c in tile_counts(model).values()} == {3}
    ref_loss, ref_grads = _loss_and_grads(ref, ids)
    assert_close_rel(loss, ref_loss, "loss")
    for name in ref_grads:
        assert_close_rel(grads[name], ref_grads[name], name)
    with pytest.raises(TypeError, match="not both"):
        patch_model(model, PatchConfig(), num_tiles=2)
    with pytest.raises(TypeError, match="config must be a PatchConfig"):
        patch_model(model, 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"unknown option 'tiled_los'.*did you mean 'tiled_loss'"):
        patch_model(model, tiled_los=True)


def test_patch_from_args_takes_an_axolotl_recipe_with_every_feature() -> None:
    model = tiny_causal_lm("llama")
    ref = copy.deepcopy(model)
    recipe = {
        "tiled_mlp": True,
        "tiled_mlp_num_shards": 2,
        "tiled_mlp_use_original_mlp": True,  # axolotl's default: what tiledmlp always does
        "chunked_cross_entropy": True,
        "chunked_cross_entropy_num_chunks": 5,
        "learning_rate": 1e-4,  # not ours: left to the framework
    }
    report = patch_from_args(model, recipe)
    assert report is not None and report.loss == "tiled" and report.config.num_tiles == 2
    ids = torch.randint(0, VOCAB, (2, 40))
    loss, grads = _loss_and_grads(model, ids)
    assert {c.last for c in tile_counts(model).values()} == {2}
    ref_loss, ref_grads = _loss_and_grads(ref, ids)
    assert_close_rel(loss, ref_loss, "loss")
    for name in ref_grads:
        assert_close_rel(grads[name], ref_grads[name], name)
    unpatch_model(model)


@pytest.mark.parametrize(
    ("args", "check"),
    [
        ({"tiled_loss": "true"}, lambda r: r.loss == "tiled" and not r.patched),
        (
            {"use_tiled_mlp": True, "tiledmlp_tiled_norms": True},
            lambda r: any("norm" in n for n in r.patched),
        ),
        (
            argparse.Namespace(tiled_mlp=True, activation_offloading=True, other=None),
            lambda r: r.offloading is not None,
        ),
        (
            {"use_tiled_mlp": True, "tile_budget_gb": 0.5},
            lambda r: r.config.num_tiles == "target:0.5",
        ),
        (
            {"tiled_mlp": "target:1", "tiledmlp_tile_tokens": None},
            lambda r: r.config.num_tiles == "target:1",
        ),
        ({"tiled_mlp": True, "tile_tokens": "16"}, lambda r: r.config.tile_tokens == 16),
    ],
)
def test_patch_from_args_applies_each_feature(args: object, check: object) -> None:
    model = tiny_causal_lm("llama")
    report = patch_from_args(model, args)
    assert report is not None and check(report), report  # type: ignore[operator]


@dataclasses.dataclass
class _TrainingArguments:
    learning_rate: float = 1e-4
    sequence_parallel_degree: int | None = None
    context_parallel_size: int | None = None
    use_tiled_mlp: bool = False


def test_sequence_parallel_keys_are_applied_not_ignored() -> None:
    model = tiny_causal_lm("llama")
    for args in (
        _TrainingArguments(context_parallel_size=2),
        _TrainingArguments(sequence_parallel_degree=2, use_tiled_mlp=True),
        {"sequence_parallel_size": "2"},
    ):
        with pytest.raises(ValueError, match="process group"):
            patch_from_args(model, args)  # asks for Ulysses over 2 ranks: needs torchrun
    with pytest.raises(ValueError, match="disagree"):
        patch_from_args(
            model, _TrainingArguments(sequence_parallel_degree=2, context_parallel_size=4)
        )
    assert patch_from_args(model, _TrainingArguments(context_parallel_size=1)) is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"tiled_mlp": True, "tiled_mlp_num_shard": 4}, "did you mean 'tiled_mlp_num_shards'"),
        ({"tiledmlp_tiled_los": True}, "did you mean 'tiled_loss'"),
        ({"tile_budget": 2}, "did you mean 'tile_budget_gb'"),
        ({"tiled_mlp": True, "tiled_mlp_use_original_mlp": False}, "drop the key or set it"),
        ({"tiled_loss": True, "chunked_cross_entropy": False}, "disagree"),
        ({"tiled_mlp": "maybe"}, "tiled_mlp must be a positive int, 'auto'"),
        ({"use_tiled_mlp": True, "num_tiles": 2, "tile_tokens": 8}, "disagree"),
    ],
)
def test_patch_from_args_refuses_what_it_cannot_apply(args: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        patch_from_args(tiny_causal_lm("llama"), args)


def test_a_policy_with_nothing_turned_on_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tiledmlp"):
        assert patch_from_args(tiny_causal_lm("llama"), {"tiled_mlp_num_shards": 4}) is None
    assert "tiled_mlp_num_shards given but no feature is turned on" in caplog.text


def test_read_keys_only_and_spellings() -> None:
    found = read_keys({"--tiled-mlp-num-shards": "4", "tiledmlp_use_tiled_mlp": "yes"})
    assert found["tiles"].value == TilePolicy.of(4) and found["tiled_mlp"].value is True
    with pytest.raises(ValueError, match="'generic' is not supported here"):
        read_keys({"generic": True}, only=("tiles",), what="option")


def test_the_planner_takes_a_tile_policy_not_its_spelling() -> None:
    """Below the edges a tile policy is a TilePolicy: the planner's step and stacks refuse a
    spelling with a message that says how to build one."""
    from tiledmlp.config.plan import StepSpec
    from tiledmlp.config.stacks import stack_patch

    patch = stack_patch("tiled_mlp", TilePolicy.of(4))
    assert patch is not None and patch.tiles == TilePolicy("count", 4)
    assert StepSpec(seq_len=8, tiles=TilePolicy.of("arctic")).tiles.rule == "arctic"
    with pytest.raises(TypeError, match=r"tiles must be a TilePolicy \(e.g. TilePolicy.of\(4\)"):
        stack_patch("tiled_mlp", 4)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tiles must be a TilePolicy"):
        StepSpec(seq_len=8, tiles="auto")  # type: ignore[arg-type]
