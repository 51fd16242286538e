"""Re-plans the committed planner records: runs each `benchmarks/results/plan-*.json`'s own
`tiledmlp plan ...` command again with this checkout and rewrites the record (result, commit,
machine, planning time); a `plan-*.jsonl` holds one such record per line, each re-planned.
Records made by another command are left as they are and named.

Usage: python benchmarks/replan.py [RECORD ...]   (default: every plan-*.json and plan-*.jsonl)
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _git() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True, check=False)  # fmt: skip
    return out.stdout.strip() or "unknown"


def replan(path: Path) -> bool:
    """Re-plans the record (or, for .jsonl, each record) at `path` in place; False where one
    was left as it is."""
    if path.suffix == ".jsonl":
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        each = [_replanned(r, f"{path.name}:{i + 1}") for i, r in enumerate(records)]
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return all(each)
    record = json.loads(path.read_text())
    done = _replanned(record, path.name)
    if done:
        path.write_text(json.dumps(record, indent=1) + "\n")
    return done


def _replanned(record: dict[str, Any], name: str) -> bool:
    """Runs `record`'s command and writes its result, commit, machine and time into it."""
    command = record.get("command", "")
    args = shlex.split(command)
    if args[:2] != ["tiledmlp", "plan"]:
        print(f"{name}: left as it is (made by another command)", file=sys.stderr)
        return False
    before = os.times()
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "tiledmlp", *args[1:]], capture_output=True,
                         text=True, check=False)  # fmt: skip
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        print(f"{name}: the command failed: {last}", file=sys.stderr)
        return False
    elapsed = time.perf_counter() - start
    after = os.times()
    child_cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    record["result"] = json.loads(res.stdout)
    record["git"] = _git()
    record["machine"] = (
        f"CPU ({os.cpu_count()} cores, {platform.machine()}, load average "
        f"{os.getloadavg()[0]:.1f} at the end), fake tensors; planned (not measured): tensors "
        "plus the device overhead of plan/device_overhead.py"
    )
    record["planning_s"] = round(elapsed, 1)
    record["planning_cpu_s"] = round(child_cpu, 1)
    print(f"{name}: re-planned in {elapsed:.1f} s", file=sys.stderr)
    return True


def main(argv: list[str]) -> int:
    paths = [Path(a) for a in argv] or sorted(
        [*RESULTS.glob("plan-*.json"), *RESULTS.glob("plan-*.jsonl")]
    )
    for path in paths:
        replan(path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
