"""The planner against every whole-step GPU record committed under benchmarks/results/gpu/.

For each record the planner's figure on the card (tensor peak plus device overhead, under the
allocator setting the record was measured with) must be within 10% of the measured
max_memory_reserved plus the memory outside the allocator, and never more than 3% below it
(a plan that is optimistic on the card fails with out-of-memory where it promised a fit).

Records where the planner is known to be outside those bounds are listed in KNOWN_GAPS with
what is missing; they run as strict expected failures, so a fix that brings one within bounds
fails here until its entry is removed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tiledmlp.plan.layer import load_config
from tiledmlp.plan.model import plan_model

RECORDS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu"
MiB = 2**20

# (record folder, seq_len, stack) -> what the planner does not yet see on the card
KNOWN_GAPS = {
    ("2026-11-25-h100", 32768, "tiled_mlp_loss"): (
        "pessimistic (1.12): the allocator replayed on the step's trace reserves 1,837 MiB "
        "beyond the peak where the card reserved 1,051; the attention backward's 772 MiB are "
        "added at a peak the card allocated only 64 MiB beyond the planned tensors"
    ),
    # The next three were measured in one process after earlier patched models whose weights
    # (3,668 MiB each in bf16) were still allocated: a patched forward held its module strongly,
    # so a dropped model waited for Python's cycle collector. Fixed since (patching/bound.py
    # holds the module weakly; tests/patching/test_tiled_layers.py::
    # test_a_dropped_patched_model_frees_its_tensors_at_once). The records cannot separate the
    # step's own allocation from the held weights: planned tensor peak + 1, 2 and 2 held models
    # is 18,980, 17,055 and 36,489 MiB against 19,044, 17,051 and 36,553 allocated.
    ("2026-11-25-h100", 131072, "tiled_mlp_loss"): (
        "optimistic by the weights of two earlier models still allocated in the measuring process"
    ),
    ("2026-11-25-h100", 32768, "tiled_layer"): (
        "optimistic by the weights of two earlier models still allocated in the measuring process"
    ),
    ("2026-11-25-h100", 131072, "tiled_layer"): (
        "optimistic by the weights of one earlier model still allocated in the measuring process"
    ),
}
SLOW_STACKS = {"tiled_layer"}  # minutes of fake steps on 2 cores at these lengths


def _records() -> list[Any]:
    params = []
    for path in sorted(RECORDS.glob("*/whole_steps.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            key = (path.parent.name, rec["seq_len"], rec["stack"])
            marks = []
            if key in KNOWN_GAPS:
                marks.append(pytest.mark.xfail(reason=KNOWN_GAPS[key], strict=True))
            if rec["stack"] in SLOW_STACKS:
                marks.append(pytest.mark.slow)
            params.append(pytest.param(rec, id="-".join(map(str, key)), marks=marks))
    return params


def _config(rec: dict[str, Any]) -> Any:
    """The record's model: a Llama-3-8B shape cut to the record's layers (the records name
    hidden, intermediate and vocabulary; their README the 32/8 heads, rope and untied head)."""
    config = load_config("llama3-8b")
    shape = (config.hidden_size, config.intermediate_size, config.vocab_size)
    assert shape == (rec["hidden"], rec["intermediate"], rec["vocab"]), (
        f"record shape {rec['hidden'], rec['intermediate'], rec['vocab']} is not the preset's"
    )
    config.num_hidden_layers = rec["layers"]
    return config


def _expandable(rec: dict[str, Any]) -> bool:
    """The allocator setting a record was measured with: its "cuda_alloc_conf" (the suite
    writes PYTORCH_CUDA_ALLOC_CONF's value); the 2026-11-25 records predate the field and were
    measured without expandable segments."""
    conf = rec.get("cuda_alloc_conf") or ""
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def test_records_are_committed() -> None:
    assert _records(), f"no whole_steps.jsonl under {RECORDS}"


@pytest.mark.parametrize("rec", _records())
def test_plan_agrees_with_the_card(rec: dict[str, Any]) -> None:
    if "error" in rec or rec.get("max_memory_reserved_mib") is None:
        pytest.skip(f"not a completed step on a GPU: {rec.get('error', 'no device figures')}")
    expandable = _expandable(rec)
    plan = plan_model(
        _config(rec),
        seq_len=rec["seq_len"],
        dtype=getattr(torch, rec["dtype"]),
        checkpointing=rec["gradient_checkpointing"],
        stacks=(rec["stack"],),
        expandable_segments=expandable,
    )[rec["stack"]]
    card = rec["max_memory_reserved_mib"] + rec["outside_allocator_mib"]
    ratio = plan["per_gpu_mib"] / card
    detail = (
        f"planned {plan['per_gpu_mib']:,.0f} MiB on the card (tensors {plan['peak_mib']:,.0f}, "
        f"overhead {plan['device_overhead_breakdown_mib']}) against {card:,.0f} measured: "
        f"ratio {ratio:.3f}"
    )
    assert 0.97 <= ratio <= 1.10, detail
