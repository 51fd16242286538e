"""Benchmark harness: one MLP shape, a sweep of sequence lengths, several variants side by side.

For each sequence length every variant is measured the same way: peak memory and FLOPs from one
instrumented step (memory.peak_bytes, flops.count_flops), then wall-clock time as the median of
interleaved repeats after a warm-up (variant A, B, C, A, B, C, ...), so that drift of the machine
hits all variants alike.

Invariant: one JSON-serialisable record per (sequence length, variant), carrying the environment
(torch version, device, dtype, shapes, git sha) so results can be compared and re-plotted.
"""

from __future__ import annotations

import functools
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tiledmlp.bench.flops import count_flops
from tiledmlp.bench.memory import peak_bytes, tensor_bytes
from tiledmlp.bench.models import GatedMLP
from tiledmlp.bench.variants import Variant

__all__ = ["BenchConfig", "run_sweep"]

MiB = 2**20


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What to measure.

    Attributes:
        hidden: MLP hidden size.
        intermediate: MLP intermediate size.
        seq_lens: tokens per sequence (batch 1) to sweep.
        dtype: parameter and activation dtype.
        device: where to run.
        repeats: timed repeats per variant (median reported).
        warmup: untimed runs per variant before timing.
    """

    hidden: int
    intermediate: int
    seq_lens: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    repeats: int = 3
    warmup: int = 1

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if not self.seq_lens or any(s < 1 for s in self.seq_lens):
            raise ValueError(f"seq_lens must be positive, got {self.seq_lens}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def git_sha() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def environment(cfg: BenchConfig) -> dict[str, Any]:
    """The environment fields every record carries."""
    device_name = (
        torch.cuda.get_device_name(cfg.device)
        if cfg.device.type == "cuda"
        else platform.processor() or "cpu"
    )
    return {
        "torch": torch.__version__,
        "device": cfg.device.type,
        "device_name": device_name,
        "threads": torch.get_num_threads(),
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "hidden": cfg.hidden,
        "intermediate": cfg.intermediate,
        "git_sha": git_sha(),
    }


def run_sweep(
    cfg: BenchConfig,
    variants: Callable[[int], Sequence[Variant]],
    on_record: Callable[[dict[str, Any]], None] = lambda r: None,
) -> list[dict[str, Any]]:
    """Measures every variant at every sequence length.

    Args:
        cfg: shapes, dtype, device, repeats.
        variants: sequence length -> the variants to compare at that length.
        on_record: called with each record as soon as it is ready (streaming output).

    Returns:
        The records, one per (sequence length, variant).
    """
    env = environment(cfg)
    records: list[dict[str, Any]] = []
    torch.manual_seed(0)
    mlp = GatedMLP(cfg.hidden, cfg.intermediate).to(device=cfg.device, dtype=cfg.dtype)
    for seq in cfg.seq_lens:
        for record in _measure_length(cfg, mlp, seq, list(variants(seq))):
            record = {**env, **record}
            records.append(record)
            on_record(record)
    return records


def _measure_length(
    cfg: BenchConfig, mlp: torch.nn.Module, seq: int, chosen: list[Variant]
) -> list[dict[str, Any]]:
    """Records (without the environment) of every variant at one sequence length."""
    x = torch.randn(1, seq, cfg.hidden, device=cfg.device, dtype=cfg.dtype, requires_grad=True)
    dy = torch.randn(1, seq, cfg.hidden, device=cfg.device, dtype=cfg.dtype)
    alive = tensor_bytes(*mlp.parameters(), x, dy)

    def step(v: Variant) -> torch.Tensor:
        y = v.forward(mlp, x)
        y.backward(dy)
        return y  # alive until the step's end, as in training

    def reset() -> None:
        x.grad = None
        mlp.zero_grad(set_to_none=True)

    stats: dict[str, dict[str, Any]] = {}
    for v in chosen:
        v.forward(mlp, x[:, :8])  # one-time structure probe outside the measurement
        peak = peak_bytes(functools.partial(step, v), alive, cfg.device)
        reset()
        flops = count_flops(functools.partial(step, v))
        reset()
        stats[v.name] = {"peak": peak, "flops": flops, "times": [], "tiles": v.tiles(mlp, x)}
        for _ in range(cfg.warmup):
            step(v)
            reset()
    for _ in range(cfg.repeats):
        for v in chosen:  # interleaved: machine drift hits every variant alike
            _sync(cfg.device)
            start = time.perf_counter()
            step(v)
            _sync(cfg.device)
            stats[v.name]["times"].append(time.perf_counter() - start)
            reset()
    return [
        {
            "seq_len": seq,
            "variant": v.name,
            "num_tiles": v.num_tiles,
            "tiles": stats[v.name]["tiles"],
            "time_ms": round(1000 * statistics.median(stats[v.name]["times"]), 3),
            "times_ms": [round(1000 * t, 3) for t in stats[v.name]["times"]],
            "peak_mib": round(stats[v.name]["peak"] / MiB, 2),
            "flops": stats[v.name]["flops"],
            "repeats": cfg.repeats,
        }
        for v in chosen
    ]


def config_dict(cfg: BenchConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["dtype"] = str(cfg.dtype)
    d["device"] = str(cfg.device)
    return d
