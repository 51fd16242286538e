"""The measurement suite (python -m tiledmlp.bench.suite): `--smoke` runs every part at toy
sizes on this machine and writes its records and summary; a failing part is recorded with its
error and the suite goes on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tiledmlp.bench import suite
from tiledmlp.bench.suite_parts import PARTS
from tiledmlp.config.stacks import STACKS

# Fields each part's records must carry (beyond part, status and the environment).
_KEYS = {
    "mlp_table": {"seq_len", "variant", "num_tiles", "tiles", "time_ms", "peak_mib", "flops"},
    "grad_error": {"variant", "weight", "rel_error"},
    "kernels": {"check"},
    "model_steps": {
        "seq_len",
        "stack",
        "time_ms",
        "planned_peak_mib",
        "planned_device_overhead_mib",
    },
    "offload": {"variant", "median_ms", "steps"},
    "train": {"tiled", "first_loss", "last_loss", "tokens_per_s", "peak_mib"},
    "gpu_tests": {"summary"},
}
_ENV = {"device", "device_name", "torch", "git_sha", "versions", "smoke", "part_seconds"}


@pytest.mark.slow
def test_smoke_suite_writes_every_part(tmp_path: Path) -> None:
    out = tmp_path / "suite"
    proc = subprocess.run(
        [sys.executable, "-m", "tiledmlp.bench.suite", "--out", str(out), "--smoke"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert [p for p in dict.fromkeys(r["part"] for r in records)] == list(PARTS)
    for r in records:
        assert r["status"] == "ok", r
        missing = (_KEYS[r["part"]] | _ENV) - set(r)
        assert not missing, (r["part"], missing)
    stacks = [r["stack"] for r in records if r["part"] == "model_steps"]
    assert stacks == list(STACKS)
    variants = {str(r["num_tiles"]) for r in records if r["part"] == "mlp_table"}
    assert {"None", "arctic", "4", "auto"} <= variants
    summary = (out / "summary.md").read_text()
    for part in PARTS:
        assert f"## {part} (" in summary
    assert "Every part succeeded." in summary


def test_a_failing_part_is_recorded_and_the_suite_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(sizes, device, out):  # type: ignore[no-untyped-def]
        raise RuntimeError("out of memory at 131072 tokens\nsecond line")

    monkeypatch.setitem(PARTS, "broken", broken)
    records = suite.run_suite(tmp_path, smoke=True, device="cpu", parts=["broken", "grad_error"])
    assert [r["part"] for r in records][:1] == ["broken"]
    assert records[0]["status"] == "error"
    assert records[0]["error"] == "RuntimeError: out of memory at 131072 tokens"
    assert {r["status"] for r in records[1:]} == {"ok"} and len(records) == 7
    lines = (tmp_path / "records.jsonl").read_text().splitlines()
    assert len(lines) == len(records)
    summary = (tmp_path / "summary.md").read_text()
    assert "**error**: RuntimeError: out of memory" in summary
    assert "Parts failed: broken." in summary


def test_unknown_part_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert suite.main(["--out", str(tmp_path), "--parts", "mlp_table,nope"]) == 2
    assert "unknown parts ['nope']" in capsys.readouterr().err
