"""What users feed `tiledmlp train` and its siblings, each case in a fresh process as a user
runs it: handled, or refused in one line (exit status 2, no traceback, no usage dump)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SRC = str(Path(__file__).resolve().parents[2] / "src")

# Runs `tiledmlp` once per argument list in ONE fresh process (imports are paid once) and prints
# one JSON line per run: its exit status and what it wrote to stderr.
MANY = """
import contextlib, io, json, sys
from tiledmlp.cli import main
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    print(json.dumps({"argv": argv, "rc": rc, "stderr": err.getvalue()}), flush=True)
"""


def env_for(tmp: Path, **extra: str) -> dict[str, str]:
    """No network, an empty Hugging Face cache, this checkout's package."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp / "hf"),
        "HF_HUB_CACHE": str(tmp / "hf" / "hub"),
        "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
        **extra,
    }


def run_many(argvs: list[list[str]], env: dict[str, str]) -> list[dict]:
    res = subprocess.run(
        [sys.executable, "-c", MANY, json.dumps(argvs)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def assert_one_line(run: dict, *expected: str) -> None:
    """Exit status 2, and stderr's only error is one line holding every expected part."""
    lines = [line for line in run["stderr"].splitlines() if line.strip()]
    errors = [line for line in lines if ": error:" in line]
    assert run["rc"] == 2, run
    assert "Traceback" not in run["stderr"] and "usage:" not in run["stderr"], run
    assert len(errors) == 1 and errors[0] == lines[-1], run
    for part in expected:
        assert part in errors[0], (part, run)


def _broken_models(tmp: Path) -> None:
    """Model folders as users break them: empty, no weights, truncated weights."""
    from tiledmlp.models.presets import build_preset
    from tiledmlp.train.tokenizer import VOCAB_SIZE, byte_tokenizer

    good = tmp / "good"
    build_preset("tiny", VOCAB_SIZE, 64, 0).save_pretrained(good)
    byte_tokenizer().save_pretrained(good)
    (tmp / "empty").mkdir()
    no_weights = tmp / "no-weights"
    no_weights.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (no_weights / name).write_bytes((good / name).read_bytes())
    truncated = tmp / "truncated"
    truncated.mkdir()
    for f in good.iterdir():
        (truncated / f.name).write_bytes(f.read_bytes())
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (tmp / "a-file.txt").write_text("not a folder\n")


@pytest.mark.slow
def test_broken_inputs_and_names_are_one_line_before_any_model_loads(tmp_path: Path) -> None:
    _broken_models(tmp_path)
    t = str(tmp_path)
    small = ["--seq-len", "32", "--max-steps", "1"]
    cases = {
        "empty": (["--model", f"{t}/empty"], [f"{t}/empty: the folder is empty"]),
        "no weights": (
            ["--model", f"{t}/no-weights"],
            ["has no weights (model.safetensors", f"--model {t}/no-weights/config.json to train"],
        ),
        "not a model config": (
            ["--model", f"{t}/records.json"],
            [f"{t}/records.json: expected a transformers model configuration"],
        ),
        "truncated": (
            ["--model", f"{t}/truncated"],
            [f"{t}/truncated/model.safetensors is damaged (truncated"],
        ),
        "output under a file": (
            ["--output-dir", f"{t}/a-file.txt/sub"],
            [f"{t}/a-file.txt is a file, so no folder can be made there"],
        ),
        "hub id offline": (
            ["--model", "some-org/some-model"],
            ["not in the local Hugging Face cache", "hf download some-org/some-model"],
        ),
        "preset typo": (["--model", "tinny"], ["did you mean 'tiny'?"]),
        "preset case": (["--model", "llama3-8B"], ["did you mean 'llama3-8b'?"]),
        "unknown data format": (
            ["--data", f"{t}/notes.xml"],
            ["unknown format '.xml'", ".jsonl", ".parquet", "save_to_disk"],
        ),
    }
    (tmp_path / "notes.xml").write_text("<a/>")
    (tmp_path / "records.json").write_text('[{"text": "a"}]')
    runs = run_many([["train", *args, *small] for args, _ in cases.values()], env_for(tmp_path))
    for (name, (_, expected)), run in zip(cases.items(), runs, strict=True):
        assert_one_line(run, *expected)
        # before the expensive work: nothing was loaded or trained
        assert "loading" not in run["stderr"], (name, run)


def test_one_error_style_in_every_subcommand(tmp_path: Path) -> None:
    cases = [
        (["bench", "--device", "tpu"], ["tpu"]),
        (["bench", "--num-tiles", "zero"], ["must be a positive int, 'auto'"]),
        (["bench", "--isolate", "maybe"], ["expected one of", "got 'maybe'"]),
        (["plan", "--dtype", "bf61"], ["expected one of", "got 'bf61'; did you mean 'bf16'?"]),
        (["plan", "--tile-budget-gb", "0"], []),
        (["env", "--verbos"], ["did you mean --verbose?"]),
        (["train", "--engine", "dpp"], ["did you mean 'ddp'?"]),
        (["trian"], ["expected one of", "did you mean 'train'?"]),
        # argparse's prefix matching is off: a prefix is refused and the flags it starts named
        (["train", "--max-step", "3"], ["did you mean --max-steps?"]),
        (["train", "--max", "3"], ["--max-steps"]),
        (["plan", "--seq", "4096"], ["did you mean --seq-len or --sequence-parallel-size?"]),
    ]
    runs = run_many([argv for argv, _ in cases], env_for(tmp_path))
    for (_, expected), run in zip(cases, runs, strict=True):
        assert_one_line(run, *expected)


@pytest.mark.slow
def test_a_hub_id_loads_from_the_local_cache_offline(tmp_path: Path) -> None:
    # The layout huggingface_hub writes: models--ORG--NAME/{refs/main, snapshots/REVISION/...}
    from tiledmlp.models.presets import build_preset
    from tiledmlp.train.tokenizer import VOCAB_SIZE, byte_tokenizer

    env = env_for(tmp_path)
    repo = Path(env["HF_HUB_CACHE"]) / "models--some-org--tiny-model"
    revision = "0" * 40
    snapshot = repo / "snapshots" / revision
    build_preset("tiny", VOCAB_SIZE, 64, 0).save_pretrained(snapshot)
    byte_tokenizer().save_pretrained(snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    res = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "train", "--model", "some-org/tiny-model",
         "--seq-len", "32", "--max-steps", "1", "--json"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    assert summary["model"] == "some-org/tiny-model" and summary["steps"] == 1
    assert summary["learning_rate"] == 2e-5  # a pretrained model's fine-tuning default


@pytest.mark.slow
def test_a_config_json_trains_its_architecture_from_random_init(tmp_path: Path) -> None:
    from tiledmlp.models.presets import build_preset
    from tiledmlp.train.tokenizer import VOCAB_SIZE

    folder = tmp_path / "arch"
    build_preset("tiny", VOCAB_SIZE, 64, 0).config.save_pretrained(folder)  # no weights
    res = subprocess.run(
        [sys.executable, "-m", "tiledmlp", "train", "--model", str(folder / "config.json"),
         "--seq-len", "32", "--max-steps", "1", "--json", "--output-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=600, env=env_for(tmp_path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads(res.stdout)
    assert summary["steps"] == 1
    assert summary["learning_rate"] != 2e-5  # trained from scratch: not the fine-tuning default
