#!/usr/bin/env bash
# tiledmlp train with each sequence split over SP ranks (Ulysses) under torchrun: NPROC processes
# (a multiple of SP; the rest is data parallelism), tiled MLPs + tiled loss, DDP.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}" -m tiledmlp train \
  --sequence-parallel-size "${SP:-2}" --seq-len "${SEQ_LEN:-2048}" "$@"
