"""The measurement suite's time budget: what each piece of work is expected to take, from the
sizes, and the corrections the committed GPU records give.

Cost model (seconds), per piece of work the suite may run or skip:
- a fresh Python process with torch and transformers imported: `Machine.process_s`;
- a whole training step of a Llama-shaped model, checkpointed (bench/whole_step.py):
  FLOPs = 8 P S (forward 2 P S, backward 4 P S, the checkpointed layers' recompute 2 P S; P the
  decoder layers' parameters, S tokens) + 9 L S^2 h_attn (causal attention: forward 2 S^2 h_attn
  per layer, backward 2.5x, recompute 1x; h_attn = heads x head size) + 8 S h V (the LM head
  and the loss, forward, backward and the tiled loss's recompute), times the stack's factor
  (`STACK_FACTOR`: its extra recompute), at `Machine.flops`; a job runs one warm-up step, the
  timed steps and, on CUDA, the step recorded for the peak's categories; the model's build adds
  its bytes at `Machine.bandwidth` and one second;
- the attention core (causal, forward + backward) of one variant at S tokens: 7 S^2 h_attn FLOPs
  (forward 2 S^2 h_attn, backward 2.5x) per step;
- a tiled MLP step at S tokens: 9 U (U = 2 S h m) untiled, 11 U tiled, per step;
- parts measured as a whole (kernels, gradient error, training, the GPU tests): a fixed figure
  per machine (`FIXED_S`).

Corrections from the records: the committed records of the same device kind
(benchmarks/results/gpu/<date>-<device>/*.jsonl, `device_slug`) replace an estimate where
they measured the same thing: a whole step of the same shape, length and stack takes its
recorded wall time (`wall_s`), a whole part recorded by the suite at the same sizes its
`part_seconds`; other whole steps are scaled by the median ratio of recorded step time to the
model's estimate over that device's whole-step records. Every estimate carries `MARGIN`.

Invariant: an estimate is a pure function of the sizes, the machine and the records it is given;
the suite compares it with the time left before it starts the work.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "MARGIN",
    "STACK_FACTOR",
    "Corrections",
    "Machine",
    "attention_step_flops",
    "device_slug",
    "load_corrections",
    "machine_for",
    "mlp_step_flops",
    "whole_step_flops",
]

MARGIN = 1.25  # every estimate is multiplied by this before it is compared with the time left

# Extra time of a stack over the untiled step: the tiled MLP's recompute of its first
# projections (+2 U of the MLP's 9 U), offloading's copies, the tiled layer's attention and norm
# recompute; a first guess the records correct.
STACK_FACTOR: dict[str, float] = {
    "untiled": 1.0,
    "tiled_mlp": 1.1,
    "tiled_mlp_loss": 1.1,
    "tiled_mlp_loss_offload": 1.2,
    "tiled_mlp_loss_offload_norms": 1.25,
    "tiled_layer": 1.6,
}


@dataclass(frozen=True)
class Machine:
    """What the cost model assumes of the machine.

    Attributes:
        flops: sustained FLOP/s of large matrix products in the suite's dtype.
        bandwidth: bytes/s for building a model (allocation and initialisation).
        process_s: seconds to start Python and import torch and transformers.
        fixed_s: seconds of the parts estimated as a whole, by part name.
    """

    flops: float
    bandwidth: float
    process_s: float
    fixed_s: Mapping[str, float] = field(default_factory=dict)


# One H100-class GPU in bf16 (about half of the dense peak, as long steps reach with attention
# and elementwise work), and a small CPU in float32.
GPU = Machine(
    flops=4.0e14,
    bandwidth=5.0e11,
    process_s=12.0,
    fixed_s={"kernels": 15.0, "grad_error": 10.0, "gpu_tests": 60.0, "train_run": 60.0},
)
CPU = Machine(
    flops=2.0e10,
    bandwidth=2.0e9,
    process_s=6.0,
    fixed_s={"kernels": 30.0, "grad_error": 5.0, "gpu_tests": 30.0, "train_run": 40.0},
)


def machine_for(device_type: str) -> Machine:
    """The cost model's machine for a device type ("cuda", "cpu", ...)."""
    return CPU if device_type == "cpu" else GPU


