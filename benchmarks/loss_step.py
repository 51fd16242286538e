"""Peak tensor memory, FLOPs and time of LM-head + cross-entropy designs, forward + backward.

Usage (prints one JSON object per design):
    python -m benchmarks.loss_step --tokens 16384 --vocab 32000 --hidden 512
    python -m benchmarks.loss_step --device cuda --dtype bfloat16 --tokens 32768 --vocab 128256 --hidden 4096

Designs: "untiled" (logits for all tokens, float32 cross-entropy, as Hugging Face does),
"tiled" (tiled_cross_entropy: gradients formed in the forward, 3L FLOPs), "recompute" (per-tile
activation checkpointing of the same computation, which recomputes each tile's logits in the
backward: 4L FLOPs), "tiled_eval" (tiled_cross_entropy under torch.no_grad: 1L), "logprobs"
(tiled_token_logprobs with the entropy, per-token outputs: 4L), and "liger" (Liger-Kernel's
LigerFusedLinearCrossEntropyLoss) when liger-kernel is installed and the device is a GPU;
L = 2 * tokens * hidden * vocab.

Invariant: every design gets the same inputs and is measured by the same helpers; time is the
median of --repeats runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tiledmlp.bench.flops import count_flops
from tiledmlp.bench.memory import peak_bytes, tensor_bytes
from tiledmlp.ops.loss.cross_entropy import tiled_cross_entropy, tiled_token_logprobs

__all__ = ["main"]


def _liger(device: torch.device) -> Callable[..., torch.Tensor] | None:
    """Liger's fused linear cross-entropy (weight, input, target), or None where unavailable."""
    if device.type != "cuda":
        return None
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss: Callable[..., torch.Tensor] = LigerFusedLinearCrossEntropyLoss()
    return loss


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    a = p.parse_args(argv)
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    torch.manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, device=device, dtype=dtype, requires_grad=True)
    w = (torch.randn(a.vocab, a.hidden, device=device, dtype=dtype) * 0.02).requires_grad_()
    labels = torch.randint(0, a.vocab, (a.tokens,), device=device)
    designs = _designs(a, h, w, labels)
    if a.designs:
        chosen = a.designs.split(",")
        unknown = sorted(set(chosen) - set(designs))
        if unknown:
            p.error(f"--designs: unknown {unknown}; available: {sorted(designs)}")
        designs = {k: v for k, v in designs.items() if k in chosen}
    for name, fn in designs.items():
        print(json.dumps(_measure(a, name, fn, h, w, labels)), flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--hidden", type=int, default=512, help="hidden size")
    p.add_argument("--recompute-tiles", type=int, default=32, help="tiles of the recompute design")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="dtype")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per design (median)")
    p.add_argument("--designs", default=None, help="comma-separated subset of the designs")
    return p


def _designs(
    a: argparse.Namespace, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor
) -> dict[str, Callable[[], torch.Tensor]]:
    """Each design's loss of (h, w, labels), by name (liger's only where it imports)."""

    def untiled() -> torch.Tensor:
        return F.cross_entropy(F.linear(h, w).float(), labels)

    def tiled() -> torch.Tensor:
        return tiled_cross_entropy(h, w, labels)

    def part(hh: torch.Tensor, ll: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(F.linear(hh, w).float(), ll, reduction="sum")

    def recompute() -> torch.Tensor:
        n = -(-a.tokens // a.recompute_tiles)
        parts = [
            checkpoint(part, hh, ll, use_reentrant=False)
            for hh, ll in zip(h.split(n), labels.split(n))
        ]
        return torch.stack(parts).sum() / a.tokens

    def logprobs() -> torch.Tensor:
        lp, ent = tiled_token_logprobs(h, w, labels, return_entropy=True)
        return lp.sum() + 0.01 * ent.sum()

    designs: dict[str, Callable[[], torch.Tensor]] = {
        "tiled": tiled,
        "tiled_eval": tiled,
        "logprobs": logprobs,
        "recompute": recompute,
        "untiled": untiled,
    }
    liger = _liger(h.device)
    if liger is not None:

        def liger_loss() -> torch.Tensor:
            out = liger(w, h, labels)  # (lin_weight, input, target)
            return out[0] if isinstance(out, tuple) else out  # (loss, z_loss) in some versions

        designs["liger"] = liger_loss
    return designs


def _measure(
    a: argparse.Namespace,
    name: str,
    fn: Callable[[], torch.Tensor],
    h: torch.Tensor,
    w: torch.Tensor,
    labels: torch.Tensor,
) -> dict[str, Any]:
    """One design's record: peak memory, FLOPs over L and the median time of a training step
    (an evaluation step for "tiled_eval")."""
    device = h.device

    def step() -> None:
        if name == "tiled_eval":
            with torch.no_grad():
                fn()
        else:
            fn().backward()

    alive = tensor_bytes(h, w, labels)
    peak = peak_bytes(step, alive, device)
    h.grad = w.grad = None
    flops = count_flops(step)
    h.grad = w.grad = None
    times = []
    for i in range(a.repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        if i:  # the first run warms up
            times.append(time.perf_counter() - t0)
        h.grad = w.grad = None
    return {
        "design": name,
        "tokens": a.tokens,
        "vocab": a.vocab,
        "hidden": a.hidden,
        "dtype": a.dtype,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "peak_mib": round(peak / 2**20, 1),
        "flops_over_L": flops / (2 * a.tokens * a.hidden * a.vocab),
        "time_ms": round(1000 * statistics.median(times), 1) if times else None,
        "torch": torch.__version__,
    }


if __name__ == "__main__":
    main()
