"""plan/sim/caching_allocator.py against the card: the CUDA caching allocator's own traces of whole
steps on an H100 (benchmarks/results/gpu/*/trace/*.json.gz, benchmarks/allocator_trace.py),
replayed request by request, take exactly the segments the card took, after the build, the
warm-up step and the step, with and without expandable segments."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from tiledmlp.plan.sim.caching_allocator import CachingAllocator, round_size

RECORDS = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "gpu"
TRACES = sorted(RECORDS.glob("*/trace/*.json.gz"))
TAKEN = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def _load(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def test_the_traces_are_committed() -> None:
    names = {(p.parent.parent.name, p.name) for p in TRACES}
    assert ("2026-11-26T0933-h100", "tiled_mlp_loss-131072-False.json.gz") in names
    assert ("2026-11-26T0933-h100", "tiled_mlp_loss_offload_norms-32768-True.json.gz") in names
    assert ("2026-11-26T1000-h100", "tiled_mlp_loss-131072-False.json.gz") in names


@pytest.mark.parametrize("path", TRACES, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_the_replay_takes_the_segments_the_card_took(path: Path) -> None:
    trace = _load(path)
    expandable = "expandable_segments:true" in trace["cuda_alloc_conf"].replace(" ", "").lower()
    alloc = CachingAllocator(expandable)
    card = 0
    ends = {n: name for name, n in trace["phases"].items()}
    released = False
    seen = {}
    rounded: dict[int, int] = {}  # address -> bytes as max_memory_allocated counts them
    live = peak = 0
    for i, (action, addr, size, stream, _frame) in enumerate(trace["events"], 1):
        assert stream == trace["events"][0][3], "one stream"
        if action == "alloc":
            alloc.malloc(addr, size)
            rounded[addr] = round_size(size)
            live += rounded[addr]
            peak = max(peak, live)
        elif action == "free_completed":
            alloc.free(addr)
            live -= rounded.pop(addr)
        elif action in TAKEN:
            card += TAKEN[action] * size
            if action == "segment_free" and not released:
                # empty_cache (patch_model's probes given back): every unused segment at once
                alloc.release_unused()
                released = True
        if i in ends:
            seen[ends[i]] = (alloc.reserved, card)
    assert set(seen) == {"build", "warmup", "step"}
    for phase, (replayed, taken) in seen.items():
        assert replayed == taken, f"after {phase}: replayed {replayed:,} bytes, card {taken:,}"
    assert alloc.reserved == trace["max_memory_reserved"]
    assert peak == trace["max_memory_allocated"]


def test_the_step_after_the_probes_gave_back_their_segments_reserves_less() -> None:
    """Without expandable segments, 128K tokens of the tiled loss: the probes' segments cost
    1,340 MiB of reserve (patching/probe_cache.py); the step's tensors are the same."""
    before = _load(RECORDS / "2026-11-26T0933-h100/trace/tiled_mlp_loss-131072-False.json.gz")
    after = _load(RECORDS / "2026-11-26T1000-h100/trace/tiled_mlp_loss-131072-False.json.gz")
    assert before["max_memory_allocated"] == after["max_memory_allocated"]
    saved = before["max_memory_reserved"] - after["max_memory_reserved"]
    assert saved == 1340 * 2**20
