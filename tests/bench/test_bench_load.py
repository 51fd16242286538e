"""`tiledmlp bench` says how busy the machine was (bench/load.py): the load average before and
after, the CPUs, the threads measured, and "busy" when other work shared the cores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tiledmlp.bench.load import busy, load_line, machine_load


@pytest.mark.parametrize(
    ("before", "after", "cpus", "threads", "is_busy"),
    [
        (0.2, 2.3, 2, 2, False),  # the run's own 2 threads are the load after it
        (1.0, 2.1, 2, 2, True),  # one CPU's worth of other work before
        (0.1, 3.4, 2, 2, True),  # other work came during the run
        (0.9, 2.9, 2, 2, False),  # just under half the CPUs
        (3.0, None, 16, 16, False),
        (None, None, 2, 2, False),
    ],
)
def test_busy_is_other_work_of_half_the_cpus(
    before: float | None, after: float | None, cpus: int, threads: int, is_busy: bool
) -> None:
    assert busy(before, after, cpus, threads) is is_busy


def test_the_line_states_the_load_and_says_busy_only_when_busy() -> None:
    idle = load_line(0.31, 2.05, 2, 2)
    assert idle == "load: 0.31 before, 2.05 after (1-minute average) on 2 CPUs, 2 threads measured"
    loaded = load_line(2.5, 4.6, 2, 2)
    assert loaded.startswith("load: 2.50 before, 4.60 after (1-minute average) on 2 CPUs")
    assert "; busy: other work shared the cores" in loaded and "\n" not in loaded
    assert load_line(None, None, 4, 4) == (
        "load: not measured (no load average on this system), 4 CPUs"
    )


def test_bench_prints_the_load_it_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tiledmlp.cli import main

    out = tmp_path / "b"
    assert main(["bench", "--hidden", "16", "--intermediate", "32", "--seq-lens", "32",
                 "--num-tiles", "2", "--repeats", "1", "--warmup", "0", "--isolate", "off",
                 "--deepspeed", "off", "--no-plot", "--device", "cpu", "--out", str(out)]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert machine_load() is not None  # Linux: the test machine has a load average
    load = [line for line in lines if line.startswith("load: ")]
    assert len(load) == 1 and f"on {os.cpu_count()} CPUs" in load[0], lines
    assert lines[-1].startswith("wrote ") and lines[-2] == load[0]  # after the table
    assert load[0] in (out / "bench.md").read_text()
    records = [json.loads(x) for x in (out / "bench.jsonl").read_text().splitlines()]
    assert all(isinstance(r["load_1min"], float) and r["cpus"] == os.cpu_count() for r in records)
