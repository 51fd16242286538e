"""plan/measured.py and `tiledmlp plan --measure`: the measured difference fitted against the
length, carried to max_seq_len, the lower estimate standing; on the CPU against the process
peak."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch

from tiledmlp.config.plan import StepSpec
from tiledmlp.config.stacks import stack_patch
from tiledmlp.ops.tiling.policy import TilePolicy
from tiledmlp.plan.device_overhead import device_overhead
from tiledmlp.plan.measured import MeasuredPoint, fit_correction, measured_max_seq_len
from tiledmlp.plan.search import max_seq_len

MiB = 2**20


def _config() -> Any:
    import transformers

    return transformers.LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, use_cache=False,
    )  # fmt: skip


def test_the_fit_recovers_a_line_through_the_differences() -> None:
    points = [MeasuredPoint(n, 1000 + 3 * n + 7 * n, 1000 + 3 * n) for n in (512, 1024, 2048)]
    c = fit_correction(points)
    assert c.constant == pytest.approx(0.0, abs=1e-6) and c.per_token == pytest.approx(7.0)
    assert c.at(4096) == 7 * 4096
    shifted = fit_correction([MeasuredPoint(p.seq_len, p.measured + 5 * MiB, p.simulated)
                              for p in points])  # fmt: skip
    assert shifted.constant == pytest.approx(5 * MiB) and shifted.per_token == pytest.approx(7.0)
    with pytest.raises(ValueError, match="at least two distinct lengths"):
        fit_correction([points[0], points[0]])


def test_the_lower_estimate_stands_and_is_named() -> None:
    cfg = _config()
    kw: dict[str, Any] = {
        "step": StepSpec(seq_len=512, device_type="cpu", dtype=torch.float32),
        "patch": stack_patch("tiled_mlp_loss", TilePolicy.of(2)),
    }
    cpu = device_overhead("cpu")
    budget = 64 * MiB
    known: dict[int, int] = {}
    simulated = max_seq_len(cfg, budget, granularity=512, overhead=cpu, known_peaks=known, **kw)
    assert simulated > 0 and simulated in known and simulated + 512 in known
    # the card held 4 MiB more than simulated at every length: a shorter sequence fits
    more = fit_correction([MeasuredPoint(n, 4 * MiB, 0) for n in (512, 1024)])
    got = measured_max_seq_len(cfg, budget, more, overhead=cpu, simulated=simulated,
                               granularity=512, **kw)  # fmt: skip
    assert got["standing"] == "measured" and got["max_seq_len"] == got["max_seq_len_measured"]
    assert got["max_seq_len_measured"] < simulated == got["max_seq_len_simulated"]
    # the card held less than simulated: the simulation's figure stands
    less = fit_correction([MeasuredPoint(n, 0, 4 * MiB) for n in (512, 1024)])
    got = measured_max_seq_len(cfg, budget, less, overhead=cpu, simulated=simulated,
                               granularity=512, **kw)  # fmt: skip
    assert got["standing"] == "simulated" and got["max_seq_len"] == simulated
    assert got["max_seq_len_measured"] >= simulated


def test_a_second_search_reuses_the_first_ones_estimates(monkeypatch) -> None:
    from tiledmlp.plan import search

    cfg = _config()
    kw: dict[str, Any] = {
        "step": StepSpec(seq_len=512, device_type="cpu", dtype=torch.float32),
        "patch": stack_patch("tiled_mlp", TilePolicy.of(2)),
    }
    known: dict[int, int] = {}
    first = max_seq_len(cfg, 48 * MiB, granularity=512, known_peaks=known, **kw)
    calls: list[int] = []
    real = search.estimate_step

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(args[1].seq_len)
        return real(*args, **kwargs)

    monkeypatch.setattr(search, "estimate_step", counted)
    none = fit_correction([MeasuredPoint(n, 0, 0) for n in (512, 1024)])
    got = measured_max_seq_len(cfg, 48 * MiB, none, overhead=None, simulated=first,
                               known_peaks=known, granularity=512, **kw)  # fmt: skip
    assert got["max_seq_len_measured"] == first and calls == []


@pytest.mark.slow  # real steps in fresh processes
def test_cli_measure_on_the_cpu_against_the_process_peak(tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64,
        "intermediate_size": 160, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512}))  # fmt: skip
    res = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "plan", "--model", str(config), "--seq-len", "4096",
         "--device", "cpu", "--dtype", "float32", "--gradient-checkpointing", "--stacks",
         "tiled_mlp_loss", "--measure", "--measure-lengths", "512,1024", "--memory-gb", "0.05",
         "--json"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    entry = json.loads(res.stdout)["model"]["tiled_mlp_loss"]
    m = entry["measured"]
    assert m["lengths"] == [512, 1024] and m["layers"] == 2
    # the process holds the Python runtime and torch beside the tensors: more than simulated
    assert all(v > s for v, s in zip(m["measured_mib"], m["simulated_mib"], strict=True))
    assert m["max_seq_len"] == min(m["max_seq_len_simulated"], m["max_seq_len_measured"])
    # the runtime alone outgrows 0.05 GiB: the simulation's tokens do not fit the process
    assert m["max_seq_len_simulated"] > 0 and m["standing"] == "measured"
    assert entry["max_seq_len"] == m["max_seq_len"] and m["standing"] in ("simulated", "measured")


def test_cli_measure_needs_checkpointing_two_lengths_and_the_default_tiles(capsys) -> None:
    from tiledmlp.cli import main

    assert main(["plan", "--model", "tiny", "--device", "cpu", "--measure"]) == 2
    assert "add --gradient-checkpointing" in capsys.readouterr().err
    assert main(["plan", "--measure-lengths", "1024", "--model", "tiny"]) == 2
    assert "two or three distinct positive token counts" in capsys.readouterr().err
    flags = ["--gradient-checkpointing", "--measure", "--num-tiles", "4"]
    assert main(["plan", "--model", "tiny", "--device", "cpu", *flags]) == 2
    assert "drop --num-tiles" in capsys.readouterr().err
