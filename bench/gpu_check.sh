#!/usr/bin/env bash
# Device checks for one GPU, under 5 minutes: the CUDA tests, decode tokens/s eager vs CUDA graphs at
# batch 1 and 2, and one 30 s track at the release's full-size shapes with random weights.
# One summary line each; paste them into bench/README.md ("GPU" rows).
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
$PY -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' || { echo "GPU no CUDA device here"; exit 1; }
$PY -m songserve.pipeline.tiny >/dev/null
tests=$(timeout 120 $PY -m pytest tests/test_gpu.py -q -p no:cacheprovider 2>&1 | tail -1)
echo "GPU-tests tests/test_gpu.py (bf16 step, graphs, no host sync, park): $tests"
timeout 240 $PY -m bench.gpu_check "$@" 2>/tmp/songserve-gpu-check.err | grep '^GPU' \
  || { echo "GPU-check failed: tail of /tmp/songserve-gpu-check.err:"; tail -5 /tmp/songserve-gpu-check.err; }
