"""The benchmark table: the tiled-MLP pull requests' columns, every number from the records."""

from __future__ import annotations

from tiledmlp.bench.report import CONTRACT_COLUMNS, markdown_table


def _rec(seq: int, variant: str, ms: float, mib: float, flops: int, tiles: int) -> dict:
    return {
        "seq_len": seq,
        "variant": variant,
        "time_ms": ms,
        "peak_mib": mib,
        "flops": flops,
        "tiles": tiles,
    }


def test_table_columns_and_ratios() -> None:
    records = [
        _rec(2048, "untiled", 100.0, 400.0, 900, 0),
        _rec(2048, "tiled", 125.0, 100.0, 1100, 4),
        _rec(1024, "untiled", 50.0, 200.0, 450, 0),
        _rec(1024, "tiled", 45.0, 150.0, 550, 2),
    ]
    lines = markdown_table(records).splitlines()
    assert lines[0] == "| " + " | ".join(CONTRACT_COLUMNS) + " | Tiles | Tiled FLOPs (x) |"
    # rows sorted by length; the time column = tiled/regular - 1, the memory one = 1 -
    # tiled/regular, each said in words ("faster", "less")
    assert lines[2] == (
        "| 1024 | 50.0 | 45.0 | 10.0% faster | 200.0 | 150.0 | 25.0% less | 2 | 1.222 |"
    )
    assert lines[3] == (
        "| 2048 | 100.0 | 125.0 | 25.0% slower | 400.0 | 100.0 | 75.0% less | 4 | 1.222 |"
    )


def test_deepspeed_columns_when_present_and_missing_cells_blank() -> None:
    records = [
        _rec(4096, "untiled", 10.0, 80.0, 900, 0),
        _rec(4096, "tiled", 11.0, 20.0, 1100, 4),
        _rec(4096, "deepspeed", 12.0, 22.0, 1200, 4),
        _rec(8192, "tiled", 22.0, 40.0, 2200, 8),  # no untiled record at this length
    ]
    lines = markdown_table(records).splitlines()
    assert "DeepSpeed (ms) | DeepSpeed (MB)" in lines[0] and lines[0].endswith(
        "DeepSpeed FLOPs (x) |"
    )
    assert lines[2] == (
        "| 4096 | 10.0 | 11.0 | 10.0% slower | 80.0 | 20.0 | 75.0% less | 12.0 | 22.0 | 4 | 1.222 "
        "| 1.333 |"
    )
    assert lines[3] == "| 8192 |  | 22.0 |  |  | 40.0 |  |  |  | 8 |  |  |"


def test_the_change_columns_are_named_for_what_their_cells_say() -> None:
    # a cell reads "25.0% slower" or "75.0% less": its header names the comparison, not a
    # signed percentage ("Speed (+%)" above "256.5% slower" read as a gain)
    records = [
        _rec(2048, "untiled", 100.0, 400.0, 900, 0),
        _rec(2048, "tiled", 125.0, 100.0, 1100, 4),
    ]
    header, _, row = markdown_table(records).splitlines()[:3]
    columns = [c.strip() for c in header.strip("|").split("|")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    by = dict(zip(columns, cells))
    assert by["Time, tiled vs regular"] == "25.0% slower"
    assert by["Memory, tiled vs regular"] == "75.0% less"
    assert not any("%" in c for c in columns)
