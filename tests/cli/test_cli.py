"""The console command: `tiledmlp bench` and `tiledmlp env` as a user runs them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tiledmlp", *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_bench_writes_records_table_and_plot(tmp_path: Path) -> None:
    out = tmp_path / "b"
    res = run(
        "bench", "--hidden", "32", "--intermediate", "64", "--seq-lens", "96,200",
        "--num-tiles", "3", "--repeats", "2", "--deepspeed", "off", "--out", str(out),
        "--device", "cpu",  # the CPU's defaults (isolation) even on a machine with a GPU
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    assert [(r["seq_len"], r["variant"]) for r in records] == [
        (96, "untiled"), (96, "tiled"), (200, "untiled"), (200, "tiled"),
    ]  # fmt: skip
    by = {(r["seq_len"], r["variant"]): r for r in records}
    for seq in (96, 200):
        untiled, tiled = by[(seq, "untiled")], by[(seq, "tiled")]
        assert untiled["flops"] == 9 * 2 * seq * 32 * 64
        assert tiled["flops"] == 11 * 2 * seq * 32 * 64
        assert tiled["tiles"] == 3 and untiled["tiles"] == 0
        assert len(tiled["times_ms"]) == 2 and tiled["peak_mib"] > 0
        assert tiled["isolated"] is True  # the CPU default: a fresh process per measurement
        assert tiled["process_peak_mib"] is not None
        for key in ("torch", "device", "dtype", "hidden", "intermediate", "git_sha"):
            assert key in tiled
    table = (out / "bench.md").read_text()
    header = (
        "| Seq Length | Regular (ms) | Tiled (ms) | Time, tiled vs regular | Regular (MB) | Tiled (MB) "
        "| Memory, tiled vs regular |"
    )
    assert header in table and "| 96 |" in table and "1.222" in table
    png = (out / "bench.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


@pytest.mark.slow
def test_bench_in_process_with_deepspeed_column(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    out = tmp_path / "b"
    res = run(
        "bench", "--hidden", "32", "--intermediate", "64", "--seq-lens", "96",
        "--num-tiles", "3", "--repeats", "1", "--isolate", "off", "--deepspeed", "on",
        "--no-plot", "--out", str(out),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in (out / "bench.jsonl").read_text().splitlines()]
    by = {r["variant"]: r for r in records}
    assert by["deepspeed"]["flops"] == 12 * 2 * 96 * 32 * 64
    assert by["tiled"]["isolated"] is False and by["tiled"]["process_peak_mib"] is not None
    assert "DeepSpeed (ms) | DeepSpeed (MB)" in (out / "bench.md").read_text()
    # DeepSpeed's own warnings go to stderr: stdout is the table, then the files written
    assert res.stdout.startswith("| Seq Length |") and "WARNING" not in res.stdout, res.stdout
    assert not (out / "bench.png").exists()


def _without(tmp_path: Path, *packages: str) -> dict[str, str]:
    """An environment in which importing `packages` fails, as when they are not installed."""
    hide = tmp_path / "hide"
    hide.mkdir()
    for name in packages:
        (hide / f"{name}.py").write_text(f"raise ImportError('No module named {name}')\n")
    src = str(Path(__file__).resolve().parents[2] / "src")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(hide), src])}


@pytest.mark.slow
def test_bench_without_matplotlib_or_deepspeed_keeps_the_table(tmp_path: Path) -> None:
    # The README's main install has neither: the table and the records are still written,
    # one note says what was left out and which extras add it, and the exit status is 0.
    out = tmp_path / "b"
    res = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "bench", "--hidden", "32", "--intermediate", "64",
         "--seq-lens", "96", "--num-tiles", "3", "--repeats", "1", "--isolate", "off",
         "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=_without(tmp_path, "matplotlib", "deepspeed"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    notes = [line for line in res.stderr.splitlines() if "note:" in line]
    assert len(notes) == 1, res.stderr
    assert "the DeepSpeed column" in notes[0] and "the plot" in notes[0]
    assert "-e '.[deepspeed,bench]'" in notes[0]
    assert res.stdout.startswith("| Seq Length |"), res.stdout  # the table, nothing before it
    assert (out / "bench.jsonl").is_file() and (out / "bench.md").is_file()
    assert not (out / "bench.png").exists()
    # The extras named in the note exist.
    import tomllib

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())[
        "project"
    ]["optional-dependencies"]
    assert {"deepspeed", "bench"} <= set(extras)
    assert any(d.startswith("matplotlib") for d in extras["bench"])


def test_env_lists_versions() -> None:
    res = run("env")
    assert res.returncode == 0, res.stderr
    assert "torch 2." in res.stdout and "tiledmlp" in res.stdout


BAD_FLAGS = [
    ("bench", "--num-tiles", "zero"),
    ("bench", "--seq-lens", "12,-4"),
    ("bench", "--device", "tpu"),
    ("bench", "--isolate", "maybe"),
    ("bench", "--device", "cpu", "--memory-snapshot", "s.pickle"),  # CUDA only
    ("bench", "--device", "cpu", "--liger", "on"),  # Liger needs a GPU
    ("plan", "--tile-budget-gb", "0"),
    ("plan", "--num-tiles", "4", "--tile-budget-gb", "2"),
    ("nope",),
]


def _assert_usage_error(args: tuple[str, ...], returncode: int, stdout: str, stderr: str) -> None:
    assert returncode == 2, (args, stdout, stderr)
    assert "Traceback" not in stderr, stderr
    assert "error:" in stderr


def test_bad_flags_exit_nonzero_with_one_line(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    # main() in this process, case after case (the flags are refused before any work; a fresh
    # process each would only repeat the imports): a raised exception fails the test.
    from tiledmlp.allocator import _CHOSEN_BY, ALLOC_CONF_ENV
    from tiledmlp.cli import main

    for name in (ALLOC_CONF_ENV, _CHOSEN_BY):  # main() sets them; restored after the test
        monkeypatch.setenv(name, os.environ.get(name, ""))
    for args in BAD_FLAGS:
        rc = main(list(args))
        out, err = capfd.readouterr()
        _assert_usage_error(args, rc, out, err)
    # and as a user runs it: the console command in a fresh process
    res = run(*BAD_FLAGS[0])
    _assert_usage_error(BAD_FLAGS[0], res.returncode, res.stdout, res.stderr)


def test_plan_measure_on_cuda_without_a_gpu_is_refused_before_any_planning(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    import torch

    from tiledmlp.allocator import _CHOSEN_BY, ALLOC_CONF_ENV
    from tiledmlp.cli import main

    if torch.cuda.is_available():
        pytest.skip("the refusal is for a machine without a visible GPU")
    for name in (ALLOC_CONF_ENV, _CHOSEN_BY):
        monkeypatch.setenv(name, os.environ.get(name, ""))
    args = ["plan", "--model", "tiny", "--seq-len", "4096", "--measure", "--gradient-checkpointing"]
    rc = main(args)
    out, err = capfd.readouterr()
    _assert_usage_error(tuple(args), rc, out, err)
    assert "needs a visible GPU" in err and "one step at" not in err  # no stack planned first


def test_every_flag_of_every_subcommand_has_help() -> None:
    import argparse

    from tiledmlp.cli import _build_parser

    parser = _build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == {"train", "check", "bench", "plan", "env", "swift-plugin"}
    for name, sub in subparsers.choices.items():
        assert sub.description, name
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help and len(action.help) > 10, (name, action.option_strings)
    res = run("bench", "--help")
    assert res.returncode == 0 and "--isolate" in res.stdout and "(default" in res.stdout


def test_train_help_is_grouped_with_one_flag_per_option_and_every_spelling_is_documented() -> None:
    import argparse

    from tiledmlp.cli import _build_parser

    parser = _build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    train = sub.choices["train"]
    titles = {g.title for g in train._action_groups}
    assert {"model", "data", "tiling", "long context", "training", "output"} <= titles
    assert "distributed (under torchrun)" in titles
    listed = train.format_help().split("Other accepted spellings")[0]
    for alias in ("--steps", "--lr ", "--batch-size", "--deepspeed-config", "--tiled-mlp ",
                  "--tiled-mlp-num-shards", "--tile-budget-gb"):  # fmt: skip
        assert f"  {alias}" not in listed and f", {alias}" not in listed, alias
    # every spelling of every subcommand is in the command line reference
    reference = (Path(__file__).resolve().parents[2] / "docs" / "reference" / "cli.md").read_text()
    for name, child in sub.choices.items():
        for action in child._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help", "-v", "--verbose"):
                    assert f"`{flag}" in reference, f"tiledmlp {name} {flag} is not in cli.md"
    # and the other spellings still work
    args = parser.parse_args(["train", "--steps", "3", "--lr", "1e-3", "--batch-size", "2",
                              "--tiled-mlp-num-shards", "4", "--tile-budget-gb", "1"])  # fmt: skip
    assert (args.max_steps, args.learning_rate, args.per_device_train_batch_size) == (
        "3",
        "1e-3",
        "2",
    )


def test_cli_errors_do_not_wait_for_the_trainer_imports() -> None:
    # A bad option is reported before transformers' Trainer is imported.
    code = (
        "import sys; from tiledmlp.cli import main; rc = main(['train', '--max-steps', '0']); "
        "assert rc == 2, rc; bad = [m for m in ('transformers', 'accelerate', 'deepspeed') "
        "if m in sys.modules]; assert not bad, bad"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--max-steps must be an integer >= 1" in res.stderr
