"""Resuming a run: the checkpoint to resume from, and the settings it is resumed with.

Every checkpoint-N holds its run's settings (tiledmlp_run.json: the run's TrainOptions, every
option by its main key (options.spelled) but the per-invocation ones, and the --max-steps it
was planned for; a checkpoint written before held only the options its run was given, read the
same way). A resume continues that run: options not given
again are taken from the checkpoint; an option given again with a different value that would
change the run's math (the data, the model, the schedule, the batches) is refused in one line;
one that changes only memory and speed (tiling, checkpointing, offloading, kernels) is applied
and said in one line; the saving and logging settings (--save-steps, --save-total-limit,
--logging-steps, --report-to) are the run's unless given again (a change said in one line);
per-invocation options (the output directory, the engine) are this command's. A smaller --max-steps stops early (said in one line); a larger one is refused (the
schedule and the data order end at the planned step).

Invariant: a resumed run's options differ from its checkpoint's only where a line on stderr
says so.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tiledmlp.config.patch import SAME_LOSSES
from tiledmlp.train.checkpoints import resolve_resume
from tiledmlp.train.options import TrainOptions, canonical_key, field_of, options_from, spelled

__all__ = ["PER_INVOCATION", "RUN_SETTINGS", "Resume", "given_of", "resume", "settings_record"]

RUN_SETTINGS = "tiledmlp_run.json"  # written by train/trainer.py into each checkpoint-N
# options that belong to one command, not to the run it continues
PER_INVOCATION = frozenset({
    "resume_from_checkpoint", "output_dir", "ddp_timeout", "engine", "deepspeed", "fsdp",
    "fsdp_config", "max_steps", "preflight", "memory_gb", "gpu",
})  # fmt: skip
# what the run saves and logs: kept from the checkpoint, changed (and said) where given again
_SAVING = frozenset({"save_steps", "save_total_limit", "logging_steps", "report_to"})
# saving needs somewhere to save: without --output-dir a resume saves no checkpoints
_NEEDS_OUTPUT = ("save_steps", "save_total_limit")
# fields (of TrainOptions and of its PatchConfig, whose schema marks them) that change memory
# and speed, not the losses: applied with a note when they differ
_SAFE = frozenset({"gradient_checkpointing", "every_n_layers", *SAME_LOSSES})
# a field's flag where the two differ
_FLAGS = {"tiles": "--num-tiles", "tiled_mlp": "--use-tiled-mlp", "patch": "the tiling options"}


@dataclasses.dataclass(frozen=True)
class Resume:
    """The checkpoint (None: not resuming), the options to build the run with (the planned
    --max-steps), and the step to stop at when it is earlier than planned."""

    checkpoint: Path | None
    build: TrainOptions
    stop_at: int | None


def given_of(opts: TrainOptions) -> dict[str, Any]:
    """The options of `opts` that differ from the defaults (what a keyword-API caller gave);
    the nested patch configuration is left out (a resume may change only what it changes
    without changing the losses, and says so)."""
    defaults = TrainOptions()
    return {
        f.name: _jsonable(getattr(opts, f.name))
        for f in dataclasses.fields(TrainOptions)
        if getattr(opts, f.name) != getattr(defaults, f.name)
        and not dataclasses.is_dataclass(getattr(opts, f.name))
    }


def settings_record(settings: TrainOptions | Mapping[str, Any], max_steps: int) -> dict[str, Any]:
    """What a checkpoint stores about its run: its options (a TrainOptions, or keys that
    options_from reads into one), every one by its main key but the per-invocation ones, and
    the number of steps it was planned for."""
    opts = settings if isinstance(settings, TrainOptions) else options_from(settings)
    options = {k: _jsonable(v) for k, v in spelled(opts).items() if k not in PER_INVOCATION}
    return {"format": 2, "options": options, "max_steps": max_steps}


def resume(
    opts: TrainOptions, given: Mapping[str, Any], say: Callable[[str], None]
) -> tuple[Resume, TrainOptions]:
    """(how to resume, the run's settings: the checkpoint's options with this command's over
    them) for `opts`; refuses, before any work, what cannot continue the checkpoint's run
    (module docstring)."""
    checkpoint = _checkpoint(opts, say)
    if checkpoint is None:
        return Resume(None, opts, None), opts
    record = _read_record(checkpoint)
    if record is None:
        say(
            f"{checkpoint} records no run settings (saved by an older tiledmlp): resuming with "
            "the options of this command"
        )
        merged = opts
    else:
        merged = _merged(opts, given, record, checkpoint, say)
    settings = merged
    planned = _planned_steps(checkpoint, record)
    if planned is None:
        return Resume(checkpoint, merged, None), settings
    explicit = any(canonical_key(k) == "max_steps" for k in given)
    if not explicit:
        merged = dataclasses.replace(merged, max_steps=planned)
        return Resume(checkpoint, merged, None), settings
    if merged.max_steps > planned:
        raise ValueError(
            f"--resume-from-checkpoint {checkpoint}: that run was planned for --max-steps "
            f"{planned}, this one asks for {merged.max_steps}; a resumed run continues the same "
            f"learning-rate schedule and data order, which end at step {planned}. Resume with "
            f"--max-steps {planned} (or fewer), or train the saved model further with a new "
            f"schedule: --model {checkpoint} --max-steps N (the optimizer state starts afresh)"
        )
    if merged.max_steps < planned:
        say(
            f"--max-steps {merged.max_steps}: stopping at step {merged.max_steps} of the "
            f"{planned} the run was planned for (its schedule is kept)"
        )
        build = dataclasses.replace(merged, max_steps=planned)
        return Resume(checkpoint, build, merged.max_steps), settings
    return Resume(checkpoint, merged, None), settings


def _checkpoint(opts: TrainOptions, say: Callable[[str], None]) -> Path | None:
    """The checkpoint --resume-from-checkpoint names ('latest': the newest complete
    OUTPUT_DIR/checkpoint-N, with a note for each one skipped), or None when not resuming."""
    if opts.resume_from_checkpoint is None:
        return None
    out = Path(opts.output_dir) if opts.output_dir is not None else Path(".")
    found = resolve_resume(opts.resume_from_checkpoint, out, say)
    if found is None:
        raise ValueError(f"--resume-from-checkpoint latest: no complete checkpoint-N in {out}")
    return found


def _read_record(checkpoint: Path) -> dict[str, Any] | None:
    path = checkpoint / RUN_SETTINGS
    if not path.is_file():
        return None
    record = json.loads(path.read_text())  # checked whole by check_checkpoint
    if not isinstance(record, dict) or not isinstance(record.get("options"), dict):
        raise ValueError(f"--resume-from-checkpoint: {path} is not a run-settings record")
    return record


def _planned_steps(checkpoint: Path, record: dict[str, Any] | None) -> int | None:
    if record is not None and record.get("max_steps"):
        return int(record["max_steps"])
    state = checkpoint / "trainer_state.json"
    planned = json.loads(state.read_text()).get("max_steps") if state.is_file() else None
    return int(planned) if planned else None


def _merged(
    opts: TrainOptions,
    given: Mapping[str, Any],
    record: dict[str, Any],
    checkpoint: Path,
    say: Callable[[str], None],
) -> TrainOptions:
    """The checkpoint's options with this command's given ones over them; refuses a given
    option that changes the run's math, says each one that changes only memory or speed."""
    recorded = dict(record["options"])
    now = {canonical_key(k): v for k, v in given.items()}
    if now.get("output_dir") is None:
        for key in _NEEDS_OUTPUT:
            if recorded.pop(key, None) is not None and key == "save_steps":
                say(
                    f"--save-steps {record['options'][key]} of the run not kept: this command has "
                    "no --output-dir to save checkpoints into"
                )
    per_invocation = {k: v for k, v in now.items() if k in PER_INVOCATION}
    original = options_from({**recorded, **per_invocation})
    fields_now = {field_of(k) for k in now}  # a field given again, in whatever spelling
    merged_values = {k: v for k, v in recorded.items() if field_of(k) not in fields_now}
    merged_values.update(now)
    try:
        merged = options_from(merged_values)
    except ValueError as e:
        raise ValueError(
            f"--resume-from-checkpoint {checkpoint}: this command's options do not combine "
            f"with the run's settings ({e}); drop the options the run already has"
        ) from None
    for name, before, after in _differences(original, merged):
        last = name.split(".")[-1]
        flag = _FLAGS.get(last, f"--{last.replace('_', '-')}")
        if last in _SAVING:
            say(
                f"{flag} {_shown(after, last, merged)}: applied on resume (the run had "
                f"{_shown(before, last, original)}); it changes what is saved and logged, "
                "not the losses"
            )
            continue
        if last in _SAFE or (last == "patch" and _same_parallelism(before, after)):
            say(
                f"{flag} {_shown(after, last, merged)}: applied on resume (the run had "
                f"{_shown(before, last, original)}); "
                "it changes memory and speed, not the losses"
            )
            continue
        raise ValueError(
            f"--resume-from-checkpoint {checkpoint}: the run used {flag} "
            f"{_shown(before, last, original)}, this command gives {_shown(after, last, merged)}; "
            f"a resume continues the same run: drop {flag}, or "
            f"start a new run from the saved model with --model {checkpoint}"
        )
    return merged


