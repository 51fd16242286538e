"""The options of `tiledmlp train` (in process, no training): spellings, aliases, config files,
other frameworks' tiling keys in patch_from_args, the "target:<GB>" policy, the byte tokenizer and the
CLI conventions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tiledmlp.cli import main, normalise_argv
from tiledmlp.config import PatchConfig
from tiledmlp.models.mlps import GatedMLP
from tiledmlp.models.presets import default_learning_rate
from tiledmlp.ops import recognise
from tiledmlp.ops.mlp.memory_model import MemoryModel
from tiledmlp.ops.mlp.tile_rules import resolve_tiles
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.patching.args import patch_from_args, tiling_from_args
from tiledmlp.train.options import options_from, read_config_file

pytest.importorskip("transformers")


def test_aliases_spellings_and_dtype_names() -> None:
    o = options_from({"--steps": "4", "lr": "1e-3", "batch-size": 2, "dtype": "bf16"})
    assert (o.max_steps, o.learning_rate, o.per_device_train_batch_size) == (4, 1e-3, 2)
    assert o.dtype == "bfloat16" and options_from({"dtype": "fp32"}).dtype == "float32"
    assert options_from({"deepspeed_config": __file__}).deepspeed == Path(__file__)
    assert options_from({}).patch == PatchConfig(tiled_loss=True)  # the tiled MLPs and loss
    assert options_from({"kernels": "false"}).patch == PatchConfig(tiled_loss=True, kernels=False)
    with pytest.raises(ValueError, match="max_steps given twice"):
        options_from({"steps": 3, "max_steps": 4})
    with pytest.raises(ValueError, match=r"unknown option 'max_step'; known: .*max_steps"):
        options_from({"max_step": 3})
    with pytest.raises(ValueError, match=r"--warmup-steps expected an integer, got 1\.5"):
        options_from({"warmup_steps": 1.5})


@pytest.mark.parametrize(
    ("keys", "enabled", "policy"),
    [
        ({"use_tiled_mlp": True, "tiled_mlp_num_shards": 4}, True, 4),  # ms-swift
        ({"use_tiled_mlp": "false"}, False, "auto"),
        ({"tiled_mlp": True, "tiled_mlp_num_shards": "8"}, True, 8),  # axolotl
        ({"tiled_mlp": "arctic"}, True, "arctic"),  # unsloth's modes
        ({"tiled_mlp": "target:0.5"}, True, "target:0.5"),
        ({"tiled_mlp": "target: 2GB"}, True, "target:2"),
        ({"tiled_mlp": False}, False, "auto"),
        ({"use_tiled_mlp": True, "tile_budget_gb": 0.5}, True, "target:0.5"),  # --tile-budget-gb
        ({"tiled_mlp": "target:2", "tile_budget_gb": "2"}, True, "target:2"),
        ({}, False, "auto"),
    ],
)
def test_other_frameworks_keys(keys: dict, enabled: bool, policy: int | str) -> None:
    assert tiling_from_args(keys) == (enabled, TilePolicy.of(policy))


def test_other_frameworks_keys_refuse_contradictions() -> None:
    with pytest.raises(ValueError, match="disagree"):
        tiling_from_args({"use_tiled_mlp": True, "tiled_mlp": False})
    with pytest.raises(ValueError, match="disagree"):
        tiling_from_args({"tiled_mlp": "arctic", "tiled_mlp_num_shards": 4})
    with pytest.raises(ValueError, match="disagree"):
        options_from({"num_tiles": 2, "tiled_mlp_num_shards": 4})
    with pytest.raises(ValueError, match="disagree"):
        tiling_from_args({"tiled_mlp_num_shards": 4, "tile_budget_gb": 1})
    with pytest.raises(ValueError, match="disagree"):
        options_from({"num_tiles": "arctic", "tile_budget_gb": 1})
    for bad in (0, -1, "x", True):
        with pytest.raises(ValueError, match="positive number of GiB"):
            options_from({"tile_budget_gb": bad})
    assert options_from({"tile_budget_gb": "0.25"}).patch == PatchConfig(
        tiles=TilePolicy.budget(0.25), tiled_loss=True
    )


def test_patch_from_args_takes_each_frameworks_recipe() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_models import BASE
    from tiledmlp.patching import tile_counts, unpatch_model

    model = LlamaForCausalLM(LlamaConfig(**BASE))
    hidden = model.config.hidden_size
    for recipe, tiles in (
        ({"tiled_mlp": True, "tiled_mlp_num_shards": 3}, 3),
        ({"tiled_mlp": "arctic"}, -(-4 * hidden // hidden)),
        ({"use_tiled_mlp": "true", "tiled_mlp_num_shards": 2}, 2),
    ):
        report = patch_from_args(model, recipe)
        assert report is not None and report.patched
        model(torch.randint(0, 50, (1, 4 * hidden)))
        assert {c.last for c in tile_counts(model).values()} == {tiles}, recipe
        unpatch_model(model)
    assert patch_from_args(model, {"tiled_mlp": "false"}) is None


def test_target_policy_fits_the_budget_with_the_fewest_tiles() -> None:
    mlp = GatedMLP(64, 256)
    structure = recognise(mlp)
    assert structure is not None
    model = MemoryModel(structure, torch.float32)
    tokens = 4096
    budget = model.untiled_bytes(tokens) / 5
    plan = resolve_tiles(TilePolicy.of(f"target:{budget / 2**30}"), tokens, 64, model)
    assert plan is not None
    assert model.tiled_bytes(max(plan.sizes)) <= budget
    fewer = -(-tokens // (plan.num_tiles - 1))
    assert model.tiled_bytes(fewer) > budget  # one tile fewer would not fit
    assert resolve_tiles(TilePolicy.of("target:100"), tokens, 64, model) is None  # fits untiled
    generic = resolve_tiles(TilePolicy.of(f"target:{budget / 2**30}"), tokens, 64, None)
    assert generic is not None and generic.num_tiles > 1
    with pytest.raises(ValueError, match="positive number of GiB"):
        TilePolicy.of("target:-1")


def test_config_files(tmp_path: Path) -> None:
    yml = tmp_path / "c.yml"
    yml.write_text("max_steps: 3\nreport_to: [tensorboard]\n")
    assert options_from(read_config_file(yml)).report_to == "tensorboard"
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"seq-len": 64}))
    assert options_from(read_config_file(js)).seq_len == 64
    js.write_text("{oops")
    with pytest.raises(ValueError, match="could not be parsed"):
        read_config_file(js)


def test_default_learning_rates() -> None:
    assert default_learning_rate("tiny", 256) == 2e-3
    assert default_learning_rate("llama3-8b", 4096) == pytest.approx(1.25e-4)
    assert default_learning_rate("/some/model", 4096) == 2e-5


def test_byte_tokenizer_round_trips_and_saves(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from tiledmlp.train.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    text = "def f(x):\n\treturn 'é中'  \x00"
    ids = tok(text)["input_ids"]
    assert ids == [256, *text.encode("utf-8"), 257]
    assert tok.decode(ids, skip_special_tokens=True) == text
    tok.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)(text)["input_ids"] == ids


def test_cli_conventions(capsys: pytest.CaptureFixture[str]) -> None:
    assert normalise_argv(["train", "--max_steps=3", "--use_tiled_mlp", "x_y", "--", "--a_b"]) == [
        "train", "--max-steps=3", "--use-tiled-mlp", "x_y", "--", "--a_b",
    ]  # fmt: skip
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("tiledmlp ")
    assert main(["env", "-v"]) == 0
    assert main(["plan", "--hidden", "64", "--intermediate", "128", "--seq_len", "256",
                 "--dtype", "bf16", "--device", "cpu", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["tiles"] >= 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"fsdp": "full_shard", "fsdp_config": __file__}, "reads no FSDP config"),
        ({"fsdp": "full_shard", "resume_from_checkpoint": "."}, "model only"),
    ],
)
def test_fsdp2_on_a_cpu_only_machine_refuses_what_it_cannot_do(
    extra: dict, message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiledmlp.train.run import run

    if torch.cuda.is_available():
        pytest.skip("the Trainer runs FSDP2 itself on GPUs")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=message):
        run(options_from(extra))  # refused before any process group or model exists
    with pytest.raises(ValueError, match="add --fsdp full_shard"):
        options_from({"fsdp_config": __file__})


def test_the_feature_summary_is_json_with_the_attention_kernel_as_spelled() -> None:
    import json

    from tiledmlp.train.options import options_from

    summary = options_from({"model": "tiny", "attention_kernel": "auto:2"}).feature_summary()
    assert json.loads(json.dumps(summary))["attention_kernel"] == "auto:2"
