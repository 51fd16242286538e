"""A resume's settings, without training: what a checkpoint records, what the resumed run is
built with, and what is refused or said (train/resume.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tiledmlp.train.options import options_from
from tiledmlp.train.resume import RUN_SETTINGS, resume, settings_record


def _checkpoint(tmp: Path, given: dict, max_steps: int) -> Path:
    path = tmp / "run" / "checkpoint-2"
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"max_steps": max_steps}))
    (path / RUN_SETTINGS).write_text(json.dumps(settings_record(given, max_steps)))
    return path


def _resume(given: dict) -> tuple:
    notes: list[str] = []
    plan, settings = resume(options_from(given), given, notes.append)
    return plan, settings, notes


def test_options_not_given_again_are_the_runs(tmp_path: Path) -> None:
    first = {"seq_len": "64", "lr": "1e-3", "lr_scheduler_type": "cosine", "max_steps": "9",
             "output_dir": str(tmp_path / "run")}  # fmt: skip
    ckpt = _checkpoint(tmp_path, first, 9)
    plan, settings, notes = _resume({"resume_from_checkpoint": str(ckpt)})
    built = plan.build
    assert (built.seq_len, built.learning_rate, built.lr_scheduler_type) == (64, 1e-3, "cosine")
    assert built.max_steps == 9 and plan.stop_at is None and plan.checkpoint == ckpt
    assert notes == []
    # what the resumed run records in its own checkpoints: the same settings
    assert settings_record(settings, 9)["options"] == settings_record(first, 9)["options"]


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"lr": "2e-3"}, "the run used --learning-rate 0.001, this command gives 0.002"),
        ({"seq_len": "128"}, "the run used --seq-len 64, this command gives 128"),
        ({"lr_scheduler_type": "linear"}, "--lr-scheduler-type cosine, this command gives linear"),
        (
            {"data_field": "body"},
            "the run used --data-field (text, else messages), this command gives body",
        ),
        ({"max_steps": "10"}, "that run was planned for --max-steps 9, this one asks for 10"),
    ],
)
def test_a_change_to_the_run_is_refused_in_one_line(
    change: dict, refused: str, tmp_path: Path
) -> None:
    ckpt = _checkpoint(tmp_path, {"seq_len": "64", "lr": "1e-3", "lr_scheduler_type": "cosine"}, 9)
    with pytest.raises(ValueError) as info:
        _resume({"resume_from_checkpoint": str(ckpt), **change})
    assert refused in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("model", "used"),
    [("tiny", "0.002 (the default for tiny)"), ("small", "0.001 (the default for small)")],
)
def test_a_refusal_says_the_default_learning_rate_the_run_used(
    model: str, used: str, tmp_path: Path
) -> None:
    ckpt = _checkpoint(tmp_path, {"model": model, "seq_len": "64"}, 9)
    with pytest.raises(ValueError) as info:
        _resume({"resume_from_checkpoint": str(ckpt), "lr": "1e-4"})
    assert f"the run used --learning-rate {used}, this command gives 0.0001" in str(info.value)
    assert "not set" not in str(info.value)


def test_memory_and_speed_options_are_applied_and_said(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, {"seq_len": "64", "num_tiles": "4"}, 9)
    plan, _, notes = _resume({"resume_from_checkpoint": str(ckpt), "num_tiles": "2",
                              "gradient_checkpointing": "true", "max_steps": "5"})  # fmt: skip
    assert plan.build.patch is not None and plan.build.patch.tiles.num_tiles == 2
    assert plan.build.gradient_checkpointing and plan.build.max_steps == 9 and plan.stop_at == 5
    assert any("--num-tiles 2: applied on resume (the run had 4)" in n for n in notes), notes
    assert any("--gradient-checkpointing true: applied on resume" in n for n in notes), notes
    assert any("stopping at step 5 of the 9 the run was planned for" in n for n in notes), notes


def test_a_checkpoint_without_settings_resumes_with_the_command_and_says_so(
    tmp_path: Path,
) -> None:
    ckpt = _checkpoint(tmp_path, {}, 9)
    (ckpt / RUN_SETTINGS).unlink()
    plan, _, notes = _resume({"resume_from_checkpoint": str(ckpt), "seq_len": "32"})
    assert plan.build.seq_len == 32 and plan.build.max_steps == 9
    assert len(notes) == 1 and "records no run settings" in notes[0]


def test_a_checkpoint_records_the_runs_whole_typed_options(tmp_path: Path) -> None:
    from tiledmlp.train.options import spelled

    first = {"seq_len": "64", "lr": "1e-3", "tiled_norms": "true", "num_tiles": "target:0.5",
             "attention_kernel": "auto:2", "output_dir": str(tmp_path / "run")}  # fmt: skip
    record = settings_record(first, 9)
    # every option but the per-invocation ones, by its main key, read back into equal options
    assert record["options"]["tiled_norms"] is True and record["options"]["learning_rate"] == 1e-3
    assert "output_dir" not in record["options"] and record["max_steps"] == 9
    again = options_from(record["options"])
    assert spelled(again) == {**spelled(options_from(first)), "output_dir": None}


def test_a_checkpoint_of_the_earlier_format_still_resumes(tmp_path: Path) -> None:
    # earlier checkpoints recorded only the options their run was given
    ckpt = _checkpoint(tmp_path, {}, 9)
    (ckpt / RUN_SETTINGS).write_text(json.dumps({"options": {"seq_len": 64, "lr": "1e-3"},
                                                 "max_steps": 9}))  # fmt: skip
    plan, _, notes = _resume({"resume_from_checkpoint": str(ckpt)})
    assert (plan.build.seq_len, plan.build.learning_rate, plan.build.max_steps) == (64, 1e-3, 9)
    assert notes == []
    (ckpt / RUN_SETTINGS).write_text(json.dumps(["seq_len", 64]))
    with pytest.raises(ValueError, match="is not a run-settings record"):
        _resume({"resume_from_checkpoint": str(ckpt)})


def test_an_option_given_again_in_another_spelling_replaces_the_runs(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path, {"seq_len": "64", "num_tiles": "4"}, 9)
    plan, _, notes = _resume({"resume_from_checkpoint": str(ckpt), "tiled_mlp_num_shards": "2"})
    assert plan.build.patch is not None and plan.build.patch.tiles.num_tiles == 2
    assert any("--num-tiles 2: applied on resume (the run had 4)" in n for n in notes), notes


def test_the_runs_saving_and_logging_are_kept_and_a_change_is_said(tmp_path: Path) -> None:
    out = str(tmp_path / "run")
    first = {"seq_len": "64", "save_steps": "3", "save_total_limit": "2", "logging_steps": "2",
             "eval_steps": "3", "output_dir": out}  # fmt: skip
    ckpt = _checkpoint(tmp_path, first, 6)
    plan, settings, notes = _resume({"resume_from_checkpoint": str(ckpt), "output_dir": out})
    built = plan.build
    assert (built.save_steps, built.save_total_limit, built.logging_steps) == (3, 2, 2)
    assert built.eval_steps == 3 and notes == []
    assert settings_record(settings, 6)["options"]["save_steps"] == 3
    plan, _, notes = _resume({"resume_from_checkpoint": str(ckpt), "output_dir": out,
                              "save_steps": "2", "logging_steps": "2"})  # fmt: skip
    assert (plan.build.save_steps, plan.build.logging_steps) == (2, 2)
    assert notes == [
        "--save-steps 2: applied on resume (the run had 3); it changes what is saved and "
        "logged, not the losses"
    ]
    # without --output-dir there is nowhere to save: the run's --save-steps is not kept, said
    plan, _, notes = _resume({"resume_from_checkpoint": str(ckpt)})
    assert plan.build.save_steps is None and plan.build.logging_steps == 2
    assert notes == [
        "--save-steps 3 of the run not kept: this command has no --output-dir to save "
        "checkpoints into"
    ]
