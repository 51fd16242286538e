#!/usr/bin/env bash
# One million tokens on one 80 GB GPU: an 8B-shaped Llama (the llama3-8b preset, random init)
# trained on 1,048,576-token sequences with the full stack: tiled MLPs, tiled loss, tiled norms,
# the rest of each decoder layer tiled (--tiled-layers), the model's own non-reentrant
# checkpointing with the layer inputs offloaded to pinned host memory, and DeepSpeed ZeRO-3 with
# the parameters, gradients and optimizer on the host (ZeRO-Infinity's offload_param and
# offload_optimizer: examples/ds_zero3_offload_params.json). Planned, not yet run on a GPU: the
# planner puts this step at 69.8 GiB per GPU on a 79.2 GiB card (the attention core runs by head
# groups; --tiled-layers), up to 1,193,984 tokens fit, and the host keeps about 356 GiB for this
# GPU's step, most of it the offloaded layer inputs (the command below, 2026-12-07).
#
# Check the plan first:
#   tiledmlp plan --model llama3-8b --dtype bf16 --seq-len 1048576 --memory-gb 79.2 --engine zero3 \
#     --offload-params --optimizer cpu-offload --gradient-checkpointing --stacks tiled_layer
# The same recipe CPU-sized (the tiny preset, 512 tokens, fp32, gloo, and
# examples/ds_zero3_offload_params_cpu.json: the same DeepSpeed config without bf16 and pinned
# memory; torch's AdamW steps on the host, where a GPU run may use DeepSpeed's CPU Adam):
#   CPU_SIZED=1 bash examples/long_context_1m_one_gpu.sh
# Any of MODEL, SEQ_LEN, DTYPE, STEPS, LR, DS_CONFIG overrides its default; extra arguments go to
# tiledmlp train.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${CPU_SIZED:-0}" = 1 ]; then
  MODEL="${MODEL:-tiny}" SEQ_LEN="${SEQ_LEN:-512}" DTYPE="${DTYPE:-float32}"
  LR="${LR:-1e-3}" DS_CONFIG="${DS_CONFIG:-examples/ds_zero3_offload_params_cpu.json}"
fi
"${PYTHON:-python}" -m torch.distributed.run --standalone --nproc_per_node 1 -m tiledmlp train \
  --model "${MODEL:-llama3-8b}" --seq-len "${SEQ_LEN:-1048576}" --dtype "${DTYPE:-bfloat16}" \
  --max-steps "${STEPS:-4}" --learning-rate "${LR:-1e-5}" \
  --gradient-checkpointing --activation-offloading --tiled-norms --tiled-layers \
  --deepspeed "${DS_CONFIG:-examples/ds_zero3_offload_params.json}" "$@"
