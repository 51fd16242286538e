"""The GPU tables of the docs are the committed records (benchmarks/gpu_records.py): every marked
table of the pages equals the table rendered from its records folder, and a changed number is
caught."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import gpu_records

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "guides" / "gpus.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_gpu_tables_of_the_docs_are_the_committed_records(page: Path) -> None:
    assert gpu_records.check_page(page.read_text()) == []


def test_every_kind_of_table_is_on_a_page() -> None:
    text = "".join(p.read_text() for p in PAGES)
    for kind in gpu_records.TABLES:
        assert f"/{kind} -->" in text, kind


def test_a_changed_number_is_caught_and_rewritten(tmp_path: Path) -> None:
    page = "<!-- gpu-table: 2026-11-25-h100/whole_steps -->\n"
    page += gpu_records.render("2026-11-25-h100", "whole_steps")
    page += "<!-- /gpu-table -->\n"
    assert gpu_records.check_page(page) == []
    wrong = page.replace("11,587", "11,000")
    assert gpu_records.check_page(wrong) == [
        "2026-11-25-h100/whole_steps: the table differs from its records"
    ]
    assert gpu_records.update_page(wrong) == page
    path = tmp_path / "page.md"
    path.write_text(wrong)
    assert gpu_records.main([str(path)]) == 1
    assert gpu_records.main(["--write", str(path)]) == 0
    assert path.read_text() == page


def test_an_unknown_table_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown GPU table 'nope'"):
        gpu_records.render("2026-11-25-h100", "nope")


def test_the_long_step_alone_is_the_long_step_row_of_the_suite_steps() -> None:
    long = gpu_records.render("2026-11-26-h200", "long_step").splitlines()
    steps = gpu_records.render("2026-11-26-h200", "suite_steps").splitlines()
    assert long[:2] == steps[:2]  # the same columns
    assert long[2:] == [row for row in steps[2:] if row.startswith("| 2 | 512K |")]
    assert len(long) == 3
    # a folder without long-step/ gives the header alone
    assert gpu_records.render("2026-11-26T0339-h200", "long_step").count("\n") == 2


def test_the_attention_table_names_each_variants_kernel() -> None:
    table = gpu_records.render("2026-11-26T0339-h200", "suite_attention")
    rows = table.splitlines()[2:]
    assert len(rows) == 3 and all("| cudnn / cudnn |" in row for row in rows)
    older = gpu_records.render("2026-11-26-h200", "suite_attention")
    assert "| not recorded / not recorded |" in older
