"""Whole steps several in a row in one process (bench/whole_step.py): each job starts from an
empty slate (the previous model is gone), and an out-of-memory job is recorded and the next
runs."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from tiledmlp.bench import whole_step
from tiledmlp.bench.whole_step import StepJob, measure_whole_steps

TINY = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 64,
}


def _models_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o).__name__ == "LlamaForCausalLM")


def test_each_job_starts_with_nothing_of_the_previous_one_alive() -> None:
    before = _models_alive()
    jobs = [
        StepJob(config=TINY, seq_len=32, stack=s, dtype="float32", device="cpu", steps=1)
        for s in ("untiled", "tiled_mlp")
    ]
    seen = []
    for record in measure_whole_steps(jobs):
        assert _models_alive() == before, "a measured model is still alive"
        seen.append((record["stack"], record["time_ms"] > 0, "error" in record))
    assert seen == [("untiled", True, False), ("tiled_mlp", True, False)]


def test_an_out_of_memory_job_is_recorded_and_the_next_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def fake(job: StepJob) -> dict[str, Any]:
        if job.stack == "untiled":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        return {"seq_len": job.seq_len, "stack": job.stack, "time_ms": 1.0}

    monkeypatch.setattr(whole_step, "measure_whole_step", fake)
    jobs = [StepJob(stack=s, device="cpu") for s in ("untiled", "tiled_layer")]
    got = list(measure_whole_steps(jobs))
    assert got[0]["error"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert got[1] == {"seq_len": 1024, "stack": "tiled_layer", "time_ms": 1.0}
