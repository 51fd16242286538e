"""The planner against every whole-step GPU record committed under benchmarks/results/gpu/.

For each record the planner's figure on the card (tensor peak plus device overhead, under the
allocator setting the record was measured with) must be within 10% of the measured
max_memory_reserved plus the memory outside the allocator, and never more than 3% below it
(a plan that is optimistic on the card fails with out-of-memory where it promised a fit).

Whole-step records: each folder's whole_steps.jsonl; its suite/records.jsonl, parts
"model_steps" and "allocator" (the same step under both allocator settings); its
long-step/step.jsonl, whose model is long-step/config.json's.

Records where the planner is known to be outside those bounds are listed in KNOWN_GAPS with
what is missing; they run as strict expected failures, so a fix that brings one within bounds
fails here until its entry is removed. Records whose measured memory outside the allocator
counts more than the step's process are listed in CONTAMINATED_OUTSIDE; they are compared with
the largest outside figure of their folder's other records instead.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tiledmlp.config.plan import StepSpec
from tiledmlp.plan.layer import load_config
from tiledmlp.plan.model import plan_model

RECORDS = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "gpu"
MiB = 2**20
H100, H200, H200_2 = "2026-11-25-h100", "2026-11-26-h200", "2026-11-26T0339-h200"
H100_2, H100_3 = "2026-11-26T0933-h100", "2026-11-26T1000-h100"

# (record folder, part, seq_len, stack, allocator) -> what the planner does not yet see on the
# card; allocator: "expandable" (expandable_segments:True) or "fixed" (without them)
KNOWN_GAPS = {
    # The next three were measured in one process after earlier patched models whose weights
    # (3,668 MiB each in bf16) were still allocated: a patched forward held its module strongly,
    # so a dropped model waited for Python's cycle collector. Fixed since (patching/bound.py
    # holds the module weakly; tests/patching/features/tiled_layers/test_tiled_layers.py::
    # test_a_dropped_patched_model_frees_its_tensors_at_once). The records cannot separate the
    # step's own allocation from the held weights: planned tensor peak + 1, 2 and 2 held models
    # is 18,980, 16,987 and 36,489 MiB against 19,044, 17,051 and 36,553 allocated.
    (H100, "whole_steps", 131072, "tiled_mlp_loss", "fixed"): (
        "optimistic by the weights of two earlier models still allocated in the measuring process"
    ),
    (H100, "whole_steps", 32768, "tiled_layer", "fixed"): (
        "optimistic by the weights of two earlier models still allocated in the measuring process"
    ),
    (H100, "whole_steps", 131072, "tiled_layer", "fixed"): (
        "optimistic by the weights of one earlier model still allocated in the measuring process"
    ),
    # The next three were measured before patch_model gave back the segments its probes made
    # the caching allocator take (patching/probe_cache.py). Without expandable segments those
    # segments, cut into blocks of the probes' sizes, cost the step 1,340 MiB of reserve: the
    # allocator's trace of that step (H100_2's trace/), replayed with and without them
    # (tests/plan/sim/test_allocator_traces.py). The same step measured since reserves 34,684 MiB
    # where these reserved 36,002-36,024 (H100_3), and is within bounds.
    (H200, "allocator", 131072, "tiled_mlp_loss", "fixed"): (
        "optimistic (0.965): measured with patch_model's probe segments still cached"
    ),
    (H200_2, "allocator", 131072, "tiled_mlp_loss", "fixed"): (
        "optimistic (0.966): measured with patch_model's probe segments still cached"
    ),
    (H100_2, "allocator", 131072, "tiled_mlp_loss", "fixed"): (
        "optimistic (0.966): measured with patch_model's probe segments still cached"
    ),
}

# outside_allocator_mib is the device's used memory (torch.cuda.mem_get_info) less the
# allocator's reservation: these steps ran in the suite's process after parts that left memory
# cached in it, so their figure (24,094, 24,168, 6,648 and 6,564 MiB) counts that too. Every
# other record of the folder measured 767 to 849 MiB. H100_2's untiled step at 32K, the first
# of its process, counted 3,657 MiB, where the next step of the same process and length
# (tiled_mlp, the same model and CUDA context) counted 763: memory that another process took
# during the step, after this one had measured the others' use (4 MiB).
CONTAMINATED_OUTSIDE = {
    (H200, "model_steps", 65536, "tiled_mlp_loss", "expandable"),
    (H200, "model_steps", 65536, "tiled_layer", "expandable"),
    (H200, "model_steps", 262144, "tiled_layer", "expandable"),
    (H200, "allocator", 131072, "tiled_mlp_loss", "expandable"),
    (H200, "allocator", 131072, "tiled_mlp_loss", "fixed"),
    (H100_2, "model_steps", 32768, "untiled", "expandable"),
}
SLOW_STACKS = {"tiled_layer"}  # minutes of fake steps on 2 cores at these lengths
SLOW_TOKENS = 131072  # and any step from this length on


def _allocator(rec: dict[str, Any]) -> str:
    """The allocator setting a record was measured with: its "alloc_conf" (the suite's allocator
    part) or "cuda_alloc_conf" (PYTORCH_CUDA_ALLOC_CONF's value); the 2026-11-25 records predate
    both fields and were measured without expandable segments."""
    conf = rec.get("alloc_conf") or rec.get("cuda_alloc_conf") or ""
    on = "expandable_segments:true" in conf.replace(" ", "").lower()
    return "expandable" if on else "fixed"


def _whole_steps() -> list[tuple[str, str, dict[str, Any]]]:
    """(folder, part, record) of every completed whole step on a GPU."""
    found = []
    for path in sorted(RECORDS.glob("*/whole_steps.jsonl")):
        found += [(path.parent.name, "whole_steps", json.loads(x)) for x in _lines(path)]
    for path in sorted(RECORDS.glob("*/suite/records.jsonl")):
        for line in _lines(path):
            rec = json.loads(line)
            if rec.get("part") in ("model_steps", "allocator") and rec.get("status") == "ok":
                found.append((path.parent.parent.name, rec["part"], rec))
    for path in sorted(RECORDS.glob("*/long-step/step.jsonl")):
        found += [(path.parent.parent.name, "long-step", json.loads(x)) for x in _lines(path)]
    for path in sorted(RECORDS.glob("*/plan-measure-steps.jsonl")):  # plan --measure's steps
        found += [(path.parent.name, "plan-measure", json.loads(x)) for x in _lines(path)]
    return [(f, part, r) for f, part, r in found if r.get("max_memory_reserved_mib") is not None]


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


def _key(folder: str, part: str, rec: dict[str, Any]) -> tuple[str, str, int, str, str]:
    return (folder, part, rec["seq_len"], rec["stack"], _allocator(rec))


def _outside(folder: str, part: str, rec: dict[str, Any]) -> float:
    """The record's memory outside the allocator, or for a CONTAMINATED_OUTSIDE record the
    largest of its folder's other records'."""
    if _key(folder, part, rec) not in CONTAMINATED_OUTSIDE:
        return float(rec["outside_allocator_mib"])
    return max(
        r["outside_allocator_mib"]
        for f, p, r in _whole_steps()
        if f == folder and _key(f, p, r) not in CONTAMINATED_OUTSIDE
    )


def _records() -> list[Any]:
    params = []
    for folder, part, rec in _whole_steps():
        key = _key(folder, part, rec)
        marks = []
        if key in KNOWN_GAPS:
            marks.append(pytest.mark.xfail(reason=KNOWN_GAPS[key], strict=True))
        if rec["stack"] in SLOW_STACKS or rec["seq_len"] >= SLOW_TOKENS:
            marks.append(pytest.mark.slow)
        params.append(pytest.param(folder, part, rec, id="-".join(map(str, key)), marks=marks))
    return params


def _config(folder: str, part: str, rec: dict[str, Any]) -> Any:
    """The record's model: a Llama-3-8B shape cut to the record's layers (the records name
    hidden, intermediate and vocabulary; their README the 32/8 heads, rope and untied head; a
    long step's config.json all of them)."""
    config = load_config("llama3-8b")
    shape = (config.hidden_size, config.intermediate_size, config.vocab_size)
    assert shape == (rec["hidden"], rec["intermediate"], rec["vocab"]), (
        f"record shape {rec['hidden'], rec['intermediate'], rec['vocab']} is not the preset's"
    )
    if part == "long-step":
        saved = json.loads((RECORDS / folder / "long-step" / "config.json").read_text())
        for name in ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings"):
            assert saved[name] == getattr(config, name), f"{name}: {saved[name]}"
    config.num_hidden_layers = rec["layers"]
    return config


def test_records_are_committed() -> None:
    parts = {(folder, part) for folder, part, _ in _whole_steps()}
    assert (H100, "whole_steps") in parts, f"no whole_steps.jsonl under {RECORDS / H100}"
    for part in ("model_steps", "allocator", "long-step"):
        assert (H200, part) in parts, f"no {part} records under {RECORDS / H200}"
    for part in ("model_steps", "allocator", "plan-measure"):
        assert (H200_2, part) in parts, f"no {part} records under {RECORDS / H200_2}"
    for folder, part in ((H100_2, "model_steps"), (H100_2, "allocator"), (H100_3, "allocator")):
        assert (folder, part) in parts, f"no {part} records under {RECORDS / folder}"


def test_contaminated_records_are_the_ones_outside_the_others_range() -> None:
    """The table names exactly the records whose outside figure is far beyond a CUDA context's."""
    far = {_key(f, p, r) for f, p, r in _whole_steps() if r["outside_allocator_mib"] > 2048}
    assert far == CONTAMINATED_OUTSIDE


@functools.cache
def _plan(layers: int, seq_len: int, stack: str, dtype: str, checkpointing: bool,
          expandable: bool) -> dict[str, Any]:  # fmt: skip
    """The planner's entry for a record's step (the preset's shape cut to `layers`); several
    folders measured the same step, and a plan depends on nothing else, so each is planned
    once."""
    config = load_config("llama3-8b")
    config.num_hidden_layers = layers
    step = StepSpec(
        seq_len=seq_len,
        dtype=getattr(torch, dtype),
        checkpointing=checkpointing,
        expandable_segments=expandable,
    )
    return plan_model(config, step, stacks=(stack,))[stack]


@pytest.mark.parametrize(("folder", "part", "rec"), _records())
def test_plan_agrees_with_the_card(folder: str, part: str, rec: dict[str, Any]) -> None:
    config = _config(folder, part, rec)  # checks the record's shape against the preset's
    plan = _plan(config.num_hidden_layers, rec["seq_len"], rec["stack"],
                 rec["dtype"], rec["gradient_checkpointing"],
                 _allocator(rec) == "expandable")  # fmt: skip
    card = rec["max_memory_reserved_mib"] + _outside(folder, part, rec)
    # the cards had room: the blocks held for the offloader's copies were not taken back
    ratio = (plan["per_gpu_mib"] + plan.get("reclaimable_mib", 0.0)) / card
    detail = (
        f"planned {plan['per_gpu_mib']:,.0f} MiB on the card (tensors {plan['peak_mib']:,.0f}, "
        f"overhead {plan['device_overhead_breakdown_mib']}) against {card:,.0f} measured: "
        f"ratio {ratio:.3f}"
    )
    assert 0.97 <= ratio <= 1.10, detail
