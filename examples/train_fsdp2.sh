#!/usr/bin/env bash
# FSDP2 (fully_shard per decoder layer) on 2 processes, tiled MLPs + tiled loss.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}" examples/train_distributed.py --engine fsdp2 --fsdp-config examples/fsdp2.json "$@"
