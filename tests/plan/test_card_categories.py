"""The plan's figures in the categories the card reports (plan/model.py, _device_entry): what
goes through PyTorch's caching allocator is allocated ("peak_mib", max_memory_allocated), the
allocator's reserve on top is "reserved_mib" (max_memory_reserved), the device overhead is only
the reserve and what the allocator does not see; the card's total ("per_gpu_mib") is unchanged
by the move.

Against the committed GPU records that carry the plan made beside the measurement (the suite's
whole steps, benchmarks/results/gpu/*/suite/records.jsonl, of the newest H100 run): allocated
and reserved within 3% of the measured peaks, but for the steps named in GAPS.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from tiledmlp.config.plan import StepSpec
from tiledmlp.plan.model import plan_model

RECORDS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu"
RUN = "2026-11-26T0933-h100"  # the newest run whose records carry the plan beside each step
OFF = 0.03
_HELD = (
    "the blocks the offloader's side-stream copies still hold at the peak on a card with room "
    "(planned_reclaimable_mib), which the plan leaves out: a full card takes them back"
)
# (stack, seq_len, "allocated" | "reserved") -> why the record is off by more than 3%
GAPS = {
    ("tiled_mlp_loss_offload_norms", 32768, "allocated"): _HELD,  # 1.031
    ("tiled_mlp_loss_offload_norms", 131072, "allocated"): _HELD,  # 1.057
    ("tiled_mlp_loss_offload", 32768, "reserved"): _HELD,  # 1.038
    ("tiled_mlp_loss_offload_norms", 131072, "reserved"): _HELD,  # 1.063
    ("tiled_layer", 65536, "reserved"): _HELD,  # 1.036
}
_MOVED = ("attention_backward", "cublas_workspace")


def _config() -> Any:
    return transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=4096,
    )  # fmt: skip


def test_allocated_reserved_and_overhead_add_up_to_the_card_s_total() -> None:
    step = StepSpec(seq_len=1024, dtype=torch.bfloat16, optimizer="adamw")
    stacks = ("tiled_mlp_loss", "tiled_mlp_loss_offload_norms")
    for entry in plan_model(_config(), step, stacks=stacks).values():
        parts = entry["breakdown_mib"]
        assert set(_MOVED) <= set(parts)  # the allocator's own parts of the peak, on a GPU
        assert parts["cublas_workspace"] == pytest.approx(40.1, abs=0.05)
        overhead = entry["device_overhead_breakdown_mib"]
        assert set(overhead) == {"outside_allocator", "allocator"}
        assert entry["reserved_mib"] == pytest.approx(
            entry["peak_mib"] + overhead["allocator"], abs=0.15
        )
        assert entry["per_gpu_mib"] == pytest.approx(
            entry["peak_mib"] + entry["device_overhead_mib"], abs=0.15
        )
    cpu = plan_model(_config(), StepSpec(seq_len=1024, device_type="cpu"), stacks=stacks)
    for entry in cpu.values():  # nothing of a GPU's on the CPU
        assert not set(_MOVED) & set(entry["breakdown_mib"])
        assert entry["peak_mib"] == entry["per_gpu_mib"] == entry["reserved_mib"]


def _planned(rec: dict[str, Any]) -> tuple[float, float]:
    """(allocated, reserved) MiB of the plan a record carries, in the card's categories: a plan
    made before the move kept the attention buffers and workspaces in its device overhead."""
    overhead = rec["planned_device_overhead_breakdown_mib"]
    allocated = rec["planned_peak_mib"] + sum(overhead.get(k, 0.0) for k in _MOVED)
    return allocated, allocated + overhead["allocator"]


def _steps() -> list[Any]:
    out = []
    for line in (RECORDS / RUN / "suite" / "records.jsonl").read_text().splitlines():
        rec = json.loads(line) if line.startswith("{") else {}
        if rec.get("part") == "model_steps" and rec.get("status") == "ok":
            out.append(pytest.param(rec, id=f"{rec['stack']}-{rec['seq_len']}"))
    return out


@pytest.mark.parametrize("rec", _steps())
def test_a_record_s_allocated_and_reserved_peaks_are_the_plan_s(rec: dict[str, Any]) -> None:
    allocated, reserved = _planned(rec)
    for what, measured, planned in (
        ("allocated", rec["max_memory_allocated_mib"], allocated),
        ("reserved", rec["max_memory_reserved_mib"], reserved),
    ):
        ratio = measured / planned
        gap = GAPS.get((rec["stack"], rec["seq_len"], what))
        if gap is None:
            assert abs(ratio - 1) <= OFF, (what, round(ratio, 3))
        else:  # a known gap stays one: a fix that closes it removes its entry
            assert abs(ratio - 1) > OFF, (what, round(ratio, 3), "close: drop it from GAPS")
