"""Run as a script: process-level peak memory of one untiled SwiGLU forward + backward.

Prints one JSON object: {"peak_mib": ...} = (VmHWM during the step - RSS before it) + the bytes of
the tensors alive before the step (weights, input, upstream gradient), so it is comparable with
tensor-level estimates. The high-water mark is reset through /proc/self/clear_refs first.
"""

from __future__ import annotations

import json
import sys

import torch

from tiledmlp.bench.memory import process_peak_bytes, tensor_bytes
from tiledmlp.models.mlps import GatedMLP


def main() -> None:
    hidden, intermediate, seq = (int(a) for a in sys.argv[1:4])
    torch.manual_seed(0)
    mlp = GatedMLP(hidden, intermediate)
    x = torch.randn(1, seq, hidden, requires_grad=True)
    dy = torch.randn(1, seq, hidden)
    mlp(x[:, :8]).sum().backward()  # warm up kernels and allocator paths, then drop the grads
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    peak = process_peak_bytes(lambda: mlp(x).backward(dy), tensor_bytes(*mlp.parameters(), x, dy))
    if peak is None:
        raise RuntimeError("the process-level peak needs Linux's /proc/self/clear_refs")
    print(json.dumps({"peak_mib": peak / 2**20}))


if __name__ == "__main__":
    main()
