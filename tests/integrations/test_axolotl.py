"""axolotl: the plugin trains a tiny model from a YAML config with the real axolotl.

axolotl pins its own transformers / TRL / PEFT versions, so it lives in its own environment;
these tests are skipped where axolotl is not installed (the default dev install).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("axolotl")
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")

import tiledmlp
from tiledmlp.integrations import hf
from tiledmlp.train.tokenizer import byte_tokenizer

_YAML = """\
base_model: {model}
datasets:
  - path: {data}
    ds_type: json
    type: completion
sequence_len: 32
micro_batch_size: 4
gradient_accumulation_steps: 1
max_steps: 3
learning_rate: 0.1
optimizer: sgd
lr_scheduler: constant
output_dir: {out}
dataset_prepared_path: {out}/prepared
val_set_size: 0
save_strategy: "no"
logging_steps: 1
bf16: false
fp32: true
seed: 0
"""
_PLUGIN = """\
plugins:
  - tiledmlp.integrations.axolotl.TiledMLPPlugin
"""


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import transformers as tr

    root = tmp_path_factory.mktemp("axolotl")
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(
        vocab_size=258, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=256,
        eos_token_id=257,
    )  # fmt: skip
    tr.LlamaForCausalLM(cfg).save_pretrained(root / "model")
    byte_tokenizer().save_pretrained(root / "model")
    with open(root / "data.jsonl", "w") as f:
        for i in range(32):
            f.write(json.dumps({"text": f"the quick brown fox {i} jumps over the lazy dog"}) + "\n")
    return root


def _config(assets: Path, name: str, extra: str) -> Path:
    out = assets / name
    out.mkdir(exist_ok=True)
    text = _YAML.format(model=assets / "model", data=assets / "data.jsonl", out=out) + extra
    path = out / "config.yml"
    path.write_text(text)
    return path


def _train(path: Path) -> tuple[list[float], Any, Any]:
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.integrations.base import PluginManager
    from axolotl.train import train

    cfg = load_cfg(str(path))
    model, _, trainer = train(cfg=cfg, dataset_meta=load_datasets(cfg=cfg))
    plugins = list(PluginManager.get_instance().plugins.values())
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses, model, plugins


def test_plugin_trains_a_tiny_model_from_yaml(assets: Path) -> None:
    ref_losses, ref_model, _ = _train(_config(assets, "plain", ""))
    plugin_yaml = _PLUGIN + "tiledmlp: true\ntiledmlp_tiled_loss: true\ntiledmlp_num_tiles: 2\n"
    losses, model, plugins = _train(_config(assets, "tiled", plugin_yaml))
    (plugin,) = [p for p in plugins if type(p).__name__ == "TiledMLPPlugin"]
    assert plugin.report is not None and plugin.report.loss.startswith("tiled")
    assert hf.is_patched(model)
    counts = tiledmlp.patching.tile_counts(model)
    assert counts and all(c.last == 2 for c in counts.values())  # the MLPs ran in 2 tiles
    assert len(losses) == len(ref_losses) == 3
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step + 1}: {a} != {b} (without the plugin)"
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=name)


def test_plugin_with_lora_turns_axolotls_lora_mlp_kernels_off(assets: Path) -> None:
    """axolotl turns its LoRA MLP kernels on by itself for LoRA; they replace the MLP forward,
    so the plugin turns them off before axolotl validates the config."""
    from axolotl.cli.config import load_cfg

    lora = "adapter: lora\nlora_r: 4\nlora_alpha: 8\nlora_target_modules: [q_proj, gate_proj]\n"
    path = _config(assets, "lora", _PLUGIN + "tiledmlp: true\ntiledmlp_tiled_loss: true\n" + lora)
    assert load_cfg(str(path)).lora_mlp_kernel is False
    losses, model, _ = _train(path)
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    report = tiledmlp.patching.patch_report(model)
    assert report is not None and report.loss.startswith("tiled")
    assert report.paths["base_model.model.model.layers.0.mlp"] == "generic: lora-wrapped MLP"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("tiledmlp: true\ntiled_mlp: true\n", "axolotl's own tiled MLP"),
        ("tiledmlp: true\ntiledmlp_tiled_los: true\n", "did you mean `tiledmlp_tiled_loss`"),
        ("tiledmlp_tiled_loss: true\n", "without `tiledmlp: true`"),
        ("tiledmlp: true\nlora_mlp_kernel: true\n", "`lora_mlp_kernel` replaces the MLP"),
        (
            "tiledmlp: true\ntiledmlp_tiled_loss: true\ncut_cross_entropy: true\n",
            "both replace the loss",
        ),
    ],
)
def test_contradictions_refused_with_the_reason(assets: Path, extra: str, message: str) -> None:
    """One line (SystemExit's message: stderr, exit status 1) before axolotl's schema runs; the
    schema's validator says the same where a config reaches it without the plugin's register."""
    import yaml
    from axolotl.cli.config import load_cfg

    from tiledmlp.integrations.axolotl import TiledMLPArgs

    path = _config(assets, "bad", _PLUGIN + extra)
    with pytest.raises(SystemExit) as exc:
        load_cfg(str(path))
    text = str(exc.value.code)
    assert message in text and "\n" not in text and text.startswith("tiledmlp: ")
    data = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "plugins"}
    with pytest.raises(ValueError, match=message):
        TiledMLPArgs.model_validate(data)


def test_the_report_and_the_tile_counts_go_to_axolotls_logger(
    assets: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """axolotl shows its own loggers at INFO and other libraries' at WARNING: the plugin says
    what it did under `axolotl.`, with the tiles `auto` chose after the first step. (axolotl
    configures logging while it trains, which resets handlers below its logger: pytest's
    capture, on the root, sees the records that propagate.)"""
    name = "axolotl.integrations.tiledmlp"
    with caplog.at_level(logging.INFO, logger=name):
        extra = _PLUGIN + "tiledmlp: true\ntiledmlp_tiled_loss: true\n"
        _train(_config(assets, "told", extra))
    said = [r.getMessage() for r in caplog.records if r.name == name]
    assert any("loss: tiled" in m for m in said), said
    steps = {m for m in said if m.startswith("tiledmlp: step 1 ran ")}
    assert len(steps) == 1 and "2 MLP(s) in " in steps.pop(), said


def test_the_example_config_trains(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/axolotl: make_tiny.py, then tiny.yml as it is."""
    import runpy
    import shutil

    example = Path(__file__).resolve().parents[2] / "examples" / "axolotl"
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(example / "make_tiny.py"), run_name="__main__")
    shutil.copy(example / "tiny.yml", tmp_path / "tiny.yml")
    losses, model, _ = _train(tmp_path / "tiny.yml")
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert hf.is_patched(model)


def test_patch_options_leave_attention_to_axolotl_context_parallelism() -> None:
    from tiledmlp.integrations.axolotl import patch_options

    cfg = {"tiledmlp": True, "tiledmlp_tiled_norms": True, "context_parallel_size": 2}
    assert patch_options(cfg) == {"tiled_norms": True}
    cfg = {"tiledmlp": True, "tiledmlp_sequence_parallel_size": 2}
    assert patch_options(cfg) == {"sequence_parallel_size": 2}
