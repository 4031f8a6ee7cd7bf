#!/usr/bin/env bash
# Device checks for one GPU, under 5 minutes: the CUDA tests, decode tokens/s eager vs CUDA graphs at
# batch 1 and 2, and one 30 s track at the release's full-size shapes with random weights.
# One summary line each; paste them into bench/README.md ("GPU" rows). Full logs go to $GPU_CHECK_LOGS
# (default /tmp): gpu-tests.log, gpu-check.err.
#   bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
LOGS=${GPU_CHECK_LOGS:-/tmp}
mkdir -p "$LOGS"
$PY -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' || { echo "GPU no CUDA device here"; exit 1; }
$PY -c 'import torch; print("GPU-env torch", torch.__version__, torch.cuda.get_device_name(0))'
$PY -m songserve.pipeline.tiny >"$LOGS/gpu-tiny.log" 2>&1 || { echo "GPU tiny set failed to build:"; tail -5 "$LOGS/gpu-tiny.log"; exit 1; }
# -W default: a warning from another torch build on the device is shown, not an error (CI keeps "error").
timeout 210 $PY -m pytest tests/test_gpu.py -q -rfE -W default -p no:cacheprovider >"$LOGS/gpu-tests.log" 2>&1
echo "GPU-tests tests/test_gpu.py (bf16 step, graphs, no host sync, park, real worker + dispatcher): $(grep -E "[0-9]+ (passed|failed|error)" "$LOGS/gpu-tests.log" | tail -1)"
grep -E '^(FAILED|ERROR) ' "$LOGS/gpu-tests.log" | cut -c1-300
timeout 240 $PY -m bench.gpu_check "$@" 2>"$LOGS/gpu-check.err" | grep '^GPU' \
  || { echo "GPU-check failed: tail of $LOGS/gpu-check.err:"; tail -5 "$LOGS/gpu-check.err"; }
