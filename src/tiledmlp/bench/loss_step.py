"""Peak tensor memory and FLOPs of LM-head + cross-entropy forward + backward, three designs.

Usage (prints one JSON object per design):
    python -m tiledmlp.bench.loss_step --tokens 16384 --vocab 32000 --hidden 512

Designs: "untiled" (logits for all tokens, float32 cross-entropy, as Hugging Face does),
"tiled" (tiled_cross_entropy: gradients formed in the forward, 3L FLOPs), and "recompute"
(per-tile activation checkpointing of the same computation, which recomputes each tile's logits
in the backward: 4L FLOPs), with L = 2 * tokens * hidden * vocab.

Invariant: every design gets the same inputs and is measured by the same helpers.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tiledmlp.bench.flops import count_flops
from tiledmlp.bench.memory import peak_bytes, tensor_bytes
from tiledmlp.ops.loss import tiled_cross_entropy

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--hidden", type=int, default=512, help="hidden size")
    p.add_argument("--recompute-tiles", type=int, default=32, help="tiles of the recompute design")
    a = p.parse_args(argv)
    torch.manual_seed(0)
    h = torch.randn(a.tokens, a.hidden, requires_grad=True)
    w = (torch.randn(a.vocab, a.hidden) * 0.02).requires_grad_()
    labels = torch.randint(0, a.vocab, (a.tokens,))
    big_l = 2 * a.tokens * a.hidden * a.vocab

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

    designs: dict[str, Callable[[], torch.Tensor]] = {
        "tiled": tiled,
        "recompute": recompute,
        "untiled": untiled,
    }

    def step(fn: Callable[[], torch.Tensor]) -> None:
        fn().backward()

    for name, fn in designs.items():
        alive = tensor_bytes(h, w, labels)
        peak = peak_bytes(functools.partial(step, fn), alive, torch.device("cpu"))
        h.grad = w.grad = None
        flops = count_flops(functools.partial(step, fn))
        h.grad = w.grad = None
        record = {
            "design": name,
            "tokens": a.tokens,
            "vocab": a.vocab,
            "hidden": a.hidden,
            "dtype": "float32",
            "peak_mib": round(peak / 2**20, 1),
            "flops_over_L": flops / big_l,
            "torch": torch.__version__,
        }
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
