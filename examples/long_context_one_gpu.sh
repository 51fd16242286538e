#!/usr/bin/env bash
# Long context on one GPU: an 8B-shaped Llama (the llama3-8b preset, random init) trained on
# 512K-token sequences with the whole stack: tiled MLPs, tiled loss, tiled norms, the model's own
# non-reentrant checkpointing with the layer inputs offloaded to pinned host memory, and DeepSpeed
# ZeRO-3 with the optimizer state on the host (examples/ds_zero3_offload.json). The planner
# predicts a 74.1 GiB peak at 512K tokens (docs/guides/long-context.md); not yet run on a GPU.
#
# Check the plan first: tiledmlp plan --model llama3-8b --seq-len 524288 --optimizer cpu-offload \
#   --gradient-checkpointing --memory-gb 79
# The same recipe CPU-sized (the tiny preset, 512 tokens, fp32, examples/ds_zero3_offload_cpu.json:
# the same DeepSpeed config without bf16 and pinned memory), runs in a minute on any machine:
#   CPU_SIZED=1 bash examples/long_context_one_gpu.sh
# Any of MODEL, SEQ_LEN, DTYPE, STEPS, LR, DS_CONFIG overrides its default; extra arguments go to
# tiledmlp train.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${CPU_SIZED:-0}" = 1 ]; then
  MODEL="${MODEL:-tiny}" SEQ_LEN="${SEQ_LEN:-512}" DTYPE="${DTYPE:-float32}"
  LR="${LR:-1e-3}" DS_CONFIG="${DS_CONFIG:-examples/ds_zero3_offload_cpu.json}"
fi
"${PYTHON:-python}" -m torch.distributed.run --standalone --nproc_per_node 1 -m tiledmlp train \
  --model "${MODEL:-llama3-8b}" --seq-len "${SEQ_LEN:-524288}" --dtype "${DTYPE:-bfloat16}" \
  --max-steps "${STEPS:-4}" --learning-rate "${LR:-1e-5}" \
  --gradient-checkpointing --activation-offloading --tiled-norms \
  --deepspeed "${DS_CONFIG:-examples/ds_zero3_offload.json}" "$@"
