"""`tiledmlp train`, run as a user runs it (a fresh process wherever the process matters: its
memory, signals, kills, resumes, launchers; elsewhere main() in this process, the same run
without the imports): the loss goes down, tiling changes the memory and not the losses, the
model is saved with unchanged keys, bad input is one line."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# --standalone: the rendezvous takes a port the system assigns (torchrun's default, 29500, is
# shared by every suite and program on the machine)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def train(
    *args: str, launcher: list[str] | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    cmd = [*(launcher or [sys.executable, "-m"]), "tiledmlp", "train", *args]
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=full_env)


# glibc keeps freed blocks below its (adaptive) mmap threshold resident, so a process's peak
# varies by ~300 MiB between identical tiled runs; with large blocks always mmap'd (and returned
# when freed) the peak is repeatable (760 vs 1282 MiB in three runs each here).
STEADY_MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def summary(*args: str, env: dict[str, str] | None = None) -> dict:
    res = train(*args, "--json", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)  # stdout is the JSON object and nothing else


def summary_here(*args: str) -> dict:
    """`tiledmlp train ARGS --json` through main() in this process: the same run and losses as
    a fresh process, without its imports. For runs whose assertions are about the run (losses,
    tiles, options, resumes); process memory and signals keep `summary`. The environment and
    the transformers log level are restored afterwards."""
    from tiledmlp.cli import main

    env = dict(os.environ)
    level = logging.getLogger("transformers").level
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # no launcher
        os.environ.pop(name, None)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            rc = main(["train", *args, "--json"])
    finally:
        for name in set(os.environ) - set(env):
            del os.environ[name]
        os.environ.update(env)
        logging.getLogger("transformers").setLevel(level)
    assert rc == 0, f"tiledmlp train {' '.join(args)} exited {rc} (its stderr is above)"
    return json.loads(out.getvalue())  # the JSON object and nothing else


@pytest.fixture
def train_here(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> Callable[..., tuple[int, str]]:
    """`tiledmlp train ARGS` through main() in this process: (exit status, stderr). For
    commands refused before any work (a fresh process would only repeat the imports); stderr
    is read at the file descriptor, and a raised exception fails the test."""
    from tiledmlp.allocator import _CHOSEN_BY, ALLOC_CONF_ENV
    from tiledmlp.cli import main

    for name in (ALLOC_CONF_ENV, _CHOSEN_BY):  # main() sets them; restored after the test
        monkeypatch.setenv(name, os.environ.get(name, ""))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):  # no launcher
        monkeypatch.delenv(name, raising=False)

    def run(*args: str) -> tuple[int, str]:
        capfd.readouterr()
        rc = main(["train", *args])
        return rc, capfd.readouterr().err

    return run


@pytest.fixture(scope="module")
def single_process_batch_2() -> dict:
    """One process, batch 2 (what 2 processes of batch 1 or 2 accumulated micro-batches of 1
    see)."""
    return summary_here("--seq-len", "128", "--max-steps", "3", "--batch-size", "2")


@pytest.fixture(scope="module")
def single_process_accumulated() -> dict:
    """One process, 2 accumulated micro-batches of 1 (the same steps as batch 2), evaluated at
    its last step (the evaluation sequences are held out after the training ones)."""
    return summary_here("--seq-len", "128", "--max-steps", "3", "--batch-size", "1",
                   "--gradient-accumulation-steps", "2", "--eval-steps", "3")  # fmt: skip


@pytest.mark.slow
def test_default_run_learns_saves_and_the_output_dir_is_a_model(tmp_path: Path) -> None:
    out = tmp_path / "model"
    s = summary("--seq-len", "512", "--max-steps", "8", "--output-dir", str(out))
    assert s["use_tiled_mlp"] and s["tiled_loss"] and len(s["tiled_modules"]) == 4
    assert s["last_loss"] < s["first_loss"] - 1.0
    # auto policy, tiny preset (hidden 256, intermediate 1024, fp32): tiles of
    # 3 x 256 x 1024 x 4 B / (5 x 1024 x 4 B) = 153 tokens -> ceil(512 / 153) = 4 tiles
    assert set(s["tiles_per_mlp"].values()) == {4}
    import transformers

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert not any("_tiledmlp" in k or k.startswith("mlp.") for k in loaded.state_dict())
    assert json.loads((out / "summary.json").read_text())["losses"] == s["losses"]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics if "loss" in m] == pytest.approx(s["losses"], rel=1e-3)
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok("hé")["input_ids"] == [256, 104, 195, 169, 257]
    # the output directory trains again as --model (its own tokenizer, fine-tuning lr 2e-5)
    again = summary_here("--model", str(out), "--seq-len", "512", "--max-steps", "1")
    assert again["learning_rate"] == 2e-5
    assert again["first_loss"] < s["first_loss"] - 1.0  # it starts from the trained weights


@pytest.fixture(scope="module")
def planned_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """One uninterrupted run of 4 steps of 128 tokens with a checkpoint after every step: its
    summary and output directory (each test resumes from its own copy of it)."""
    out = tmp_path_factory.mktemp("planned") / "run"
    s = summary_here("--seq-len", "128", "--max-steps", "4", "--save-steps", "1",
                "--output-dir", str(out))  # fmt: skip
    return s, out


def _copy_of(run: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(run, out)
    return out


@pytest.mark.slow
def test_resume_equals_uninterrupted(
    planned_run: tuple[dict, Path], tmp_path: Path, train_here: Callable[..., tuple[int, str]]
) -> None:
    full, out = planned_run[0], _copy_of(planned_run[1], tmp_path)
    args = ("--seq-len", "128", "--max-steps", "4", "--output-dir", str(out))
    assert (out / "checkpoint-2" / "optimizer.pt").is_file()
    resumed = summary_here(*args, "--resume-from-checkpoint", str(out / "checkpoint-2"))
    assert resumed["resumed_from_step"] == 2 and resumed["global_step"] == 4
    assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=0, abs=1e-6)
    # Fewer steps than planned: the same schedule and data, stopped early; the summary says so.
    shorter = train(*args[:2], "--max-steps", "3", *args[4:], "--resume-from-checkpoint",
                    str(out / "checkpoint-2"))  # fmt: skip
    assert shorter.returncode == 0, shorter.stderr[-3000:]
    assert "for 1 step of 128 tokens (resumed from step 2)" in shorter.stdout, shorter.stdout
    assert "saved to" in shorter.stdout and "Writing model shards" not in shorter.stderr
    assert "\x1b[A" not in shorter.stderr  # no other progress bar fighting ours
    # More steps than planned: the schedule ended at step 4; refused before any work.
    rc, stderr = train_here(*args[:2], "--max-steps", "6", *args[4:],
                            "--resume-from-checkpoint", "latest")  # fmt: skip
    assert rc == 2, stderr
    assert "planned for --max-steps 4, this one asks for 6" in stderr
    assert "loading" not in stderr and "Traceback" not in stderr


@pytest.mark.slow
def test_a_resume_keeps_the_runs_checkpoint_interval(tmp_path: Path) -> None:
    out = tmp_path / "run_r"
    summary_here("--seq-len", "64", "--max-steps", "6", "--save-steps", "3",
                 "--output-dir", str(out))  # fmt: skip
    shutil.rmtree(out / "checkpoint-6")  # as if the run had stopped after step 3
    resumed = summary_here("--seq-len", "64", "--max-steps", "6", "--output-dir", str(out),
                           "--resume-from-checkpoint", str(out / "checkpoint-3"))  # fmt: skip
    assert resumed["resumed_from_step"] == 3 and resumed["global_step"] == 6
    # --save-steps 3 is the run's: the resumed run saves at step 6 again
    assert (out / "checkpoint-6" / "optimizer.pt").is_file()
    assert json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["save_steps"] == 3


@pytest.mark.slow
def test_resume_stopping_early_equals_the_planned_run(
    planned_run: tuple[dict, Path], tmp_path: Path
) -> None:
    full, out = planned_run[0], _copy_of(planned_run[1], tmp_path)
    args = ("--seq-len", "128", "--output-dir", str(out))
    early = summary_here(
        *args, "--max-steps", "3", "--resume-from-checkpoint", str(out / "checkpoint-1")
    )
    assert early["resumed_from_step"] == 1 and early["global_step"] == 3
    assert early["losses"] == pytest.approx(full["losses"][1:3], rel=0, abs=1e-6)
    logged = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = [(m["step"], m["learning_rate"]) for m in logged if "learning_rate" in m]
    # the resumed steps run at the planned run's learning rates (its schedule, not a new one)
    assert lrs[4:] == lrs[1:3] and len(lrs) == 6, lrs


@pytest.mark.slow
def test_the_small_preset_learns_at_its_default_learning_rate() -> None:
    s = summary_here("--model", "small", "--seq-len", "256", "--max-steps", "6")
    assert s["learning_rate"] == pytest.approx(1e-3)  # 2e-3 x 256 / hidden 512
    assert s["last_loss"] < s["first_loss"] - 1.0


@pytest.mark.slow
def test_gradient_accumulation_equals_the_bigger_batch(
    single_process_batch_2: dict, single_process_accumulated: dict
) -> None:
    # the same 3 steps of 128 tokens: batches of 2, and 2 accumulated micro-batches of 1
    assert (
        single_process_accumulated["batch_size"],
        single_process_accumulated["gradient_accumulation_steps"],
    ) == (1, 2)
    assert single_process_accumulated["losses"] == pytest.approx(
        single_process_batch_2["losses"], rel=1e-5
    )


@pytest.mark.slow
def test_config_file_with_other_frameworks_keys_and_flags_overriding_it(tmp_path: Path) -> None:
    config = tmp_path / "axolotl-style.yaml"
    config.write_text(
        "seq_len: 128\nmax_steps: 5\ntiled_mlp: true\ntiled_mlp_num_shards: 3\n"
        "learning_rate: 0.001\nlr_scheduler_type: cosine\nwarmup_steps: 1\neval_steps: 2\n"
    )
    s = summary_here("--config", str(config), "--max_steps", "2", "--dtype", "bf16", "-v")
    assert s["steps"] == 2 and s["num_tiles"] == 3 and set(s["tiles_per_mlp"].values()) == {3}
    assert s["learning_rate"] == 0.001 and s["lr_scheduler_type"] == "cosine"
    assert s["dtype"] == "bfloat16" and s["eval_loss"] is not None
    swift = tmp_path / "swift.json"
    swift.write_text(json.dumps({"use_tiled_mlp": False, "seq_len": 64, "steps": 1}))
    off = summary_here("--config", str(swift))
    assert not off["use_tiled_mlp"] and off["tiled_modules"] == []


@pytest.mark.slow
def test_other_frameworks_flags_and_local_jsonl(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"text": "hello tiled world " * 40}) for _ in range(20)))
    s = summary_here(
        "--data", str(data), "--seq-len", "128", "--steps", "2", "--use_tiled_mlp", "true",
        "--tiled_mlp_num_shards", "3",
    )  # fmt: skip
    assert s["num_tiles"] == 3 and set(s["tiles_per_mlp"].values()) == {3}
    arctic = summary_here("--seq-len", "1024", "--steps", "1", "--tiled_mlp", "arctic")
    assert set(arctic["tiles_per_mlp"].values()) == {4}  # ceil(1024 / hidden 256)


@pytest.mark.slow
def test_ctrl_c_saves_a_checkpoint_and_exits_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tiledmlp", "train", "--seq-len", "64", "--max-steps", "100000",
           "--output-dir", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    saved = sorted(out.glob("checkpoint-*"))
    assert len(saved) == 1 and (saved[0] / "trainer_state.json").is_file()
    # the whole command that continues the run, ready to paste
    assert (
        f"continue with: tiledmlp train --seq-len 64 --max-steps 100000 --output-dir {out} "
        f"--resume-from-checkpoint {saved[0]}"
    ) in stdout, stdout
    step = int(saved[0].name.split("-")[1])
    more = summary("--seq-len", "64", "--max-steps", str(step + 1), "--output-dir", str(out),
                   "--resume-from-checkpoint", "latest")  # fmt: skip
    assert more["resumed_from_step"] == step and more["steps"] == 1


# Runs `tiledmlp train` with the process killed (SIGKILL, as the OOM killer or a preempted node
# does) in the middle of saving checkpoint-3: after the model and optimizer, before the RNG
# states and the trainer state.
KILLED_DURING_SAVE = """
import os, signal, sys
import transformers
original = transformers.Trainer._save_rng_state
def killed(self, output_dir):
    if self.state.global_step == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return original(self, output_dir)
