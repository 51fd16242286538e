#!/usr/bin/env bash
# Five million tokens on eight 80 GB GPUs: the 8B-shaped Llama (llama3-8b preset, random init),
# each 5,242,880-token sequence split over the 8 GPUs (Ulysses sequence parallelism, 655,360
# tokens per GPU), with the full stack of examples/long_context_1m_one_gpu.sh: tiled MLPs, loss,
# norms and layers, checkpointing with offloaded layer inputs, and DeepSpeed ZeRO-3 sharding over
# the 8 GPUs with parameters, gradients and optimizer on the host
# (examples/ds_zero3_offload_params.json). Planned, not yet run on GPUs: 66.9 GiB per GPU at
# 5,242,880 tokens, up to 6,242,304 within a 79.2 GiB card; 171.3 GiB of host memory per GPU
# (the command below, 2026-12-07).
#
# Check the plan first:
#   tiledmlp plan --model llama3-8b --dtype bf16 --seq-len 5242880 --sequence-parallel-size 8 \
#     --memory-gb 79.2 --engine zero3 --offload-params --optimizer cpu-offload \
#     --gradient-checkpointing --stacks tiled_layer
# The same recipe CPU-sized (2 processes with the sequence split over both, the tiny preset, 512
# tokens, fp32, gloo, examples/ds_zero3_offload_params_cpu.json):
#   CPU_SIZED=1 bash examples/long_context_5m_eight_gpus.sh
# Any of NPROC, SP, MODEL, SEQ_LEN, DTYPE, STEPS, LR, DS_CONFIG overrides its default; extra
# arguments go to tiledmlp train.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${CPU_SIZED:-0}" = 1 ]; then
  NPROC="${NPROC:-2}" SP="${SP:-2}" MODEL="${MODEL:-tiny}" SEQ_LEN="${SEQ_LEN:-512}"
  DTYPE="${DTYPE:-float32}" LR="${LR:-1e-3}"
  DS_CONFIG="${DS_CONFIG:-examples/ds_zero3_offload_params_cpu.json}"
fi
"${PYTHON:-python}" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-8}" \
  -m tiledmlp train --sequence-parallel-size "${SP:-8}" \
  --model "${MODEL:-llama3-8b}" --seq-len "${SEQ_LEN:-5242880}" --dtype "${DTYPE:-bfloat16}" \
  --max-steps "${STEPS:-4}" --learning-rate "${LR:-1e-5}" \
  --gradient-checkpointing --activation-offloading --tiled-norms --tiled-layers \
  --deepspeed "${DS_CONFIG:-examples/ds_zero3_offload_params.json}" "$@"
