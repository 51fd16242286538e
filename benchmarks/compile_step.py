"""Training-step time of a small Llama under torch.compile: compiled-patched vs eager-patched vs
compiled-untiled (and eager-untiled), interleaved, median of repeats; one JSON line per variant.

    python benchmarks/compile_step.py --seq-len 4096 --repeats 7 --out benchmarks/results/compile-step-cpu.jsonl

Patched: tiled MLPs (4 tiles) and the tiled loss. Each variant is its own model with the same
weights; after the warm-up steps (the compile) the variants run one step each in turn, `repeats`
rounds, so the machine's load drifts over all of them alike.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch


def _model(hidden: int, intermediate: int, layers: int, vocab: int) -> Any:
    import transformers as tr

    torch.manual_seed(0)
    cfg = tr.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
    )
    cfg._attn_implementation = "sdpa"
    return tr.LlamaForCausalLM(cfg).float().train()


def _step(model: Any, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    for p in model.parameters():
        p.grad = None
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from tiledmlp import patch_model

    base = _model(args.hidden, args.intermediate, args.layers, args.vocab)
    patched = copy.deepcopy(base)
    patch_model(patched, num_tiles=4, tiled_loss=True)
    variants = {
        "eager_untiled": copy.deepcopy(base),
        "eager_patched": patched,
        "compiled_untiled": torch.compile(copy.deepcopy(base)),
        "compiled_patched": torch.compile(copy.deepcopy(patched)),
    }
    ids = torch.randint(
        0, args.vocab, (1, args.seq_len), generator=torch.Generator().manual_seed(0)
    )
    warm: dict[str, float] = {}
    for name, model in variants.items():
        start = time.perf_counter()
        for _ in range(args.warmup):
            _step(model, ids)
        warm[name] = time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, model in variants.items():
            times[name].append(_step(model, ids))
    sha = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    env = {
        "torch": torch.__version__,
        "device": "cpu",
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0],
        "git": sha,
        "dtype": "float32",
        "seq_len": args.seq_len,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "layers": args.layers,
        "vocab": args.vocab,
        "repeats": args.repeats,
    }
    ref = statistics.median(times["eager_patched"])
    lines = []
    for name, ts in times.items():
        med = statistics.median(ts)
        rec = {
            "variant": name,
            "median_ms": round(1e3 * med, 1),
            "vs_eager_patched": round(med / ref, 3),
            "warmup_s": round(warm[name], 1),
            "times_ms": [round(1e3 * t, 1) for t in ts],
            **env,
        }
        lines.append(json.dumps(rec))
        print(f"{name:18s} median {1e3 * med:8.1f} ms  x{med / ref:.3f} of eager_patched")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