def _same_parallelism(a: Any, b: Any) -> bool:
    """Whether two patch configurations (or None) split sequences over the same ranks."""
    return (getattr(a, "sequence_parallel_size", None) or 1) == (
        getattr(b, "sequence_parallel_size", None) or 1
    )


def _differences(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(field path, a's value, b's value) for each field of two equal-typed dataclasses that
    differs, nested dataclasses field by field; per-invocation fields are left out."""
    out: list[tuple[str, Any, Any]] = []
    for f in dataclasses.fields(a):
        if not prefix and f.name in PER_INVOCATION:
            continue
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x == y:
            continue
        nested = not prefix and dataclasses.is_dataclass(x) and type(x) is type(y)
        if nested:  # the run's PatchConfig, field by field (a tile policy is one value)
            out.extend(_differences(x, y, f"{prefix}{f.name}."))
        else:
            out.append((f"{prefix}{f.name}", x, y))
    return out


# What an option left unset means, where that is not a value of its own (learning_rate: below).
_UNSET = {
    "data": "(the Python standard library's source)",
    "data_field": "(text, else messages)",
    "output_dir": "(none)",
    "save_steps": "never",
    "save_total_limit": "(all kept)",
}


def _shown(value: Any, name: str = "", opts: TrainOptions | None = None) -> str:
    """An option's value as the refusal or the note says it: an unset option by what it means
    (the learning rate the run used by default, "(none)", ...), never "not set"."""
    if value is None and name == "learning_rate" and opts is not None:
        return f"{_default_learning_rate(opts):g} (the default for {opts.model})"
    if value is None:
        return _UNSET.get(name, "(the default)")
    if hasattr(value, "num_tiles") and hasattr(value, "tile_tokens"):  # a TilePolicy
        return str(value.num_tiles if value.num_tiles is not None else value.tile_tokens)
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _default_learning_rate(opts: TrainOptions) -> float:
    """The learning rate a run of `opts` uses when none is given (models/presets.py's rule)."""
    from tiledmlp.models.presets import PRESETS, default_learning_rate

    if opts.model in PRESETS:
        hidden = int(PRESETS[opts.model]["hidden_size"])
    elif opts.model.endswith(".json"):
        try:
            hidden = int(json.loads(Path(opts.model).read_text())["hidden_size"])
        except (OSError, ValueError, KeyError, TypeError):
            hidden = 256
    else:
        hidden = 1  # a saved model fine-tunes at one rate whatever its width
    return default_learning_rate(opts.model, hidden)


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return str(value)
