#!/usr/bin/env bash
# DeepSpeed ZeRO-3 on 2 processes via torchrun (the deepspeed launcher works too on machines with
# numactl), tiled MLPs + tiled loss.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-2}" examples/train_distributed.py --engine deepspeed --deepspeed-config examples/ds_zero3.json "$@"
