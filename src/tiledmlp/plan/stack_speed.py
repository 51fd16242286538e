"""The stacks' measured step times, to name the fastest stack that fits.

One source for every stack: the committed H100 records of one run (the `model_steps` part of
`python -m benchmarks.suite`), a Llama-3-8B-shaped model cut to 4 layers, bf16, the
model's checkpointing, batch 1 of 32,768 tokens, one timed step after a warm-up; the only
length at which all six stacks were measured in one run. tests/plan/test_stack_speed.py checks
these figures against the records file.

Invariant: a figure here is a measured record's `time_ms`, never an estimate; a stack without
one is not ranked.
"""

from __future__ import annotations

__all__ = ["SOURCE", "SOURCE_TEXT", "STEP_MS", "fastest", "time_ratio"]

# the records file, relative to the repository's root
SOURCE = "benchmarks/results/gpu/2026-11-26T0933-h100/suite/records.jsonl"
SOURCE_TEXT = "an H100, Llama-3-8B shape cut to 4 layers, bf16, 32,768 tokens"
# stack -> the step's time in ms (the records' `time_ms`, part model_steps, seq_len 32768)
STEP_MS: dict[str, float] = {
    "untiled": 946.73,
    "tiled_mlp": 952.28,
    "tiled_mlp_loss": 937.74,
    "tiled_mlp_loss_offload": 947.38,
    "tiled_mlp_loss_offload_norms": 968.06,
    "tiled_layer": 1039.1,
}


def time_ratio(stack: str) -> float:
    """The stack's measured step time over the untiled step's."""
    return STEP_MS[stack] / STEP_MS["untiled"]


def fastest(stacks: list[str]) -> str | None:
    """The measured-fastest of `stacks` (None when none was measured)."""
    timed = [s for s in stacks if s in STEP_MS]
    return min(timed, key=lambda s: STEP_MS[s]) if timed else None
