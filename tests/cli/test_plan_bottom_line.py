"""`tiledmlp plan`'s bottom line (cli/plan_bottom_line.py): which stacks fit a card, the
fastest that fits by the measured step times (plan/stack_speed.py, checked against its
records here), and the command that runs it; presets get a "did you mean"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiledmlp.cli import main
from tiledmlp.cli.device_memory import GPUS
from tiledmlp.config.stacks import STACKS
from tiledmlp.plan import stack_speed

ROOT = Path(__file__).resolve().parents[2]


def test_the_step_times_are_the_records_and_name_every_stack() -> None:
    records = [
        json.loads(line)
        for line in (ROOT / stack_speed.SOURCE).read_text().splitlines()
        if line.startswith("{")
    ]
    measured = {
        r["stack"]: r["time_ms"]
        for r in records
        if r.get("part") == "model_steps" and r.get("seq_len") == 32768
    }
    assert measured == stack_speed.STEP_MS
    assert set(stack_speed.STEP_MS) == set(STACKS)
    assert (
        stack_speed.fastest(["tiled_layer", "tiled_mlp_loss_offload"]) == "tiled_mlp_loss_offload"
    )
    assert stack_speed.fastest([]) is None


def _config(tmp_path: Path) -> Path:
    file = tmp_path / "config.json"
    file.write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 128256,
    }))  # fmt: skip
    return file


@pytest.mark.slow  # plans two stacks at 65,536 tokens (about 10 s on two loaded CPUs)
def test_the_bottom_line_names_what_fits_a_card_and_the_command_that_runs_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the untiled loss's float32 logits (65,536 x 128,256) do not fit a 24 GB card; tiled do
    config = _config(tmp_path)
    args = ["plan", "--model", str(config), "--seq-len", "65536", "--device", "cpu",
            "--stacks", "untiled,tiled_mlp_loss", "--gpu", "4090"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    line = result["bottom_line"]
    assert line["memory_gib"] == pytest.approx(GPUS["4090"].gib, abs=0.01)
    assert list(line["fits"]) == ["tiled_mlp_loss"] and list(line["does_not_fit"]) == ["untiled"]
    for stack, gib in {**line["fits"], **line["does_not_fit"]}.items():
        assert gib == pytest.approx(result["model"][stack]["per_gpu_mib"] / 1024, abs=0.01)
    assert line["fastest"] == "tiled_mlp_loss"
    assert line["train_command"] == (
        f"tiledmlp train --model {config} --seq-len 65536 --dtype float32"
    )
    assert line["patch_model"] == "patch_model(model, tiled_loss=True)"
    assert "tiledmlp_tiled_loss: true" in line["axolotl"]
    assert main(args) == 0  # the text, from the cache
    out = capsys.readouterr().out
    bottom = out[out.index("bottom line") :].splitlines()
    commands = ("  run it:", "  or in Python:", "  or axolotl:")  # whole, to copy
    assert all(len(text) <= 100 for text in bottom if not text.startswith(commands)), bottom
    out = " ".join(out.split())  # the wrapped lines as one text
    assert "bottom line for NVIDIA GeForce RTX 4090" in out
    assert "fits: tiled_mlp_loss" in out and "does not fit: untiled" in out
    assert "fastest that fits: tiled_mlp_loss" in out and stack_speed.SOURCE in out
    assert f"run it: {line['train_command']}" in out


def test_plan_refuses_a_card_and_a_memory_together_and_names_a_mistyped_preset(capsys) -> None:
    assert main(["plan", "--model", "tiny", "--gpu", "h100-80gb", "--memory-gb", "80"]) == 2
    assert "give --gpu or --memory-gb, not both" in capsys.readouterr().err
    assert main(["plan", "--model", "llama3-8bb"]) == 2
    assert "did you mean 'llama3-8b'?" in capsys.readouterr().err
    assert main(["plan", "--gpu", "h100-80gb"]) == 2
    assert "add --model" in capsys.readouterr().err


def test_without_a_gpu_here_the_bottom_line_is_an_h100s_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the bottom line is judged against it")
    config = _config(tmp_path)
    args = ["plan", "--model", str(config), "--seq-len", "1024", "--stacks", "tiled_mlp_loss"]
    assert main(args) == 0
    out = " ".join(capsys.readouterr().out.split())  # the bottom line is wrapped
    assert "bottom line for NVIDIA H100 80GB" in out and "as no GPU is here" in out, out
    assert "fastest that fits: tiled_mlp_loss" in out and "run it: tiledmlp train" in out