transformers.Trainer._save_rng_state = killed
from tiledmlp.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_kill_during_a_save_resumes_from_the_last_complete_checkpoint(
    planned_run: tuple[dict, Path], tmp_path: Path, train_here: Callable[..., tuple[int, str]]
) -> None:
    args = ("--seq-len", "128", "--max-steps", "4", "--save-steps", "1")  # the planned run's
    full = planned_run[0]
    out = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_DURING_SAVE, "train", *args, "--output-dir", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # checkpoint-3 was never published; checkpoint-2 is whole
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert (out / "checkpoint-2" / "trainer_state.json").is_file()
    res = train(*args, "--output-dir", str(out), "--resume-from-checkpoint", "latest", "--json")
    assert res.returncode == 0, res.stderr[-3000:]
    notes = [line for line in res.stderr.splitlines() if "skipping" in line]
    assert len(notes) == 1 and "checkpoint-3: its save did not finish" in notes[0], res.stderr
    resumed = json.loads(res.stdout.strip().splitlines()[-1])
    assert resumed["resumed_from_step"] == 2 and resumed["global_step"] == 4
    assert resumed["losses"] == pytest.approx(full["losses"][2:], rel=0, abs=1e-6)
    assert not (out / ".incomplete").exists()  # the unfinished save was cleared
    # A checkpoint of an older, non-atomic save (no trainer_state.json) is skipped by `latest`
    # with a note; a damaged file is named, in one line.
    shutil.copytree(out / "checkpoint-4", out / "checkpoint-8")
    (out / "checkpoint-8" / "trainer_state.json").unlink()
    optimizer = out / "checkpoint-4" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:1000])
    for spec in ("latest", str(out / "checkpoint-4")):  # refused before training: in-process
        rc, stderr = train_here(*args, "--output-dir", str(out), "--resume-from-checkpoint", spec)
        assert rc == 2 and "Traceback" not in stderr, stderr[-3000:]
        last = stderr.strip().splitlines()[-1]
        assert f"{optimizer} is damaged" in last, stderr[-3000:]
        if spec == "latest":
            assert "skipping" in stderr and "checkpoint-8: no trainer_state.json" in stderr


