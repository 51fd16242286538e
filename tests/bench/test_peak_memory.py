"""Naming each byte at the device peak (bench/peak_memory.py), on a snapshot built by hand in
the format torch.cuda.memory._snapshot() documents (segments with blocks and frames;
device_traces of alloc / free_requested / free_completed entries)."""

from __future__ import annotations

from typing import Any

from tiledmlp.bench.peak_memory import TensorAddresses, categorise_peak, peak_allocations

MiB = 2**20
TORCH = "/env/lib/python3.12/site-packages/torch"
HF = "/env/lib/python3.12/site-packages/transformers"


def frame(filename: str, name: str, line: int = 1) -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


LAYER = frame(f"{HF}/models/llama/modeling_llama.py", "forward", 300)
CHECKPOINT = frame(f"{TORCH}/utils/checkpoint.py", "checkpoint", 480)
UNPACK = frame(f"{TORCH}/utils/checkpoint.py", "unpack_hook", 1100)
RECOMPUTE = frame(f"{TORCH}/utils/checkpoint.py", "recompute_fn", 1050)
LOSS = frame("/src/tiledmlp/ops/loss/cross_entropy.py", "forward", 120)
SDPA = frame(f"{HF}/integrations/sdpa_attention.py", "sdpa_attention_forward", 90)
LINEAR = frame(f"{TORCH}/nn/functional.py", "linear", 10)
TILE = frame("/src/tiledmlp/ops/mlp/fast.py", "forward", 42)
OFFLOAD = frame("/src/tiledmlp/ops/offloading/saved_inputs.py", "_unpack", 77)
WRAPPER = frame("/src/tiledmlp/patching/offloading.py", "__call__", 66)  # offloading's checkpoint


def alloc(addr: int, mib: float, *frames: dict[str, Any]) -> dict[str, Any]:
    return {"action": "alloc", "addr": addr, "size": int(mib * MiB), "stream": 0,
            "frames": list(frames)}  # fmt: skip


def free(addr: int, mib: float) -> list[dict[str, Any]]:
    size = int(mib * MiB)
    return [
        {"action": "free_requested", "addr": addr, "size": size, "stream": 0, "frames": []},
        {"action": "free_completed", "addr": addr, "size": size, "stream": 0, "frames": []},
    ]


def snapshot() -> dict[str, Any]:
    weights, old_buffer = 0x1000_0000, 0x1800_0000
    trace = [
        alloc(0x2000_0000, 1, LAYER, CHECKPOINT),  # a layer's output, saved for the next layer
        alloc(0x2100_0000, 1, LAYER, CHECKPOINT, WRAPPER),  # the same under offloading's wrapper
        *free(old_buffer, 1),  # allocated before recording, freed before the peak
        alloc(0x3000_0000, 1, LINEAR, LAYER, RECOMPUTE, UNPACK),  # the layer's recompute
        alloc(0x4000_0000, 3, LOSS),  # the loss tile
        alloc(0x5000_0000, 4),  # a gradient (the autograd engine: no Python frame)
        alloc(0x6000_0000, 0.5, SDPA, LAYER, RECOMPUTE, UNPACK),  # attention, in a recompute
        alloc(0x7000_0000, 0.5, LINEAR, TILE, LAYER),  # a tiled MLP's buffer
        alloc(0x7800_0000, 1, OFFLOAD, UNPACK),  # offloading's copy back to the device
        alloc(0x7C00_0000, 1.5, LINEAR, TILE),  # freed after the peak, its address reused
        # the peak: 4 (weights) + 2 + 1 + 3 + 4 + 0.5 + 0.5 + 1 + 1.5 = 17.5 MiB
        *free(0x4000_0000, 3),
        *free(0x7C00_0000, 1.5),
        alloc(0x7C00_0000, 1.5),  # later a gradient at the same address
        alloc(0x4000_0000, 2, LOSS),  # after the peak: not counted
    ]
    blocks = [
        {
            "address": weights,
            "size": 4 * MiB,
            "requested_size": 4 * MiB,
            "state": "active_allocated",
            "frames": [],
        },
        {
            "address": old_buffer,
            "size": MiB,
            "requested_size": MiB,
            "state": "inactive",
            "frames": [],
        },
    ]
    segment = {"device": 0, "address": weights, "total_size": 64 * MiB, "stream": 0,
               "segment_type": "large", "allocated_size": 4 * MiB, "active_size": 4 * MiB,
               "blocks": blocks}  # fmt: skip
    return {"segments": [segment], "device_traces": [trace]}


KNOWN = TensorAddresses(
    {
        "weights": [(0x1000_0000, 0x1000_0000 + 4 * MiB)],
        "gradients": [(0x5000_0000, 0x5000_0000 + 4 * MiB), (0x7C00_0000, 0x7C00_0000 + MiB)],
    }
)


def test_the_peak_is_found_by_replaying_the_trace() -> None:
    peak, alive = peak_allocations(snapshot())
    assert peak == 17.5 * MiB
    assert sum(a.size for a in alive) == peak
    assert {a.addr for a in alive if a.before_recording} == {0x1000_0000}
    assert {a.addr for a in alive if a.freed_after_peak} == {0x4000_0000, 0x7C00_0000}


def test_every_byte_at_the_peak_is_named() -> None:
    got = categorise_peak(snapshot(), KNOWN)
    assert got["peak_mib"] == 17.5
    assert got["categories_mib"] == {
        "weights": 4.0,
        "gradients": 4.0,
        "loss tile": 3.0,
        "checkpointed layer inputs": 2.0,
        "other: ops/mlp/fast.py:42 forward": 2.0,
        "current layer's recompute": 1.0,
        "offloading device buffers": 1.0,
        "attention kernel buffers": 0.5,
    }
    assert sum(got["categories_mib"].values()) == got["peak_mib"]


def test_without_known_tensors_the_frames_and_the_history_name_them() -> None:
    got = categorise_peak(snapshot(), None)["categories_mib"]
    assert got["before recording"] == 4.0
    assert got["other: no Python frame"] == 4.0


def test_small_frames_beyond_the_top_ones_are_summed() -> None:
    got = categorise_peak(snapshot(), KNOWN, top_other=0)["categories_mib"]
    assert got["other: remaining frames"] == 2.0
    assert not any(k.startswith("other: ops/") for k in got)


def test_an_empty_history_has_only_what_was_alive_before() -> None:
    snap = snapshot()
    snap["device_traces"] = [[]]
    got = categorise_peak(snap, KNOWN)
    assert got == {"peak_mib": 4.0, "categories_mib": {"weights": 4.0}}


def test_a_trace_with_completed_frees_only_gives_the_same_peak() -> None:
    snap = snapshot()
    trace = snap["device_traces"][0]
    snap["device_traces"] = [[e for e in trace if e["action"] != "free_requested"]]
    assert categorise_peak(snap, KNOWN) == categorise_peak(snapshot(), KNOWN)
