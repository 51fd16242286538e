"""`tiledmlp plan` and `tiledmlp train`'s pre-flight build one request from the same flags
(train/step_request.py): the command plan's bottom line prints is accepted or refused by its
own pre-flight exactly as the plan said, with the same figure; `plan <train's flags>` and the
pre-flight of `train <the same flags>` give the same figure; where no stack fits, what plan
names instead is planned and fits."""

from __future__ import annotations

import json
import logging
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from tiledmlp.cli import _build_parser, main
from tiledmlp.cli.preflight import preflight
from tiledmlp.cli.train import option_values
from tiledmlp.plan import stack_speed
from tiledmlp.train.launch import Launch
from tiledmlp.train.options import options_from

CPU = Launch(world=1, engine="single", cuda=False, own_fsdp=False)
_NEEDS = re.compile(r"needs about ([\d,.]+) GiB")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def _plan(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, Any]:
    assert main(["plan", *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def _preflight(command: str, caplog: pytest.LogCaptureFixture) -> tuple[bool, float]:
    """(accepted, GiB it needs) of the pre-flight of `command` (a `tiledmlp train ...` line)
    run with --max-steps 1: the options parsed as `tiledmlp train` parses them, the pre-flight
    run before anything is loaded (nothing trains)."""
    words = shlex.split(command)
    assert words[:2] == ["tiledmlp", "train"], command
    parsed = _build_parser().parse_args([*words[1:], "--max-steps", "1"])
    opts = options_from(option_values(parsed))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="tiledmlp.cli.preflight"):
        try:
            preflight(opts, CPU)
        except ValueError as e:
            found = _NEEDS.search(str(e))
            assert found is not None, str(e)
            return False, float(found.group(1).replace(",", ""))
    found = _NEEDS.search(caplog.text)
    assert found is not None, caplog.text
    return True, float(found.group(1).replace(",", ""))


@pytest.mark.slow  # plans every stack of each model twice (about a minute on two loaded CPUs)
@pytest.mark.parametrize(
    "flags",
    [
        ("--model", "tiny", "--seq-len", "1000000"),
        ("--model", "tiny", "--seq-len", "1000000", "--gpu", "h100-80gb"),
        ("--model", "llama3-8b", "--seq-len", "131072", "--device", "cpu"),
        ("--model", "llama3-8b", "--seq-len", "131072", "--gpu", "h100-80gb"),
    ],
    ids=["tiny-here", "tiny-h100", "8b-cpu", "8b-h100"],
)
def test_the_bottom_line_s_command_passes_or_fails_its_pre_flight_as_planned(
    flags: tuple[str, ...], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    line = _plan(capsys, *flags)["bottom_line"]
    judged = [line]
    if "here" in line:  # no GPU here and none named: this machine's line comes first
        judged.insert(0, line["here"])
    for each in judged:
        if each["fastest"] is not None:
            accepted, gib = _preflight(each["train_command"], caplog)
            assert accepted, each["train_command"]
            assert gib == pytest.approx(each["fits"][each["fastest"]], abs=0.01)
        for alt in each.get("would_fit", []):
            if alt["train_command"].startswith("tiledmlp train"):  # one process: checked here
                accepted, gib = _preflight(alt["train_command"], caplog)
                assert accepted and gib == pytest.approx(alt["gib"], abs=0.01), alt
        for stack, planned in each["does_not_fit"].items():
            if stack != "tiled_layer":
                continue  # the least demanding: its own command is refused with its figure
            command = _command_of(flags, stack, "--device" in flags)
            accepted, gib = _preflight(command, caplog)
            assert not accepted and gib == pytest.approx(planned, abs=0.01), command


def _command_of(flags: tuple[str, ...], stack: str, cpu: bool) -> str:
    from tiledmlp.cli.stack_command import train_flags

    words = ["tiledmlp", "train", *(w for w in flags if w != "--device" and w != "cpu")]
    if "--dtype" not in words:
        words += ["--dtype", "float32"]
    if not cpu and "--gpu" not in words:
        words += ["--gpu", "h100-80gb"]
    return shlex.join([*words, *train_flags(stack)])


@pytest.mark.parametrize(
    "flags",
    [
        ("--model", "tiny", "--seq-len", "8192"),
        ("--model", "tiny", "--seq-len", "8192", "--dtype", "bf16", "--gpu", "h100-80gb"),
        ("--model", "tiny", "--seq-len", "4096", "--tiled-loss", "false", "--gpu", "4090"),
        (
            "--model",
            "tiny",
            "--seq-len",
            "4096",
            "--gradient-checkpointing",
            "--activation-offloading",
            "--num-tiles",
            "4",
            "--gpu",
            "h100-80gb",
        ),
    ],
    ids=["cpu-fp32", "h100-bf16", "4090-untiled-loss", "h100-offload-4-tiles"],
)
def test_plan_of_train_s_flags_gives_the_pre_flight_s_figure(
    flags: tuple[str, ...], capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    on_card = "--gpu" in flags
    features = "--tiled-loss" in flags or "--activation-offloading" in flags
    plan_flags = flags if on_card else (*flags, "--device", "cpu")  # this machine's RAM
    if not features:  # train's default stack; the features name their own
        plan_flags = (*plan_flags, "--stacks", "tiled_mlp_loss")
    result = _plan(capsys, *plan_flags)
    (stack,) = result["model"]  # planned alone
    line = result["bottom_line"]
    planned = {**line["fits"], **line["does_not_fit"]}[stack]
    accepted, gib = _preflight(shlex.join(["tiledmlp", "train", *flags]), caplog)
    assert accepted == (stack in line["fits"])
    assert gib == pytest.approx(planned, abs=0.01)


def test_plan_assumes_train_s_optimizer_and_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ("--model", "tiny", "--seq-len", "2048", "--stacks", "tiled_mlp_loss")
    default = _plan(capsys, *flags)
    assert default["optimizer"] == "adamw"
    entry = default["model"]["tiled_mlp_loss"]
    assert entry["breakdown_mib"].get("optimizer", 0) > 0
    bare = _plan(capsys, *flags, "--optimizer", "none")
    assert bare["model"]["tiled_mlp_loss"]["peak_mib"] < entry["peak_mib"]
    assert "--dtype float32" in default["bottom_line"]["train_command"]
    offload = _plan(capsys, *flags, "--engine", "zero3", "--offload-params")
    assert offload["optimizer"] == "cpu-offload"  # with the parameters, as train's ZeRO-3
    line = offload["bottom_line"]
    assert "--deepspeed ZERO3.json" in line["train_command"]
    assert line["deepspeed_config"] == {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu"},
        }
    }


@pytest.mark.slow  # searches two stacks of the 8B, then plans each change (about a minute)
def test_where_no_length_fits_plan_names_what_would_and_nothing_contradictory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = ("--model", "llama3-8b", "--seq-len", "131072", "--memory-gb", "24",
             "--stacks", "tiled_mlp_loss,tiled_layer")  # fmt: skip
    result = _plan(capsys, *flags)
    assert all(e.get("max_seq_len") == 0 for e in result["model"].values())
    line = result["bottom_line"]
    assert line["fastest"] is None and "longest_that_fits" not in line
    would = line["would_fit"]
    assert would, line
    for alt in would:
        within = 24.0 if "--gpu" not in alt["train_command"] else 200.0
        assert alt["gib"] <= within, alt
    assert any("ZeRO-3" in a["what"] for a in would)
    assert main(["plan", *flags]) == 0  # the text, from the cache
    text = " ".join(capsys.readouterr().out.split())
    assert "shorten" not in text and "a shorter sequence fits" not in text
    assert "what the planner finds to fit 131,072 tokens" in text


@pytest.mark.slow  # plans the tiny model at 1M tokens, then its pre-flight (about 15 s)
def test_where_the_asked_stacks_do_not_fit_the_least_demanding_one_is_named_first(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    result = _plan(capsys, "--model", "tiny", "--seq-len", "1000000", "--gpu", "h100-80gb",
                   "--stacks", "untiled")  # fmt: skip
    line = result["bottom_line"]
    assert line["fastest"] is None
    (alt,) = line["would_fit"]  # it fits this card: no larger card, no other change
    assert alt["stack"] == "tiled_layer" and "--gpu h100-80gb" in alt["train_command"]
    accepted, gib = _preflight(alt["train_command"], caplog)
    assert accepted and gib == pytest.approx(alt["gib"], abs=0.05)


def test_the_attention_kernel_is_one_type_from_the_flag_to_the_step() -> None:
    import dataclasses

    from tiledmlp.cli.plan_args import PlanArgs
    from tiledmlp.config.plan import StepSpec
    from tiledmlp.ops.attention.buffers import KernelChoice

    parsed = _build_parser().parse_args(
        ["plan", "--model", "tiny", "--attention-kernel", "by-heads"]
    )
    args = PlanArgs.of(parsed)
    assert args.attention_kernel == KernelChoice("by_heads")
    assert PlanArgs.of(_build_parser().parse_args(["plan"])).attention_kernel == KernelChoice()
    step = StepSpec(seq_len=1024, attention_kernel="flash")  # a name is typed once, here
    assert step.attention_kernel == KernelChoice("flash")
    assert StepSpec(seq_len=1024).attention_kernel == KernelChoice("cudnn")
    assert dataclasses.replace(step, attention_kernel="math").attention_kernel == KernelChoice(
        "math"
    )
    with pytest.raises(ValueError, match="one attention kernel"):
        StepSpec(seq_len=1024, attention_kernel="auto")
    from tiledmlp.cli.plan_request import step_of

    assert step_of(args).attention_kernel == KernelChoice("by_heads")  # train's option too
    auto = PlanArgs.of(_build_parser().parse_args(["plan", "--model", "tiny"]))
    assert step_of(auto).attention_kernel == KernelChoice("cudnn")  # auto: cuDNN's first
    opts = options_from({"model": "tiny", "attention_kernel": "by_heads"})
    from tiledmlp.train.step_request import step_request

    assert step_request(opts).step.attention_kernel == KernelChoice("by_heads")


def test_every_n_layers_plans_the_run_beside_every_layer_and_the_bottom_line_takes_it(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # train's flags with --every-n-layers 2: the row "<stack>+every_2" is the pre-flight's
    # step; the row checkpointing every layer is planned beside it; where both fit, the bottom
    # line takes the one that recomputes less, and its command's pre-flight has its figure
    flags = ("--model", "tiny", "--seq-len", "4096", "--gradient-checkpointing",
             "--activation-offloading", "--every-n-layers", "2", "--num-tiles", "4",
             "--gpu", "h100-80gb")  # fmt: skip
    result = _plan(capsys, *flags)
    assert list(result["model"]) == ["tiled_mlp_loss_offload", "tiled_mlp_loss_offload+every_2"]
    every, each = (result["model"][r] for r in result["model"])
    assert every["host_peak_mib"] > each["host_peak_mib"]  # every layer's input but the last
    assert 0.8 < each["flops_vs_every_layer"] < 1.0 and "flops_vs_every_layer" not in every
    line = result["bottom_line"]
    assert line["fastest"] == "tiled_mlp_loss_offload+every_2"
    assert "--every-n-layers 2" in line["train_command"]
    assert line["axolotl"][-1].startswith("# every 2nd layer checkpointed: no axolotl key")
    assert line["time_ratio"] == pytest.approx(
        stack_speed.time_ratio("tiled_mlp_loss_offload") * each["flops_vs_every_layer"], abs=1e-4
    )
    accepted, gib = _preflight(shlex.join(["tiledmlp", "train", *flags]), caplog)
    assert accepted and gib == pytest.approx(line["fits"][line["fastest"]], abs=0.01)
    accepted, gib = _preflight(line["train_command"], caplog)
    assert accepted and gib == pytest.approx(line["fits"][line["fastest"]], abs=0.01)
