"""Benchmark harness: one MLP shape, a sweep of sequence lengths, several variants side by side.

Every (sequence length, variant) pair is one measurement (bench/measure.py): peak memory and
FLOPs from instrumented steps, then the median time of repeated steps after a warm-up. With
`isolate` (the default on the CPU) each measurement runs in a fresh process, so that allocator
caches and thread pools of one never reach the next; the variants of one length run one after
the other, so drift of the machine hits neighbours alike (the repeats of one variant run
together, in its process); each record carries the 1-minute load average at its start.

Invariant: one JSON-serialisable record per (sequence length, variant), carrying the environment
(torch version, device, dtype, shapes, git sha) so results can be compared and re-plotted.
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tiledmlp.allocator import allocator_setting
from tiledmlp.bench.device import device_name
from tiledmlp.bench.load import machine_load
from tiledmlp.bench.measure import Job, measure, measure_in_subprocess
from tiledmlp.bench.variants import Variant
from tiledmlp.ops.tiling.values import check_int, is_int

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
        isolate: run each measurement in a fresh process.
    """

    hidden: int
    intermediate: int
    seq_lens: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    repeats: int = 3
    warmup: int = 1
    isolate: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "repeats"):
            check_int(name, getattr(self, name))
        check_int("warmup", self.warmup, minimum=0)
        if not self.seq_lens or not all(is_int(s) for s in self.seq_lens):
            raise ValueError(f"seq_lens must be positive, got {self.seq_lens}")


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
    return {
        "torch": torch.__version__,
        "device": cfg.device.type,
        "device_name": device_name(cfg.device),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "dtype": str(cfg.dtype).removeprefix("torch."),
        "hidden": cfg.hidden,
        "intermediate": cfg.intermediate,
        "isolated": cfg.isolate,
        "git_sha": git_sha(),
        "versions": package_versions(),
        # the CUDA allocator's setting (PYTORCH_CUDA_ALLOC_CONF); None off CUDA
        "cuda_alloc_conf": allocator_setting()["value"] if cfg.device.type == "cuda" else None,
    }


def package_versions() -> dict[str, str | None]:
    """Installed versions of the packages a comparison depends on (None: not installed)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("tiledmlp", "deepspeed", "liger-kernel", "triton", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def run_sweep(
    cfg: BenchConfig,
    variants: Callable[[int], Sequence[Variant]],
    on_record: Callable[[dict[str, Any]], None] = lambda r: None,
) -> list[dict[str, Any]]:
    """Measures every variant at every sequence length.

    Args:
        cfg: shapes, dtype, device, repeats, isolation.
        variants: sequence length -> the variants to compare at that length.
        on_record: called with each record as soon as it is ready (streaming output).

    Returns:
        The records, one per (sequence length, variant).
    """
    env = environment(cfg)
    records: list[dict[str, Any]] = []
    for seq in cfg.seq_lens:
        for v in variants(seq):
            job = Job(
                hidden=cfg.hidden,
                intermediate=cfg.intermediate,
                seq_len=seq,
                dtype=str(cfg.dtype).removeprefix("torch."),
                device=str(cfg.device),
                variant=v.name,
                num_tiles=v.num_tiles,
                repeats=cfg.repeats,
                warmup=cfg.warmup,
            )
            load = {"load_1min": machine_load()}  # at the start: how busy the machine was
            record = {
                **env,
                **load,
                **(measure_in_subprocess(job) if cfg.isolate else measure(job)),
            }
            records.append(record)
            on_record(record)
    return records
