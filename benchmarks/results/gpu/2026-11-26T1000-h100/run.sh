set -u
O=$OUT
python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu-wheels/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
S=$(date +%s)
SHAPE='"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 1048576, "rope_theta": 500000.0, "tie_word_embeddings": false'
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False timeout 120 python3 -m tiledmlp.bench.allocator_trace \
  "{\"config\": {$SHAPE}, \"seq_len\": 131072, \"stack\": \"tiled_mlp_loss\"}" $O/tiled_mlp_loss-131072-False.json.gz >$O/trace.log 2>&1
echo "trace exit $? at $(($(date +%s)-S)) s"
timeout 150 python3 -m tiledmlp.bench.suite --budget 120 --parts allocator --out /tmp/suite -v >$O/suite.log 2>&1
echo "suite exit $? at $(($(date +%s)-S)) s"
cp /tmp/suite/records.jsonl $O/suite-records.jsonl; cp /tmp/suite/summary.md $O/suite-summary.md
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/patching/test_probe_cache.py tests/plan/test_device_overhead.py tests/ops/test_attention_heads.py -m gpu >$O/pytest.log 2>&1
echo "pytest exit $? at $(($(date +%s)-S)) s"; tail -3 $O/pytest.log
