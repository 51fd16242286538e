"""Step time, device peak and host memory of a checkpointed model with and without activation
offloading, interleaved in one process.

Usage (prints one JSON object per variant, then a summary line):
    python -m benchmarks.offload_step --layers 8 --seq-len 32768 --steps 50

The model is a random-init Llama of the llama3-8b preset's layer shape (hidden 4096,
intermediate 14336, 32 heads / 8 KV heads) cut to --layers layers, built on the device
(models/build.py), in bfloat16 on CUDA (float32
and a small shape on the CPU, where the mechanism runs but saves nothing); every variant uses
non-reentrant checkpointing, the tiled MLP and the tiled loss; "offload" adds activation
offloading. Steps alternate between the variants so that drift affects both alike; time is the
median over steps after the first (CUDA events on a GPU, perf_counter on the CPU); the process's
resident host memory is sampled after the first, the tenth and the last step of the offloading
variant, so a growing host pool shows.

Invariant: both variants start from the same weights, see the same tokens and run the same steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from tiledmlp.allocator import prefer_expandable_segments
from tiledmlp.models.build import build_causal_lm, llama_config
from tiledmlp.patching import patch_model
from tiledmlp.patching.features.activation_offloading import enable_checkpointing, offloader_of
from tiledmlp.process_memory import proc_status_bytes

__all__ = ["measure_offload"]

MiB = 2**20


def _model(
    layers: int,
    hidden: int,
    intermediate: int,
    heads: int,
    kv: int,
    dtype: Any,
    device: torch.device,
) -> Any:
    """The random-init Llama, built directly on `device` in `dtype` (seed 0)."""
    cfg = llama_config(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=1 << 21,
    )
    return build_causal_lm(cfg, device=device, dtype=dtype, seed=0, attn_implementation="sdpa")


def measure_offload(
    *,
    layers: int,
    seq_len: int,
    steps: int,
    hidden: int = 4096,
    intermediate: int = 14336,
    heads: int = 32,
    kv_heads: int = 8,
) -> list[dict[str, Any]]:
    """One record per variant ("checkpointing", "offload"): median step ms, device peak MiB,
    and for "offload" the host RSS samples and the bytes moved per step."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    models = {}
    for variant in ("checkpointing", "offload"):
        model = _model(layers, hidden, intermediate, heads, kv_heads, dtype, device)
        enable_checkpointing(model)
        patch_model(model, tiled_loss=True, activation_offloading=variant == "offload")
        models[variant] = model
    ids = torch.randint(0, 32000, (1, seq_len), device=device)
    times: dict[str, list[float]] = {v: [] for v in models}
    peaks: dict[str, float] = {}
    rss: list[float] = []
    for step in range(steps):
        for variant, model in models.items():
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
            t0 = time.perf_counter()
            model(input_ids=ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
            if cuda:
                stop.record()
                torch.cuda.synchronize()
                ms = start.elapsed_time(stop)
                peaks[variant] = max(
                    peaks.get(variant, 0.0), torch.cuda.max_memory_allocated() / MiB
                )
            else:
                ms = (time.perf_counter() - t0) * 1000
            if step > 0:
                times[variant].append(ms)
            if variant == "offload" and step in (0, 9, steps - 1):
                rss.append((proc_status_bytes("VmRSS") or 0) / MiB)
    offloader = offloader_of(models["offload"])
    assert offloader is not None
    records = []
    for variant in models:
        record: dict[str, Any] = {
            "variant": variant,
            "layers": layers,
            "seq_len": seq_len,
            "hidden": hidden,
            "dtype": str(dtype).removeprefix("torch."),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "steps": steps,
            "median_ms": round(statistics.median(times[variant]), 2) if times[variant] else None,
            "peak_mib": round(peaks[variant], 1) if cuda else None,
            "torch": torch.__version__,
        }
        if variant == "offload":
            record["host_rss_mib"] = [round(r, 1) for r in rss]
            record["host_pool_buffers"] = offloader.pool.created
            record["offloaded_mib_per_step"] = round(
                offloader.stats.offloaded_bytes / steps / MiB, 1
            )
        records.append(record)
    return records


def main(argv: list[str] | None = None) -> None:
    prefer_expandable_segments()  # before CUDA initialises; a user's setting is kept
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="decoder layers (default: 8)")
    p.add_argument("--seq-len", type=int, default=32768, help="tokens, batch 1 (default: 32768)")
    p.add_argument("--steps", type=int, default=50, help="steps per variant (default: 50)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size (default: 4096)")
    p.add_argument("--intermediate", type=int, default=14336, help="MLP size (default: 14336)")
    p.add_argument("--heads", type=int, default=32, help="attention heads (default: 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="key/value heads (default: 8)")
    a = p.parse_args(argv)
    records = measure_offload(
        layers=a.layers,
        seq_len=a.seq_len,
        steps=a.steps,
        hidden=a.hidden,
        intermediate=a.intermediate,
        heads=a.heads,
        kv_heads=a.kv_heads,
    )
    for r in records:
        print(json.dumps(r), flush=True)
    base, off = records
    if base["median_ms"] and off["median_ms"]:
        print(f"offloading overhead: {100 * (off['median_ms'] / base['median_ms'] - 1):+.1f}%")


if __name__ == "__main__":
    main()
