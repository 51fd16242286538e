#!/usr/bin/env bash
# DDP on 2 processes (gloo on CPU, nccl on GPUs), tiled MLPs + tiled loss.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}" examples/train_distributed.py --engine ddp "$@"
