"""`tiledmlp check`, run as a user runs it: it passes on the tiny preset and on a saved model
folder (without tokenizer files), under torchrun with DDP and FSDP2; a wrong tiled backward
exits 1 naming the parameters; bad input is one line and exit status 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hf_models import tiny_causal_lm
from tiledmlp.ops.mlp.function import TiledMLPFunction

pytest.importorskip("transformers")

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


@pytest.fixture
def check_here(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> Callable[..., tuple[int, str, str]]:
    """`tiledmlp check ARGS` through main() in this process: (exit status, stdout, stderr)."""
    from tiledmlp.allocator import _CHOSEN_BY, ALLOC_CONF_ENV
    from tiledmlp.cli import main

    for name in (ALLOC_CONF_ENV, _CHOSEN_BY):  # main() sets them; restored after the test
        monkeypatch.setenv(name, os.environ.get(name, ""))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # no launcher
        monkeypatch.delenv(name, raising=False)

    def run(*args: str) -> tuple[int, str, str]:
        capfd.readouterr()
        rc = main(["check", *args])
        out = capfd.readouterr()
        return rc, out.out, out.err

    return run


@pytest.mark.slow  # the tiny preset's three steps: ~10 s on two CPU cores
def test_the_tiny_preset_passes_with_a_readable_verdict(check_here: Any) -> None:
    rc, out, err = check_here("--model", "tiny", "--seq-len", "64", "--json")
    assert rc == 0, err
    r = json.loads(out.strip().splitlines()[-1])
    assert r["passed"] and r["engine"] == "single" and r["micro_batches"] == 2
    assert r["tokens"] == 64 and r["reference_dtype"] == "float64"
    assert r["tiles"] and set(r["tiles"].values()) == {4}  # 'auto' runs 4 tiles in the check
    assert "loss: tiled" in r["report"] and len(r["report"].splitlines()) == 6
    assert any("length: 64 tokens" in n for n in r["notes"])
    assert r["untiled_cost"]["seconds"] > 0 and r["tiled_cost"]["seconds"] > 0


def test_a_saved_model_folder_without_tokenizer_files_passes(
    check_here: Any, tmp_path: Path
) -> None:
    tiny_causal_lm("qwen3").save_pretrained(tmp_path / "model")
    recipe = tmp_path / "run.yaml"  # a training run's config: its training-only keys do nothing
    recipe.write_text("num_tiles: 3\nmax_steps: 500\nlearning_rate: 1.0e-4\n")
    rc, out, err = check_here(
        "--model", str(tmp_path / "model"), "--config", str(recipe), "--seq-len", "48"
    )
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("tiledmlp check: PASS  (single, 1 process, float32, 2 micro")
    assert "tiles per call: 3" in out and "model.layers.1.mlp: fast: gated" in out
    assert "the check's short default" not in out  # --seq-len was given
    assert len(lines) <= 25  # one screen


def test_train_still_needs_the_tokenizer_files_that_check_does_without(
    check_here: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from tiledmlp.cli import main

    tiny_causal_lm("llama").save_pretrained(tmp_path)
    capfd.readouterr()
    assert main(["train", "--model", str(tmp_path), "--max-steps", "1"]) == 2
    last = capfd.readouterr().err.strip().splitlines()[-1]  # after train's "loading ..." line
    assert last.startswith("tiledmlp train: error: ") and "its tokenizer could not be" in last


def test_a_wrong_tiled_backward_exits_1_naming_the_parameters(
    check_here: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    original = TiledMLPFunction.backward

    def doubled(ctx: Any, *grads: Any) -> Any:  # the gate/up/down weights' last one, doubled
        out = list(original(ctx, *grads))
        last = max(i for i, g in enumerate(out) if g is not None)
        out[last] = out[last] * 2
        return tuple(out)

    tiny_causal_lm("llama").save_pretrained(tmp_path)
    monkeypatch.setattr(TiledMLPFunction, "backward", staticmethod(doubled))
    rc, out, err = check_here("--model", str(tmp_path), "--seq-len", "32")
    assert rc == 1, err
    assert out.startswith("tiledmlp check: FAIL")
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(2)]
    assert all(f"FAIL {n}: max abs" in out for n in names), out
    last = out.splitlines()[-1]
    assert last.startswith("FAIL: ") and all(n in last for n in names), last


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gradient-accumulation-steps", "1"], "must be at least 2 for the check"),
        (["--sequence-parallel-size", "2"], "does not run sequence parallelism"),
        (["--deepspeed", "TMP/ds.json"], "does not run DeepSpeed yet"),
        (["--model", "tinyy"], "did you mean 'tiny'?"),
        (["--fsdp", "full_shard"], "needs a launcher: torchrun"),
        (["--use-tiled-mlp", "false", "--tiled-loss", "false"], "nothing to check"),
        (["--max-step", "3"], "unrecognized arguments --max-step"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    check_here: Any, tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "ds.json").write_text("{}")
    args = [a.replace("TMP", str(tmp_path)) for a in args]
    rc, out, err = check_here(*args)
    assert rc == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert err.startswith("tiledmlp check: error: ")


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_under_torchrun_it_passes_against_the_same_engine_unpatched(engine: str) -> None:
    extra = ["--fsdp", "full_shard"] if engine == "fsdp2" else []
    cmd = [*TORCHRUN, "--nproc_per_node", "2", "-m", "tiledmlp", "check", "--model", "tiny",
           "--seq-len", "64", "--gradient-accumulation-steps", "2", "--json", *extra]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout.strip().splitlines()[-1])  # rank 0's verdict only
    assert r["passed"] and r["engine"] == engine and r["world_size"] == 2
    assert r["micro_batches"] == 2 and set(r["tiles"].values()) == {4}
    assert len(res.stdout.strip().splitlines()) == 1


_DOUBLED = """
import sys

from tiledmlp.ops.mlp.function import TiledMLPFunction

original = TiledMLPFunction.backward


def doubled(ctx, *grads):
    out = list(original(ctx, *grads))
    last = max(i for i, g in enumerate(out) if g is not None)
    out[last] = out[last] * 2
    return tuple(out)


TiledMLPFunction.backward = staticmethod(doubled)  # a wrong tiling, in this test only
from tiledmlp.cli import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.distributed
def test_under_ddp_a_wrong_tiled_backward_fails_on_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "doubled.py"
    script.write_text(_DOUBLED)
    cmd = [*TORCHRUN, "--nproc_per_node", "2", str(script), "check", "--model", "tiny",
           "--seq-len", "32"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stderr[-3000:]
    assert res.stdout.startswith("tiledmlp check: FAIL  (ddp, 2 processes")
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(4)]
    assert all(f"FAIL {n}: max abs" in res.stdout for n in names), res.stdout