def device_slug(name: str) -> str:
    """A short name of the device for record folders: "h100" for "NVIDIA H100 80GB HBM3"."""
    low = name.lower()
    known = re.search(r"\b(h100|h200|h20|b200|b100|gh200|a100|a10g|l40s|l4|mi300x|mi250x)\b", low)
    if known:
        return known.group(1)
    slug = re.sub(r"[^a-z0-9]+", "-", low).strip("-")
    return slug[:32] or "device"


def whole_step_flops(model: Mapping[str, Any], seq_len: int, stack: str) -> float:
    """FLOPs of one checkpointed training step of a Llama-shaped model (module docstring).

    Args:
        model: LlamaConfig fields (hidden_size, intermediate_size, num_hidden_layers,
            num_attention_heads, num_key_value_heads, vocab_size).
        seq_len: tokens (batch 1).
        stack: a name of STACK_FACTOR.
    """
    h, m, layers = model["hidden_size"], model["intermediate_size"], model["num_hidden_layers"]
    heads = model["num_attention_heads"]
    kv = model.get("num_key_value_heads", heads)
    head_dim = model.get("head_dim", h // heads)
    attn_params = 2 * h * heads * head_dim + 2 * h * kv * head_dim
    params = layers * (attn_params + 3 * h * m)
    s = float(seq_len)
    flops = 8 * params * s + 9 * layers * s * s * heads * head_dim
    flops += 8 * s * h * model.get("vocab_size", 32000)
    return flops * STACK_FACTOR.get(stack, 1.6)


def model_bytes(model: Mapping[str, Any], dtype_bytes: int) -> float:
    """The parameters' bytes (embeddings and an untied LM head included)."""
    h, m, layers = model["hidden_size"], model["intermediate_size"], model["num_hidden_layers"]
    heads = model["num_attention_heads"]
    kv = model.get("num_key_value_heads", heads)
    head_dim = model.get("head_dim", h // heads)
    params = layers * (2 * h * heads * head_dim + 2 * h * kv * head_dim + 3 * h * m)
    params += 2 * h * model.get("vocab_size", 32000)
    return float(params * dtype_bytes)


def attention_step_flops(seq_len: int, heads: int, head_dim: int) -> float:
    """FLOPs of one causal attention forward + backward at `seq_len` tokens (batch 1)."""
    return 7.0 * seq_len * seq_len * heads * head_dim


def mlp_step_flops(seq_len: int, hidden: int, intermediate: int, tiled: bool) -> float:
    """FLOPs of one SwiGLU MLP forward + backward: 9 U untiled, 11 U tiled."""
    u = 2.0 * seq_len * hidden * intermediate
    return (11 if tiled else 9) * u


@dataclass(frozen=True)
class Corrections:
    """What the committed records of this device kind measured.

    Attributes:
        whole_step_s: (hidden, layers, seq_len, stack) -> (recorded wall seconds of the job,
            seconds of one of its steps).
        whole_step_ratio: median of recorded step time / the model's step estimate, or None.
        part_s: (part name, smoke) -> recorded part_seconds.
        attention_ratio: median of recorded SDPA step time / the model's estimate, or None.
        attention_by_heads_ratio: median of recorded by-heads time / SDPA's at the same
            length, or None.
        task_s: (part, what, smoke) -> the recorded seconds of that whole task (a length of
            whole steps with all its stacks, a part measured as one piece...).
        sources: the record files read.
    """

    whole_step_s: dict[tuple[int, int, int, str], tuple[float, float]] = field(default_factory=dict)
    whole_step_ratio: float | None = None
    part_s: dict[tuple[str, bool], float] = field(default_factory=dict)
    attention_ratio: float | None = None
    attention_by_heads_ratio: float | None = None
    task_s: dict[tuple[str, str, bool], float] = field(default_factory=dict)
    sources: tuple[str, ...] = ()


def _records(files: Iterable[Path]) -> Iterable[dict[str, Any]]:
    for path in files:
        for line in path.read_text().splitlines():
            if line.startswith("{"):
                try:
                    yield json.loads(line)
                except json.JSONDecodeError:
                    continue


def load_corrections(
    root: Path | None, slug: str, model: Mapping[str, Any] | None = None
) -> Corrections:
    """The corrections from `root`/*-<slug>/**/*.jsonl (module docstring); empty without records.

    Args:
        root: benchmarks/results/gpu of a source checkout, or None.
        slug: `device_slug` of the device the suite runs on.
        model: the whole-step model's fields, for the ratio to the cost model (records of other
            shapes count through their own fields).
    """
    if root is None or not root.is_dir():
        return Corrections()
    files = sorted(p for d in root.iterdir() if d.is_dir() and d.name.endswith(f"-{slug}")
                   for p in d.rglob("*.jsonl"))  # fmt: skip
    whole: dict[tuple[int, int, int, str], tuple[float, float]] = {}
    ratios: list[float] = []
    parts: dict[tuple[str, bool], float] = {}
    attention: dict[tuple[int, str], tuple[float, tuple[int, int]]] = {}
    tasks: dict[tuple[str, str, bool], float] = {}
    for r in _records(files):
        if r.get("status") not in (None, "ok"):
            continue
        if {"part", "what", "seconds"} <= r.keys() and r["seconds"]:
            tasks[(str(r["part"]), str(r["what"]), bool(r.get("smoke")))] = float(r["seconds"])
        # a part measured as one piece: its seconds (older suite records: part_seconds)
        # a part measured as one piece ("tiled and untiled": the train part)
        one_piece = r.get("what") in ("all", "tiled and untiled")
        seconds = r.get("seconds") if one_piece else r.get("part_seconds")
        if seconds is not None and "part" in r:
            parts[(r["part"], bool(r.get("smoke")))] = float(seconds)
        if {"stack", "seq_len", "hidden", "layers", "time_ms"} <= r.keys() and not r.get("error"):
            key = (int(r["hidden"]), int(r["layers"]), int(r["seq_len"]), str(r["stack"]))
            if r.get("wall_s"):
                whole[key] = (float(r["wall_s"]), float(r["time_ms"]) / 1000)
            fields = {
                "hidden_size": r["hidden"],
                "intermediate_size": r.get("intermediate", 4 * r["hidden"]),
                "num_hidden_layers": r["layers"],
                "num_attention_heads": (model or {}).get("num_attention_heads", 32),
                "num_key_value_heads": (model or {}).get("num_key_value_heads", 8),
                "vocab_size": r.get("vocab", 32000),
            }
            estimate = whole_step_flops(fields, int(r["seq_len"]), str(r["stack"])) / GPU.flops
            if estimate > 0:
                ratios.append(float(r["time_ms"]) / 1000 / estimate)
        seq = r.get("seq", r.get("seq_len"))
        ms = r.get("ms", r.get("time_ms"))
        if r.get("variant") in ("sdpa", "by_heads") and seq and ms:
            # records without their shape have the suite's default one: 32 heads of 128
            shape = (int(r.get("heads", 32)), int(r.get("head_dim", 128)))
            attention[(int(seq), str(r["variant"]))] = (float(ms) / 1000, shape)
    sdpa = {s: t for (s, v), t in attention.items() if v == "sdpa"}
    heads = [t[0] / sdpa[s][0] for (s, v), t in attention.items() if v == "by_heads" and s in sdpa]
    att = [t / (attention_step_flops(s, *shape) / GPU.flops) for s, (t, shape) in sdpa.items()]
    return Corrections(
        whole,
        statistics.median(ratios) if ratios else None,
        parts,
        statistics.median(att) if att else None,
        statistics.median(heads) if heads else None,
        tasks,
        tuple(str(f) for f in files),
    )


def ceil_s(seconds: float) -> float:
    """Seconds rounded up to a tenth, for records."""
    return math.ceil(seconds * 10) / 10
