"""The planner's breakdown plot (benchmarks/breakdown_plot.py): drawn from `tiledmlp plan --json`
records as they are, merged by length; without matplotlib it says so and draws nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import checkout_env
from tiledmlp.ops.tiling.policy import TilePolicy

pytest.importorskip("transformers")


def _plan(seq_len: int, stacks: tuple[str, ...]) -> dict:
    """What `tiledmlp plan --model tiny --engine zero3 --offload-params --optimizer cpu-offload
    --json` writes, the keys the plot reads (the CLI adds the MLP's and the layer's)."""
    from tiledmlp.config.plan import StepSpec
    from tiledmlp.plan.layer import load_config
    from tiledmlp.plan.model import plan_model

    step = StepSpec(seq_len=seq_len, tiles=TilePolicy.of(2), engine="zero3", offload_params=True,
                    optimizer="cpu-offload")  # fmt: skip
    model = plan_model(load_config("tiny"), step, stacks=stacks)
    return json.loads(json.dumps({"seq_len": seq_len, "model_name": "tiny", "model": model}))


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two lengths of two stacks, then one stack planned again on its own (a later record)."""
    path = tmp_path_factory.mktemp("plans") / "plans.jsonl"
    stacks = ("tiled_mlp_loss", "tiled_mlp_loss_offload_norms")
    lines = [{"command": "tiledmlp plan ...", "result": _plan(n, stacks)} for n in (512, 1024)]
    lines.append(_plan(2048, ("tiled_mlp_loss",)))  # a bare result
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_series_are_the_records_figures_by_stack_and_length(records: Path) -> None:
    from benchmarks.breakdown_plot import breakdown_series, read_plans

    plans = read_plans([records])
    series = breakdown_series(plans)
    assert sorted(series["tiled_mlp_loss"]) == [512, 1024, 2048]
    assert sorted(series["tiled_mlp_loss_offload_norms"]) == [512, 1024]
    entry = plans[1]["model"]["tiled_mlp_loss"]
    got = series["tiled_mlp_loss"][1024]
    assert got["recompute"] == entry["breakdown_mib"]["recompute"] / 1024
    assert got["device_overhead"] == entry["device_overhead_mib"] / 1024
    assert got["gathered"] > 0 and got["weights"] == 0  # offloaded parameters
    with pytest.raises(ValueError, match="tiledmlp plan --model"):
        breakdown_series([{"seq_len": 1}])


def test_every_part_of_a_stack_s_figure_is_drawn(records: Path) -> None:
    """The stacked parts add up to the stack's figure per GPU; a part the plot would not draw
    is refused, not dropped."""
    from benchmarks.breakdown_plot import breakdown_series, read_plans

    plans = read_plans([records])
    series = breakdown_series(plans)
    for stack, entry in plans[0]["model"].items():
        parts = series[stack][plans[0]["seq_len"]]
        assert sum(parts.values()) == pytest.approx(entry["per_gpu_mib"] / 1024, abs=0.01)
    odd = json.loads(json.dumps(plans[0]))
    next(iter(odd["model"].values()))["breakdown_mib"]["new_part"] = 1.0
    with pytest.raises(ValueError, match="new_part"):
        breakdown_series([odd])


def test_the_plot_is_drawn_or_the_missing_matplotlib_named(records: Path, tmp_path: Path) -> None:
    from tiledmlp.bench.plot import matplotlib_available

    out = tmp_path / "breakdown.png"
    res = subprocess.run(
        [sys.executable, "-m", "benchmarks.breakdown_plot", str(records), str(out),
         "--memory-gb", "1"],
        capture_output=True, text=True, timeout=300, env=checkout_env(),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    if matplotlib_available():
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert not out.exists() and "matplotlib is not installed" in res.stderr
