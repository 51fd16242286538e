"""`tiledmlp plan`'s rows beside the named stacks (config/stacks.py's StackRow): transformers'
offload (+hf_offload) and checkpointing every N-th layer (+every_N), and --recipe alst (ALST as
its single-GPU recipe ran it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tiledmlp.cli import main
from tiledmlp.config.stacks import StackRow


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _plan(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, Any]:
    assert main(["plan", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_row_s_name_is_read_back_and_a_bad_one_refused() -> None:
    for row in (
        StackRow("untiled"),
        StackRow("tiled_mlp_loss", 2, True),
        StackRow("tiled_layer", 3),
    ):
        assert StackRow.of(row.name) == row
    assert StackRow("tiled_mlp_loss", 2, True).name == "tiled_mlp_loss+hf_offload+every_2"
    for bad in ("tiled", "tiled_mlp+every_1", "tiled_mlp+every_x", "tiled_mlp+every_2+hf_offload"):
        with pytest.raises(ValueError, match="a plan's row is a stack"):
            StackRow.of(bad)


def test_transformers_offload_rows_carry_their_host_memory_and_are_not_chosen(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = _plan(capsys, "--model", "tiny", "--seq-len", "2048", "--device", "cpu",
                   "--num-tiles", "4", "--transformers-offload",
                   "--stacks", "tiled_mlp_loss,tiled_mlp_loss_offload")  # fmt: skip
    rows = result["model"]
    # the offloading stack has no +hf_offload row: tiledmlp's offloader owns the job beside it
    assert list(rows) == ["tiled_mlp_loss", "tiled_mlp_loss+hf_offload", "tiled_mlp_loss_offload"]
    theirs, ours = rows["tiled_mlp_loss+hf_offload"], rows["tiled_mlp_loss_offload"]
    layers, hidden = 4, 256  # the tiny preset
    layer_input = 2048 * hidden * 4 / 2**20
    assert theirs["host_breakdown_mib"]["checkpoints"] == pytest.approx(
        layers * layer_input, abs=0.1
    )
    assert ours["host_breakdown_mib"]["checkpoints"] == pytest.approx(
        (layers - 1) * layer_input, abs=0.1
    )
    assert (
        theirs["breakdown_mib"]["checkpoints"]
        == 0
        < rows["tiled_mlp_loss"]["breakdown_mib"]["checkpoints"]
    )
    assert result["bottom_line"]["fastest"] != "tiled_mlp_loss+hf_offload"


def test_plan_refuses_every_n_layers_without_checkpointing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["plan", "--model", "tiny", "--every-n-layers", "2"])
    assert code != 0
    assert "add --gradient-checkpointing" in capsys.readouterr().err


def test_recipe_alst_plans_alst_s_setup_with_its_host_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    result = _plan(capsys, "--model", "tiny", "--seq-len", "4096", "--recipe", "alst",
                   "--gpu", "h100-80gb")  # fmt: skip
    assert (result["engine"], result["offload_params"], result["optimizer"]) == (
        "zero3", True, "cpu-offload",
    )  # fmt: skip
    assert result["gradient_checkpointing"] and result["recipe"] == "alst"
    (row,) = result["model"]
    assert row == "tiled_mlp_loss_offload_norms"
    host = result["model"][row]["host_breakdown_mib"]
    assert host["checkpoints"] > 0 and host["params"] > 0 and host["optimizer"] > 0
    line = result["bottom_line"]
    assert (
        "--dtype bfloat16" in line["train_command"]
        and "--attention-kernel flash" in (line["train_command"])
    )
    assert line["deepspeed_config"]["zero_optimization"] == {
        "stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
    }  # fmt: skip


def test_recipe_alst_refuses_a_flag_it_sets_otherwise(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "tiny", "--recipe", "alst", "--engine", "fsdp2"])
    assert code != 0
    err = capsys.readouterr().err
    assert "--recipe alst plans --engine zero3; drop --engine fsdp2 or --recipe alst" in err


def test_measure_refuses_the_rows_it_does_not_run(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "tiny", "--gradient-checkpointing", "--measure",
                 "--device", "cpu", "--transformers-offload"])  # fmt: skip
    assert code != 0
    assert "drop --every-n-layers and --transformers-offload" in capsys.readouterr().err
