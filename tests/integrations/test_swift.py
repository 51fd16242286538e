"""ms-swift: the plugin file `tiledmlp swift-plugin` writes, imported the way ms-swift imports
`--external_plugins` files (its folder first on sys.path, then by base name), patches the model
transformers builds afterwards with the options it carries.

The real `swift sft` runs in scripts/frameworks/run.py (ms-swift pins its own transformers, TRL
and PEFT, so it lives in its own environment); its record is docs/frameworks.json.
"""

from __future__ import annotations

import importlib
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import tiledmlp  # noqa: E402
from tiledmlp.cli import main  # noqa: E402
from tiledmlp.integrations import hf  # noqa: E402
from tiledmlp.integrations.swift import PLUGIN_NAME, plugin_config, write_plugin  # noqa: E402

_CFG = dict(
    vocab_size=258, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, pad_token_id=0,
)  # fmt: skip


@pytest.fixture
def imported(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Imports a plugin file as ms-swift does (swift.utils.import_external_file); undoes the
    switch and the import afterwards."""
    monkeypatch.setattr(sys, "path", list(sys.path))

    def load(path: Path) -> Any:
        sys.path.insert(0, str(path.parent))
        sys.modules.pop(path.stem, None)
        return importlib.import_module(path.stem)

    yield load
    sys.modules.pop(PLUGIN_NAME.removesuffix(".py"), None)
    tiledmlp.disable()
    logging.getLogger("tiledmlp").propagate = True


def test_the_plugin_file_patches_the_model_loaded_after_it(imported: Any, tmp_path: Path) -> None:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**_CFG)).save_pretrained(tmp_path / "m")
    path = write_plugin({"tiled_loss": "true", "tiled_mlp_num_shards": 2}, tmp_path / PLUGIN_NAME)
    assert path == (tmp_path / PLUGIN_NAME).resolve()
    assert hf.enabled() is None
    imported(path)
    config = hf.enabled()
    assert config is not None and config.tiled_loss and config.tiles.num_tiles == 2
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    report = tiledmlp.patching.patch_report(model)
    assert report is not None and report.loss == "tiled" and len(report.patched) == 2
    ids = torch.randint(3, 258, (2, 9))
    out = model(input_ids=ids, labels=ids)
    assert out.logits is None  # the tiled loss
    assert all(c.last == 2 for c in tiledmlp.patching.tile_counts(model).values())


def test_the_command_prints_the_path_alone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "plugin" / PLUGIN_NAME
    assert main(["swift-plugin", "--tiled-loss", "--num-tiles", "auto", "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"{out.resolve()}\n"
    text = out.read_text()
    assert 'activate({"num_tiles": "auto", "tiled_loss": "true"}, check=False)' in text
    compile(text, str(out), "exec")


def test_with_check_the_plugin_checks_the_loaded_model_before_patching_it(
    imported: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**_CFG)).save_pretrained(tmp_path / "m")
    out = tmp_path / "plugin" / PLUGIN_NAME
    assert (
        main(["swift-plugin", "--tiled-loss", "--num-tiles", "2", "--check", "--out", str(out)])
        == 0
    )
    assert "check=True" in out.read_text()
    imported(out)
    logging.getLogger("tiledmlp").propagate = True  # the plugin routes it to ms-swift's handlers
    with caplog.at_level(logging.INFO, logger="tiledmlp"):
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    assert "PASS" in caplog.text  # the verdict, before the patch
    report = tiledmlp.patching.patch_report(model)
    assert report is not None and report.loss == "tiled"


def test_with_check_a_wrong_tiling_stops_the_load(
    imported: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tiledmlp.ops.mlp import function

    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**_CFG)).save_pretrained(tmp_path / "m")
    imported(write_plugin({"num_tiles": 2}, tmp_path / PLUGIN_NAME, check=True))
    backward = function.TiledMLPFunction.backward

    def doubled(ctx: Any, *grads: Any) -> Any:  # a wrong backward: every weight's grad twice
        return tuple(None if g is None else 2 * g for g in backward(ctx, *grads))

    monkeypatch.setattr(function.TiledMLPFunction, "backward", staticmethod(doubled))
    with pytest.raises(ValueError, match="training not started"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tiled-los"], "did you mean --tiled-loss?"),
        (["--num-tiles", "x"], "num_tiles must be a positive int"),
        (["--sequence-parallel-size", "2"], "pass `--sequence_parallel_size N` to swift sft"),
        (["--use-tiled-mlp", "false", "--tiled-mlp", "true"], "disagree"),
    ],
)
def test_the_command_refuses_in_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / PLUGIN_NAME
    assert main(["swift-plugin", *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists()


def test_a_file_named_otherwise_is_refused(tmp_path: Path) -> None:
    # ms-swift imports the file by its base name: `swift.py` would be ms-swift itself
    with pytest.raises(ValueError, match=f"must be named {PLUGIN_NAME}"):
        write_plugin({}, tmp_path / "swift.py")


def test_default_options_are_tiledmlps_defaults() -> None:
    config = plugin_config({})
    assert config.tiled_mlp and not config.tiled_loss and config.tiles.num_tiles == "auto"
    assert (
        plugin_config({"use_tiled_mlp": "true", "tiled_mlp_num_shards": "4"}).tiles.num_tiles == 4
    )