@pytest.mark.slow
def test_tiling_keeps_the_losses_and_lowers_peak_memory() -> None:
    tiled = summary("--seq-len", "4096", "--steps", "2", env=STEADY_MALLOC)
    untiled = summary(
        "--seq-len", "4096", "--steps", "2", "--use_tiled_mlp", "false", env=STEADY_MALLOC
    )
    assert tiled["losses"] == pytest.approx(untiled["losses"], rel=1e-5)
    # process peak (VmHWM) of fresh processes: the untiled run also holds 4 layers of SwiGLU
    # intermediates (several 4096 x 1024 fp32 tensors, 16 MiB each); measured 1091 vs 829 MiB
    assert untiled["peak_mib"] > tiled["peak_mib"] + 150


@pytest.mark.slow
def test_activation_offloading_keeps_the_losses_exactly() -> None:
    args = ("--seq-len", "256", "--steps", "3", "--gradient-checkpointing")
    plain = summary_here(*args)
    offloaded = summary_here(*args, "--activation-offloading")
    assert offloaded["losses"] == plain["losses"]  # bit-identical
    assert offloaded["activation_offloading"] and plain["offloaded_mib"] is None
    # tiny preset: 4 layers, hidden 256, fp32: 3 layer inputs of 256 x 256 x 4 B per step
    assert offloaded["offloaded_mib"] == pytest.approx(3 * 3 * 256 * 256 * 4 / 2**20, abs=0.05)


