"""The measurement suite (python -m benchmarks.suite): `--smoke` runs every part at toy
sizes on this machine and writes its records and summary; a failing piece is recorded with its
error and the suite goes on; a small `--budget` skips what its estimate would not fit and
records each skip with its reason; the estimates read the committed GPU records."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks import budget, checkout_env
from benchmarks.suite import run as suite
from benchmarks.suite import steps as suite_steps
from benchmarks.suite.parts import ROOT, Context, Task
from benchmarks.suite.run import PARTS
from benchmarks.suite.sizes import full_sizes, smoke_sizes

# Fields each part's records must carry (beyond part, status and the environment).
_KEYS = {
    "model_steps": {
        "seq_len",
        "stack",
        "time_ms",
        "planned_peak_mib",
        "planned_breakdown_mib",
        "planned_device_overhead_mib",
    },
    "attention": {"seq_len", "variant", "groups", "time_ms", "step_peak_mib"},
    "allocator": {"seq_len", "stack", "alloc_conf", "time_ms"},
    "mlp_table": {"seq_len", "variant", "num_tiles", "tiles", "time_ms", "peak_mib", "flops"},
    "grad_error": {"variant", "weight", "rel_error"},
    "kernels": {"check"},
    "offload": {"variant", "median_ms", "steps"},
    "train": {"tiled", "first_loss", "last_loss", "tokens_per_s", "peak_mib", "cuda_alloc_conf"},
    "gpu_tests": {"summary"},
}
_ENV = {"device", "device_name", "torch", "git_sha", "versions", "smoke", "seconds", "what"}
_ENV |= {"estimate_s", "budget_s", "cuda_alloc_conf", "command"}


@pytest.mark.slow
def test_smoke_suite_writes_every_part(tmp_path: Path) -> None:
    out = tmp_path / "suite"
    proc = subprocess.run(
        # a budget no CI machine reaches: every part must run (its skips are tested below)
        [
            sys.executable,
            "-m",
            "benchmarks.suite",
            "--out",
            str(out),
            "--smoke",
            "--budget",
            "3000",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        # One thread per process: the planner runs in the background beside the whole steps,
        # and two processes of 2 OpenMP threads each on a 2-core CI machine spend their time
        # waiting on each other's threads. What runs and what is recorded stay the same.
        env=checkout_env({**os.environ, "OMP_NUM_THREADS": "1"}),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert list(dict.fromkeys(r["part"] for r in records)) == list(PARTS)
    for r in records:
        assert r["status"] == "ok", r
        missing = (_KEYS[r["part"]] | _ENV) - set(r)
        assert not missing, (r["part"], missing)
    stacks = [r["stack"] for r in records if r["part"] == "model_steps"]
    assert stacks == list(smoke_sizes(torch.device("cpu")).model_lengths[0][1])
    assert [r["alloc_conf"] for r in records if r["part"] == "allocator"] == [
        "expandable_segments:False",
        "expandable_segments:True",
    ]
    variants = {str(r["num_tiles"]) for r in records if r["part"] == "mlp_table"}
    assert {"None", "arctic", "4", "auto"} <= variants
    summary = (out / "summary.md").read_text()
    for part in PARTS:
        assert f"## {part} (" in summary
    assert "Nothing failed." in summary


def _task(part: str, estimate: float, records: list[dict[str, Any]]) -> Task:
    return Task(part, "all", estimate, lambda left: records)


def test_a_small_budget_skips_what_would_pass_it_and_records_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ran: list[float] = []

    def cheap(ctx: Context) -> list[Task]:
        return [Task("cheap", "all", 1.0, lambda left: ran.append(left) or [{"x": 1}])]

    def costly(ctx: Context) -> list[Task]:
        return [_task("costly", 1000.0, [{"x": 2}]), _task("costly", 2.0, [{"x": 3}])]

    def counts(ctx: Context) -> list[Task]:  # pytest's summary counts "skipped" tests
        return [_task("counts", 1.0, [{"summary": "1 passed, 2 skipped", "skipped": 2}])]

    monkeypatch.setitem(PARTS, "cheap", cheap)
    monkeypatch.setitem(PARTS, "counts", counts)
    monkeypatch.setitem(PARTS, "costly", costly)
    records = suite.run_suite(
        tmp_path, smoke=True, device="cpu", parts=["costly", "cheap", "counts"], budget_s=60
    )
    # in the order of PARTS (of value), not of the argument
    assert [(r["part"], r["status"]) for r in records] == [
        ("cheap", "ok"),
        ("counts", "ok"),
        ("costly", "skipped"),
        ("costly", "ok"),
    ]
    assert records[2]["reason"].startswith("estimated 1000 s, ")
    assert records[2]["reason"].endswith(" s left of the 60 s budget")
    assert records[2]["estimate_s"] == 1000.0 and records[3]["x"] == 3
    assert 0 < ran[0] <= 60
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert [json.loads(line)["status"] for line in lines] == ["ok", "ok", "skipped", "ok"]
    summary = (tmp_path / "summary.md").read_text()
    assert "## Skipped" in summary and "| costly | all | estimated 1000 s" in summary
    assert "Budget 60 s" in summary and "Nothing failed." in summary


def test_a_tiny_budget_skips_every_real_part_and_still_writes_the_summary(
    tmp_path: Path,
) -> None:
    assert (
        suite.main(["--out", str(tmp_path), "--smoke", "--device", "cpu", "--budget", "0.5"]) == 0
    )
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert {r["status"] for r in records} == {"skipped"}
    assert list(dict.fromkeys(r["part"] for r in records)) == list(PARTS)
    assert all("of the 0 s budget" in r["reason"] or "budget" in r["reason"] for r in records)
    summary = (tmp_path / "summary.md").read_text()
    assert "## Skipped" in summary
    assert f"Command: `python -m benchmarks.suite --out {tmp_path} --smoke" in summary


def test_stacks_of_a_length_that_do_not_fit_are_skipped_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    given: list[str] = []

    def fake_steps(jobs, timeout, env=None):  # type: ignore[no-untyped-def]
        given.extend(j.stack for j in jobs)
        return [{"seq_len": j.seq_len, "stack": j.stack, "time_ms": 1.0} for j in jobs]

    monkeypatch.setattr(suite_steps, "run_steps", fake_steps)
    monkeypatch.setattr(suite_steps, "_start_plans", lambda ctx: None)
    ctx = Context(smoke_sizes(torch.device("cpu")), torch.device("cpu"), tmp_path, budget.CPU)
    (task,) = suite_steps.model_steps_tasks(ctx)
    stacks = ctx.sizes.model_lengths[0][1]
    assert task.total_s is not None and task.total_s > task.estimate_s
    records = task.run(task.estimate_s + 0.01)  # time for the first stack only
    assert given == [stacks[0]]
    assert [r["stack"] for r in records] == list(stacks)
    assert all("skip_reason" in r for r in records[1:])
    assert records[0]["plan"] == "not started" and records[0]["planned_peak_mib"] is None


def test_a_failing_piece_is_recorded_and_the_suite_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(ctx: Context) -> list[Task]:
        def run(left: float) -> list[dict[str, Any]]:
            raise RuntimeError("out of memory at 131072 tokens\nsecond line")

        return [Task("broken", "all", 1.0, run)]

    monkeypatch.setattr(suite, "PARTS", {"broken": broken, **PARTS})  # the first part fails
    records = suite.run_suite(tmp_path, smoke=True, device="cpu", parts=["broken", "grad_error"])
    assert records[0]["part"] == "broken" and records[0]["status"] == "error"
    assert records[0]["error"] == "RuntimeError: out of memory at 131072 tokens"
    assert {r["status"] for r in records[1:]} == {"ok"} and len(records) == 7
    summary = (tmp_path / "summary.md").read_text()
    assert "**error** (all): RuntimeError: out of memory" in summary
    assert "Parts failed: broken." in summary


def test_bad_input_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert suite.main(["--out", str(tmp_path), "--parts", "mlp_table,nope"]) == 2
    assert "unknown parts ['nope']" in capsys.readouterr().err
    assert suite.main(["--out", str(tmp_path), "--budget", "-5"]) == 2
    assert "--budget must be a positive number of seconds, got -5.0" in capsys.readouterr().err


def test_the_committed_h100_records_correct_the_estimates() -> None:
    sizes = full_sizes()
    found = budget.load_corrections(ROOT / "benchmarks" / "results" / "gpu", "h100", sizes.model)
    assert any(s.endswith("2026-11-25-h100/whole_steps.jsonl") for s in found.sources)
    assert any(s.endswith("2026-11-26T0933-h100/suite/records.jsonl") for s in found.sources)
    # the newest record of a step stands: the 2026-11-26 suite's (its wall and step seconds)
    assert found.whole_step_s[(4096, 4, 32768, "untiled")] == pytest.approx((5.93, 0.94673))
    assert found.whole_step_ratio is not None and 0.1 < found.whole_step_ratio < 10
    assert found.attention_by_heads_ratio is not None and found.attention_by_heads_ratio > 1
    assert found.part_s[("kernels", False)] == 3.6
    none = budget.load_corrections(ROOT / "benchmarks" / "results" / "gpu", "b200")
    assert none.whole_step_s == {} and none.whole_step_ratio is None
    gpu = Context(sizes, torch.device("cuda"), Path("unused"), budget.GPU, found)
    recorded = suite_steps._job_seconds(gpu, 32768, "untiled")
    assert recorded == pytest.approx(5.93)  # the newest record's wall seconds
    bare = Context(sizes, torch.device("cuda"), Path("unused"), budget.GPU)
    assert suite_steps._job_seconds(bare, 32768, "untiled") != recorded


def test_the_default_order_and_the_estimates_of_one_h100(tmp_path: Path) -> None:
    """The tasks of the default run in order of value, with positive estimates (planning
    only: nothing runs, no GPU needed)."""
    sizes = full_sizes()
    found = budget.load_corrections(ROOT / "benchmarks" / "results" / "gpu", "h100", sizes.model)
    ctx = Context(sizes, torch.device("cuda"), tmp_path, budget.GPU, found)
    tasks = suite.plan_tasks(ctx)
    order = list(dict.fromkeys(t.part for t in tasks))
    assert order == list(PARTS)
    firsts = [t.what for t in tasks[:3]]
    assert firsts == ["seq_len=32768", "seq_len=131072", "seq_len=32768"]
    parts = [t.part for t in tasks]
    after_allocator = tasks[parts.index("allocator") + 1]
    assert (after_allocator.part, after_allocator.what) == ("model_steps", "seq_len=262144")
    assert (tasks[-1].part, tasks[-1].what) == ("model_steps", "seq_len=65536")
    assert all(t.estimate_s > 0 for t in tasks)


def test_every_part_of_the_default_run_fits_the_default_budget_on_one_h200(
    tmp_path: Path,
) -> None:
    """By the estimates corrected with the committed H200 records, every task but the last
    (the 64K steps, which run if time is left) starts: each task's estimate (margin included)
    is within what is left once the tasks before it took their estimates without the margin."""
    sizes = full_sizes()
    found = budget.load_corrections(ROOT / "benchmarks" / "results" / "gpu", "h200", sizes.model)
    assert found.part_s.get(("train", False)) is not None  # read from the part's own folder
    ctx = Context(sizes, torch.device("cuda"), tmp_path, budget.GPU, found)
    elapsed = 0.0
    for task in suite.plan_tasks(ctx)[:-1]:
        whole = task.total_s if task.total_s is not None else task.estimate_s
        assert whole <= suite.DEFAULT_BUDGET_S - elapsed, (task.part, task.what, elapsed)
        elapsed += whole / budget.MARGIN


def test_device_slugs_and_the_default_folder() -> None:
    assert budget.device_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert budget.device_slug("NVIDIA H200") == "h200"
    assert budget.device_slug("Some Card X") == "some-card-x"
    out = suite.default_out(torch.device("cpu"), smoke=True, today=datetime.date(2026, 11, 26))
    assert out == ROOT / "benchmarks" / "results" / "gpu" / "2026-11-26-cpu-smoke"


@pytest.mark.parametrize(
    ("setting", "flag"),
    [("expandable_segments:True", False), ("expandable_segments:False", True), ("", True)],
)
def test_the_planner_is_told_the_allocator_setting_of_the_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, setting: str, flag: bool
) -> None:
    started: list[list[str]] = []

    class FakePopen:
        def __init__(self, args: list[str], **kwargs: Any) -> None:
            started.append(args)

    monkeypatch.setattr(suite_steps.subprocess, "Popen", FakePopen)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", setting)
    ctx = Context(smoke_sizes(torch.device("cpu")), torch.device("cpu"), tmp_path, budget.CPU)
    suite_steps._start_plans(ctx)
    (args,) = started
    assert args[1:5] == ["-m", "tiledmlp", "plan", "--model"]
    assert ("--expandable-segments" in args) == flag
    assert (tmp_path / "model-config" / "config.json").is_file()


def test_a_dry_run_lists_what_would_fit_and_runs_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert suite.main(["--dry-run", "--smoke", "--device", "cpu", "--budget", "30"]) == 0
    table = capsys.readouterr().out
    rows = [
        line.split(" | ")
        for line in table.splitlines()
        if line.startswith("| ") and "---" not in line
    ]
    assert [r[0].lstrip("| ") for r in rows[1:]] == list(PARTS)  # one piece each at toy sizes
    assert {r[-1].rstrip(" |") for r in rows[1:]} <= {"yes", "part", "no"}
    assert "no" in {r[-1].rstrip(" |") for r in rows[1:]}  # 30 s cannot hold every part
    assert list(tmp_path.iterdir()) == []
