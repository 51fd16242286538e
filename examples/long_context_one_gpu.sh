#!/usr/bin/env bash
# Long context on one GPU: an 8B-shaped Llama (the llama3-8b preset, random init) trained on
# 512K-token sequences with the whole stack: tiled MLPs, tiled loss, tiled norms, the model's own
# non-reentrant checkpointing with the layer inputs offloaded to pinned host memory, and DeepSpeed
# ZeRO-3 with the optimizer state on the host (examples/ds_zero3_offload.json). The planner
# predicts 72.5 GiB at 512K tokens (README, "Long context"); not yet run on a GPU.
#
# Check the plan first: tiledmlp plan --model llama3-8b --seq-len 524288 --optimizer cpu-offload \
#   --gradient-checkpointing --memory-gb 79
# CI runs the CPU-sized version (tests/distributed/test_examples.py):
#   MODEL=tiny SEQ_LEN=512 DTYPE=float32 DS_CONFIG=<the same JSON without bf16 and pinning> ...
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python}" -m torch.distributed.run --nproc_per_node 1 -m tiledmlp train \
  --model "${MODEL:-llama3-8b}" --seq-len "${SEQ_LEN:-524288}" --dtype "${DTYPE:-bfloat16}" \
  --max-steps "${STEPS:-4}" --learning-rate "${LR:-1e-5}" \
  --gradient-checkpointing --activation-offloading --tiled-norms \
  --deepspeed "${DS_CONFIG:-examples/ds_zero3_offload.json}" "$@"