@pytest.mark.slow
def test_every_n_layers_keeps_the_losses_and_offloads_the_checkpointed_layers_only() -> None:
    args = ("--seq-len", "256", "--steps", "2", "--gradient-checkpointing")
    every = summary_here(*args)
    second = summary_here(*args, "--every-n-layers", "2", "--activation-offloading")
    assert second["losses"] == pytest.approx(every["losses"], rel=1e-6)
    assert second["every_n_layers"] == 2 and every["every_n_layers"] == 1
    # tiny preset: 4 layers, layers 0 and 2 checkpointed: layer 0's input moves each step
    assert second["offloaded_mib"] == pytest.approx(2 * 256 * 256 * 4 / 2**20, abs=0.05)


def _bad_files(tmp: Path) -> dict[str, str]:
    (tmp / "bin.txt").write_bytes(bytes(range(128, 256)) * 4)
    (tmp / "no-text.csv").write_text("body,id\nhello,1\n")
    (tmp / "bad.yaml").write_text("seq_len: 64\nmax_step: 3\n")
    (tmp / "list.yaml").write_text("- 1\n")
    (tmp / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "cut\n')
    (tmp / "no-tokenizer").mkdir()
    (tmp / "no-tokenizer" / "config.json").write_text('{"model_type": "llama"}')
    return {"TMP": str(tmp)}


# (args, message): bad input to `tiledmlp train`, reported in one line with exit status 2
BAD_INPUT = [
    (["--activation-offloading"], "add --gradient-checkpointing"),
    (
        ["--every-n-layers", "2"],
        "chooses which layers are checkpointed: add --gradient-checkpointing",
    ),
    (["--every-n-layers", "0"], "--every-n-layers must be an integer >= 1, got 0"),
    (["--data", "/nonexistent.txt"], "is not a file"),
    (["--data", "TMP/bin.txt"], "bin.txt is not UTF-8 text"),
    (["--data", "TMP/no-text.csv"], 'no-text.csv record 0 has no field "text" (fields: body'),
    (["--model", "no-such-model"], "neither a preset"),
    (["--model", "TMP/no-tokenizer"], "no-tokenizer has no weights (model.safetensors"),
    (["--config", "TMP/bad.yaml"], "unknown key 'max_step'; did you mean 'max_steps'?"),
    (["--config", "TMP/list.yaml"], "must hold a mapping"),
    (["--config", "TMP/none.yaml"], "is not a file"),
    (["--engine", "deepspeed"], "needs --deepspeed CONFIG"),
    (["--use_tiled_mlp", "maybe"], "must be true or false"),
    (["--tiled_mlp", "target:lots"], "expected 'target:<GB>'"),
    (["--dtype", "fp8"], "--dtype must be one of"),
    (["--max-steps", "0"], "--max-steps must be an integer >= 1, got 0"),
    (["--learning-rate", "fast"], "--learning-rate expected a number"),
    (["--save-steps", "2"], "add --output-dir"),
    (["--output-dir", "TMP/list.yaml"], "list.yaml is a file; expected a directory"),
    (
        ["--data", "TMP/bad.jsonl"],
        "bad.jsonl:2 is not valid JSON (Invalid control character"
        " at column 14); each line must be one JSON object",
    ),
    (["--resume-from-checkpoint", "TMP/none"], "is not a directory"),
    (["--engine", "ddp"], "needs a launcher"),
    (
        ["--sequence-parallel-size", "2"],
        "world size (1) must be divisible by --sequence-parallel-size (2)",
    ),
    (["--sequence-parallel-size", "3"], "--seq-len 64 must be divisible by"),
    (["--tile-budget-gb", "0"], "positive number of GiB"),
]


def _bad_args(args: list[str], tmp: Path) -> list[str]:
    subst = _bad_files(tmp)
    args = [a.replace("TMP", subst["TMP"]) for a in args]
    return [*args, "--seq-len", "64"] + ([] if "--max-steps" in args else ["--max-steps", "1"])


def _assert_one_error_line(returncode: int, stderr: str, message: str) -> None:
    assert returncode == 2, stderr
    assert "Traceback" not in stderr and message in stderr, stderr
    assert [line for line in stderr.splitlines() if "error" in line.lower()] == [
        stderr.strip().splitlines()[-1]
    ], stderr


@pytest.mark.parametrize(("args", "message"), BAD_INPUT)
def test_bad_input_is_one_line(
    args: list[str],
    message: str,
    tmp_path: Path,
    train_here: Callable[..., tuple[int, str]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # In this process (the next test runs one case as a user does). What a fresh process would
    # print is all here: stderr, and the log records its WARNING-level handler would show.
    rc, stderr = train_here(*_bad_args(args, tmp_path))
    _assert_one_error_line(rc, stderr, message)
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not [m for m in logged if "error" in m.lower()], logged


@pytest.mark.slow
def test_bad_input_is_one_line_in_a_fresh_process(tmp_path: Path) -> None:
    res = train(*_bad_args(["--data", "TMP/bad.jsonl"], tmp_path))
    _assert_one_error_line(res.returncode, res.stderr, "bad.jsonl:2 is not valid JSON")


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["ddp", "fsdp2", "deepspeed"])
def test_under_torchrun_every_engine_matches_one_process(
    engine: str, single_process_batch_2: dict, tmp_path: Path
) -> None:
    # 2 processes x batch 1 see the single process's batch of 2 (the Trainer's sampler hands
    # consecutive batches to the ranks); fp32 losses agree to rounding.
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    launcher = [*TORCHRUN, "--nproc_per_node", "2", "-m"]
    extra = {
        "ddp": [],
        "fsdp2": ["--fsdp", "full_shard"],
        "deepspeed": ["--deepspeed", str(EXAMPLES / "ds_zero3.json")],
    }[engine]
    out = tmp_path / "out"
    res = train(
        "--seq-len", "128", "--max-steps", "3", "--json", "--output-dir", str(out), *extra,
        launcher=launcher,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads(res.stdout.strip().splitlines()[-1])
    assert s["world_size"] == 2 and s["engine"] == engine
    assert s["losses"] == pytest.approx(single_process_batch_2["losses"], rel=1e-5)
    import transformers

    # the saved model is whole (ZeRO-3 gathered, FSDP2 full state dict) and loads
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.model.layers[0].mlp.gate_proj.weight.shape == (1024, 256)


@pytest.mark.distributed
def test_sequence_parallel_under_torchrun_matches_one_process(
    single_process_accumulated: dict, tmp_path: Path
) -> None:
    # Each sequence split over 2 ranks (Ulysses), ZeRO-3 over both through the Trainer: the
    # losses are those of one process on the whole sequences.
    pytest.importorskip("deepspeed")
    ga = ("--gradient-accumulation-steps", "2")  # micro-batch means averaged, as one process's
    one = single_process_accumulated
    launcher = [*TORCHRUN, "--nproc_per_node", "2", "-m"]
    config = tmp_path / "ds.json"  # the example's ZeRO-3 config, batch sizes from the Trainer
    ds = json.loads((EXAMPLES / "ds_zero3.json").read_text())
    ds.update(train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps="auto")
    config.write_text(json.dumps(ds))
    res = train(
        "--seq-len", "128", "--max-steps", "3", "--json", "--sequence-parallel-size", "2",
        "--eval-steps", "3", "--deepspeed", str(config), *ga, launcher=launcher,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    s = json.loads(res.stdout.strip().splitlines()[-1])
    assert s["sequence_parallel_size"] == 2 and s["engine"] == "deepspeed"
    assert s["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert s["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)  # evaluation splits too


# Rank 1 leaves (exit status 0, so torchrun does not stop the others) as step 3 begins.
RANK_1_LEAVES = """
import os, sys
import tiledmlp.train.callbacks as callbacks
def leave(self, args, state, control, **kwargs):
    if state.global_step == 2 and os.environ.get("RANK") == "1":
        os._exit(0)
callbacks.Progress.on_step_begin = leave
from tiledmlp.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.distributed
def test_a_rank_that_leaves_mid_run_is_named_and_nothing_hangs(tmp_path: Path) -> None:
    # Under torchrun, with torchrun's default port held by another program (as a second test
    # suite would): the launch still works, and when rank 1 leaves, rank 0 stops within
    # seconds with one line naming it instead of a transport error or a wait.
    import socket

    script = tmp_path / "leaves.py"
    script.write_text(RANK_1_LEAVES)
    with socket.socket() as other:
        try:
            other.bind(("127.0.0.1", 29500))
            other.listen()
        except OSError:
            pass  # already taken by someone else: the same situation
        start = time.monotonic()
        res = subprocess.run(
            [*TORCHRUN, "--nproc_per_node", "2", str(script), "train", "--seq-len", "64",
             "--max-steps", "6", "--ddp-timeout", "60"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        elapsed = time.monotonic() - start
    assert res.returncode != 0, res.stderr[-3000:]
    named = [line for line in res.stderr.splitlines() if "rank 1 stopped answering" in line]
    # (the progress bar's last refresh may share the line: it ends without a newline)
    assert named and "tiledmlp train: error: tiledmlp: " in named[0], res.stderr[-3000:]
    assert "failed on rank 0" in named[0]
    assert elapsed < 240, elapsed


@pytest.mark.slow
def test_a_resume_continues_the_runs_settings_and_says_or_refuses_a_change(
    tmp_path: Path, train_here: Callable[..., tuple[int, str]]
) -> None:
    out = tmp_path / "run"
    settings = ("--learning-rate", "1e-3", "--lr-scheduler-type", "cosine",
                "--gradient-accumulation-steps", "2", "--seq-len", "32")  # fmt: skip
    first = summary_here(
        *settings, "--max-steps", "3", "--save-steps", "1", "--output-dir", str(out)
    )
    checkpoint = out / "checkpoint-1"
    assert (checkpoint / "tiledmlp_run.json").is_file()
    # Given the checkpoint alone, the run goes on with its own settings, not the defaults.
    again = summary_here("--resume-from-checkpoint", str(checkpoint))
    assert (again["learning_rate"], again["lr_scheduler_type"]) == (1e-3, "cosine")
    assert (again["gradient_accumulation_steps"], again["seq_len"]) == (2, 32)
    assert again["max_steps"] == 3 and again["resumed_from_step"] == 1
    assert again["losses"] == pytest.approx(first["losses"][1:], rel=0, abs=1e-6)
    # An option that changes the run is refused in one line, before any work.
    rc, refused = train_here("--resume-from-checkpoint", str(checkpoint),
                             "--lr-scheduler-type", "linear")  # fmt: skip
    assert rc == 2 and "Traceback" not in refused, refused
    assert (
        refused.strip()
        .splitlines()[-1]
        .endswith(
            f"the run used --lr-scheduler-type cosine, this command gives linear; a resume continues "
            f"the same run: drop --lr-scheduler-type, or start a new run from the saved model with "
            f"--model {checkpoint}"
        )
    ), refused
    assert "loading" not in refused
    # One that changes only memory and speed is applied and said; a shorter --max-steps too.
    res = train("--resume-from-checkpoint", str(checkpoint), "--num-tiles", "2",
                "--max-steps", "2", "--json")  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    notes = [line for line in res.stderr.splitlines() if line.startswith("tiledmlp train: --")]
    assert any("--num-tiles 2: applied on resume (the run had auto)" in n for n in notes), notes
    assert any("stopping at step 2 of the 3 the run was planned for" in n for n in notes), notes
    short = json.loads(res.stdout)
    assert short["steps"] == 1 and short["learning_rate"] == 1e-3
    assert short["losses"] == pytest.approx(first["losses"][1:2], rel=1e-5)


@pytest.mark.slow
def test_compile_keeps_the_losses() -> None:
    # --compile: the Trainer's torch_compile (inductor), the tiled MLPs and loss as operators
    args = ("--seq-len", "128", "--steps", "3", "--num-tiles", "2", "--tiled-loss")
    eager = summary_here(*args)
    compiled = summary_here(*args, "--compile")
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
