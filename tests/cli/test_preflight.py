"""`tiledmlp train`'s pre-flight (cli/preflight.py) and what `plan`'s bottom line names: a run
that cannot fit is refused in one line naming what fits, before anything is loaded; a run near
the edge gets a note; the flags, call and keys of each stack turn on exactly that stack."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tiledmlp.cli import main
from tiledmlp.cli.preflight import preflight
from tiledmlp.cli.stack_command import axolotl_keys, patch_call, train_flags
from tiledmlp.config.patch import FEATURES
from tiledmlp.config.stacks import STACK_PATCHES, STACKS, stack_keywords
from tiledmlp.train.launch import Launch
from tiledmlp.train.options import options_from

CPU = Launch(world=1, engine="single", cuda=False, own_fsdp=False)


def _flag_values(flags: list[str]) -> dict[str, Any]:
    """`--a --b false` -> {"a": "true", "b": "false"}, as the train command line reads them."""
    out: dict[str, Any] = {}
    for i, word in enumerate(flags):
        if word.startswith("--"):
            value = (
                flags[i + 1] if i + 1 < len(flags) and not flags[i + 1].startswith("--") else "true"
            )
            out[word[2:]] = value
    return out


@pytest.mark.parametrize("stack", STACKS)
def test_each_stack_s_train_flags_turn_on_exactly_its_features(stack: str) -> None:
    opts = options_from(_flag_values(train_flags(stack)))
    on = {f for f in FEATURES if opts.patch is not None and getattr(opts.patch, f)}
    patch = STACK_PATCHES[stack]
    assert on == {f for f in FEATURES if patch is not None and getattr(patch, f)}
    call = patch_call(stack)
    keys = axolotl_keys(stack)
    keywords = stack_keywords(stack)
    if keywords is None:
        assert call == "" and keys == []
    else:
        # the features beyond the tiled MLPs (on by default), each set once
        assert set(keywords) == on - {"tiled_mlp"} and set(keywords.values()) <= {True}
        assert call == "patch_model(model" + "".join(f", {k}=True" for k in keywords) + ")"
        assert "tiledmlp: true" in keys
        assert all(f"tiledmlp_{k}: true" in keys for k in keywords)


def test_a_stack_s_call_spells_its_features_in_the_order_the_stacks_add_them() -> None:
    assert patch_call("tiled_mlp_loss_offload_norms") == (
        "patch_model(model, tiled_loss=True, activation_offloading=True, tiled_norms=True)"
    )


def _one_error_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line]
    errors = [line for line in lines if "error:" in line]
    assert len(errors) == 1 and errors[0] == lines[-1], err
    assert "Traceback" not in err and "loading" not in err, err  # nothing loaded
    return errors[0]


@pytest.mark.slow  # plans the stacks that add to the run's (seconds each on two CPUs)
def test_a_run_that_cannot_fit_is_refused_naming_the_stack_that_fits(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    rc = main(["train", "--model", "tiny", "--seq-len", "16384", "--use-tiled-mlp", "false",
               "--memory-gb", "1", "--output-dir", str(out)])  # fmt: skip
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and not out.exists()
    assert "pre-flight: this run (untiled, 16,384 tokens) needs about" in line
    assert "GiB more than the 1.00 GiB of --memory-gb 1" in line
    assert "it fits with the default tiling (stack tiled_mlp_loss" in line
    assert line.endswith("--no-preflight skips this check")


@pytest.mark.slow  # the longest-length search (about a minute on two loaded CPUs)
def test_a_length_no_stack_fits_is_refused_naming_the_longest_that_does(tmp_path, capsys) -> None:
    out = tmp_path / "out"
    rc = main(["train", "--model", "tiny", "--seq-len", "1000000", "--memory-gb", "10",
               "--output-dir", str(out)])  # fmt: skip
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and not out.exists()
    assert "no stack fits 1,000,000 tokens: the longest that fits is --seq-len" in line
    longest = int(line.split("the longest that fits is --seq-len ")[1].split()[0])
    assert 0 < longest < 1_000_000 and longest % 1024 == 0


def test_a_run_within_ten_percent_of_the_memory_gets_a_note_and_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the one answer planned here
    opts = options_from({"model": "tiny", "seq_len": 512, "memory_gb": 100})
    preflight(opts, CPU)
    assert "pre-flight" not in capsys.readouterr().err  # far from the edge: nothing said
    from tiledmlp.plan.cache import cache_dir

    (file,) = cache_dir().glob("*.json")
    need_gib = json.loads(file.read_text())["answer"]["per_gpu_mib"] / 1024
    near = options_from({"model": "tiny", "seq_len": 512, "memory_gb": need_gib / 0.95})
    preflight(near, CPU)
    err = capsys.readouterr().err
    assert "pre-flight: this run needs about" in err and "within 10% of it" in err
    off = options_from(
        {"model": "tiny", "seq_len": 512, "memory_gb": need_gib / 2, "preflight": False}
    )
    preflight(off, CPU)  # skipped: nothing planned, nothing refused


def test_a_sequence_past_the_model_s_positions_gets_a_note(tmp_path: Path, capsys) -> None:
    fields = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 300, "max_position_embeddings": 256}  # fmt: skip
    plain = tmp_path / "plain" / "config.json"
    plain.parent.mkdir()
    plain.write_text(json.dumps(fields))
    preflight(options_from({"model": str(plain), "seq_len": 512, "memory_gb": 100}), CPU)
    err = capsys.readouterr().err
    assert "--seq-len 512 is past the model's max_position_embeddings (256)" in err
    assert "sets no RoPE scaling" in err and '"factor": 2' in err
    scaled = tmp_path / "scaled" / "config.json"
    scaled.parent.mkdir()
    scaled.write_text(
        json.dumps({**fields, "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    )
    preflight(options_from({"model": str(scaled), "seq_len": 512, "memory_gb": 100}), CPU)
    err = capsys.readouterr().err
    assert "its config scales RoPE (linear, factor 2)" in err
    preflight(options_from({"model": str(plain), "seq_len": 256, "memory_gb": 100}), CPU)
    assert "max_position_embeddings" not in capsys.readouterr().err


def test_a_run_the_planner_cannot_describe_is_not_judged(capsys) -> None:
    opts = options_from({"model": "tiny", "seq_len": 512, "memory_gb": 0.001,
                         "per_device_train_batch_size": 2})  # fmt: skip
    preflight(opts, CPU)  # not refused: not planned
    assert (
        "pre-flight skipped: the planner plans batches of one sequence" in capsys.readouterr().err
    )
    odd = options_from({"model": "tiny", "seq_len": 512, "memory_gb": 0.001, "tiled_norms": True})
    preflight(odd, CPU)
    assert "are not one of them" in capsys.readouterr().err


def test_a_model_the_planner_cannot_build_is_noted_and_not_judged(tmp_path: Path, capsys) -> None:
    config = tmp_path / "config.json"  # a model_type transformers does not know
    config.write_text(json.dumps({"model_type": "no-such-model", "max_position_embeddings": 64}))
    preflight(options_from({"model": str(config), "seq_len": 128, "memory_gb": 0.001}), CPU)
    err = capsys.readouterr().err
    assert "pre-flight skipped:" in err and "no-such-model" in err, err
    assert "past the model's max_position_embeddings (64)" in err
