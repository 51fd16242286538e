#!/usr/bin/env bash
# One prepared GPU run that writes its records as it goes (a run cut short keeps what it measured):
#   0. (trace) the caching allocator's own trace of whole steps (benchmarks/allocator_trace.py): the
#      4-layer Llama-3-8B shape, tiled_mlp_loss at 128K without expandable segments and the
#      norms stack at 32K with them, each in a fresh process;
#   1. the suite within its time budget (python -m benchmarks.suite --budget SUITE_S;
#      SUITE_PARTS, if set, is passed as --parts);
#   2. `tiledmlp plan --measure` of Llama-3-8B cut to 2 layers (tiled_mlp_loss, tiled_layer);
#   3. a long Llama-3-8B-shaped step with the full stack (tiled_layer), layers cut to 2, and
#      the planner's prediction for the same model (on this machine's CPU, in the background).
# Usage: benchmarks/run_gpu.sh OUT_DIR [SUITE_S] [TOTAL_S] [WHAT]
# WHAT: comma-separated subset of trace,suite,long,measure (default: suite,long,measure; they run
# in that order).
# Peers' packages (DeepSpeed, Liger) are installed from .gpu-wheels/ when that folder exists.
set -u
OUT_DIR=${1:?usage: benchmarks/run_gpu.sh OUT_DIR [SUITE_S] [TOTAL_S]}
SUITE_S=${2:-420}
TOTAL_S=${3:-570}
WHAT=${4:-suite,long,measure}
want() { case ",$WHAT," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
START=$(date +%s)
left() { echo $((TOTAL_S - ($(date +%s) - START))); }
mkdir -p "$OUT_DIR"
if [ -d .gpu-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/*.whl \
    >"$OUT_DIR/pip.log" 2>&1
  export PYTHONPATH=/tmp/site:$PWD/src:$PWD
else
  export PYTHONPATH=$PWD/src:$PWD  # the package, and the checkout for benchmarks/
fi
export PYTHONUNBUFFERED=1
{
  date -u
  nvidia-smi
  python3 -c "import torch, transformers, triton; print(torch.__version__, torch.version.cuda, transformers.__version__, triton.__version__)"
} >"$OUT_DIR/machine.txt" 2>&1

if want trace; then
  mkdir -p "$OUT_DIR/trace"
  SHAPE='"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 1048576, "rope_theta": 500000.0, "tie_word_embeddings": false'
  for spec in "131072 tiled_mlp_loss expandable_segments:False" \
              "32768 tiled_mlp_loss_offload_norms expandable_segments:True"; do
    set -- $spec
    echo "trace $2 $1 $3"
    PYTORCH_CUDA_ALLOC_CONF=$3 timeout 150 python3 -m benchmarks.allocator_trace \
      "{\"config\": {$SHAPE}, \"seq_len\": $1, \"stack\": \"$2\"}" \
      "$OUT_DIR/trace/$2-$1-${3#expandable_segments:}.json.gz" >>"$OUT_DIR/trace/trace.log" 2>&1
    echo "trace exit $? at $(($(date +%s) - START)) s"
  done
fi

if want suite; then
  echo "suite (budget ${SUITE_S} s)"
  python3 -m benchmarks.suite --budget "$SUITE_S" --out "$OUT_DIR/suite" -v \
    ${SUITE_PARTS:+--parts "$SUITE_PARTS"} >"$OUT_DIR/suite.log" 2>&1
  echo "suite exit $? at $(($(date +%s) - START)) s"
fi

# the long step's model: Llama-3-8B's shape, 2 decoder layers
LONG_CFG='{"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 1048576, "rope_theta": 500000.0, "tie_word_embeddings": false}'
LONG_LEN=524288
mkdir -p "$OUT_DIR/long"
python3 - "$LONG_CFG" "$OUT_DIR/long/config.json" <<'EOF'
import json, sys
cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **json.loads(sys.argv[1])}
open(sys.argv[2], "w").write(json.dumps(cfg, indent=1))
EOF
if want long; then (python3 -m tiledmlp plan --model "$OUT_DIR/long/config.json" --seq-len "$LONG_LEN" \
  --stacks tiled_layer --gradient-checkpointing --json >"$OUT_DIR/long/plan.json" \
  2>"$OUT_DIR/long/plan.log" &); fi

T=$(( $(left) - ${MEASURE_S:-0} - 5 ))
if want long && [ "$T" -gt 30 ]; then
  echo "long step ${LONG_LEN} tokens (${T} s at most)"
  JOB=$(python3 -c "import json,sys; print(json.dumps({'config': json.loads(sys.argv[1]), 'seq_len': $LONG_LEN, 'stack': 'tiled_layer', 'steps': 1}))" "$LONG_CFG")
  timeout "$T" python3 -m tiledmlp.bench.whole_step "$JOB" >"$OUT_DIR/long/step.jsonl" \
    2>"$OUT_DIR/long/step.log"
  echo "long step exit $? at $(($(date +%s) - START)) s"
fi
T=$(( $(left) - 5 ))
if want measure && [ "$T" -gt 30 ]; then
  echo "plan --measure (${T} s at most)"
  timeout "$T" python3 -m tiledmlp plan --model llama3-8b --gradient-checkpointing --measure \
    --measure-layers 2 --measure-lengths 8192,16384 --stacks tiled_mlp_loss,tiled_layer \
    --json >"$OUT_DIR/plan_measure.json" 2>"$OUT_DIR/plan_measure.log"
  echo "plan --measure exit $? at $(($(date +%s) - START)) s"
fi

sleep 2
echo "done at $(($(date +%s) - START)) s"
