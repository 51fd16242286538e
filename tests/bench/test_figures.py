"""The GPU figures of the README and the benchmarks page are drawn from the committed records:
their numbers (docs/assets/gpu-figures.json, what the PNGs draw) equal what the records give
now, the README and the benchmarks page show them first, and a record that changes is caught."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from benchmarks import figures
from benchmarks.gpu_records import RECORDS, ROOT


def test_the_committed_figures_match_the_records() -> None:
    assert figures.check() == []


def test_a_changed_record_is_caught(tmp_path: Path) -> None:
    root = tmp_path / "gpu"
    for folder in {*figures.MEMORY_RUNS.values(), figures.MLP_RUN}:
        shutil.copytree(RECORDS / folder, root / folder)
    assert figures.check(root=root) == []
    path = root / figures.MEMORY_RUNS["H100"] / "suite" / "records.jsonl"
    lines = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("part") == "model_steps" and r.get("stack") == "tiled_layer":
            r["max_memory_allocated_mib"] += 1024
        lines.append(json.dumps(r))
    path.write_text("\n".join(lines) + "\n")
    assert figures.check(root=root) == [
        f"gpu-memory-8b: {figures.SIDECAR} differs from the records"
    ]


def test_the_figures_draw_every_stack_and_the_planners_line() -> None:
    data = figures.figure_data()
    for card in ("H100", "H200"):
        stacks = data["gpu-memory-8b"][card]["stacks"]
        assert set(stacks) == set(figures._STACKS)
        assert all(len(row) == 3 and row[2] > 0 for rows in stacks.values() for row in rows)
    assert set(data["gpu-mlp-op"]["series"]) == {"untiled", "ours", "DeepSpeed", "Liger"}


def _images(text: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)\s]+)", text)


def test_the_readme_and_the_benchmarks_page_open_with_the_gpu_figures() -> None:
    readme = (ROOT / "README.md").read_text()
    assert _images(readme)[0] == "docs/assets/gpu-memory-8b.png"
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    before_tables = page[: page.index("\n|")]
    assert _images(before_tables)[:2] == ["assets/gpu-memory-8b.png", "assets/gpu-mlp-op.png"]
