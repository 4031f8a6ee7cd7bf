#!/usr/bin/env bash
# The decode modes' device run, one command on a bare GPU machine: set it up, then bench/gpu_check.py's
# table (every decode mode at batch 1, 2, 4 on release shapes: tokens vs eager, ms/step, bytes/s vs a
# device-to-device copy, kernels/step; then a 3-minute song per stage, 1 take and 4) in <= 5 minutes.
#   bash bench/gpu_check.sh                 on the GPU machine; the table lands in $OUT (else /tmp/gpu-check)
#   bash bench/gpu_check.sh --smoke         the same script on the CPU at tiny shapes (CI: seconds)
#   bash bench/gpu_check.sh --fetch-wheels  HERE, with the network: the wheels the GPU machine lacks, into .whl/
#   bash bench/gpu_check.sh --with-tests    also tests/model/test_gpu.py first (about 3 more minutes)
# After the table, bench/gpu_adapters.py's rows: the decode step with LoRA adapters per mode (not in --smoke).
# The GPU machine reaches no network: what its image lacks travels as wheels in .whl/ (ignored by git;
# the device tool's `carry`), installed with pip --no-index into /tmp/site. Its python3 holds a CUDA
# torch and triton already; the service's pinned torch is not installed there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
smoke=0; tests=0; fetch=0; pass=()
for a in "$@"; do
  case "$a" in
    --smoke) smoke=1; pass+=(--smoke) ;;
    --with-tests) tests=1 ;;
    --fetch-wheels) fetch=1 ;;
    *) pass+=("$a") ;;
  esac
done
# What the measurement imports beyond torch and numpy (the GPU image's own python has those and triton).
NEEDED=(megatron-core==0.16.1 pydantic pydantic-settings pydantic-core annotated-types typing-inspection
        pyyaml soundfile tokenizers tqdm psutil)

if [ $fetch = 1 ]; then
  t0=$(date +%s)
  mkdir -p .whl
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >>"$(git rev-parse --git-path info/exclude)"
  for p in "${NEEDED[@]}"; do
    # the versions this checkout's venv runs (pydantic pins its pydantic-core exactly)
    [[ "$p" == *==* ]] || p="$p==$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$p'))" 2>/dev/null)"
    p=${p%==}
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform any -d .whl "$p" || echo "fetch: $p: no wheel for the GPU image's Python 3.12"
  done
  echo "fetch: $(ls .whl | wc -l) wheels in .whl/ ($(du -sh .whl | cut -f1)) in $(( $(date +%s) - t0 ))s; carry .whl"
  exit 0
fi

if [ $smoke = 1 ]; then
  PY=.venv/bin/python; [ -x "$PY" ] || PY=python3
else
  PY=python3  # the GPU image's python: CUDA torch and triton
  [ -x .venv/bin/python ] && .venv/bin/python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null && PY=.venv/bin/python
fi
echo "setup: python $($PY -c 'import sys; print(sys.version.split()[0], sys.executable)')"
$PY -c 'import torch; print("setup: torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")'
$PY -c 'import triton; print("setup: triton", triton.__version__)' 2>/dev/null || echo "setup: triton missing (the fused mode will say so in its row)"
missing=$($PY - <<'PY'
import importlib.util
mods = {"megatron.core": "megatron-core", "pydantic": "pydantic", "pydantic_settings": "pydantic-settings",
        "yaml": "pyyaml", "soundfile": "soundfile", "tokenizers": "tokenizers", "tqdm": "tqdm", "psutil": "psutil"}
print(" ".join(p for m, p in mods.items() if importlib.util.find_spec(m.split(".")[0]) is None or
               (m == "megatron.core" and importlib.util.find_spec(m) is None)))
PY
)
if [ -n "$missing" ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    t0=$(date +%s)
    echo "setup: missing $missing: installing from .whl/ (carried; pip --no-index --no-deps into /tmp/site):"
    ls .whl/*.whl | sed 's|^|setup:   |'
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || echo "setup: pip install from .whl/ failed"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    echo "setup: installed in $(( $(date +%s) - t0 ))s"
  else
    echo "setup: missing $missing and no .whl/ here: run 'bash bench/gpu_check.sh --fetch-wheels' where pip reaches PyPI, then carry .whl"
  fi
fi
export GIT_COMMIT=${GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo '?')}
export PYTHONUNBUFFERED=1

if [ $tests = 1 ] && [ $smoke = 0 ]; then
  $PY -m songserve.pipeline.tiny >"$OUT/gpu-tiny.log" 2>&1 || echo "GPU-tests: the tiny set failed to build (gpu-tiny.log)"
  timeout 210 $PY -m pytest tests/model/test_gpu.py -q -rfE -W default -p no:cacheprovider >"$OUT/gpu-tests.log" 2>&1
  echo "GPU-tests tests/model/test_gpu.py: $(grep -E "[0-9]+ (passed|failed|error)" "$OUT/gpu-tests.log" | tail -1)"
fi
t0=$(date +%s)
timeout "${GPU_CHECK_LIMIT:-290}" $PY -m bench.gpu_check --out "$OUT" "${pass[@]}" 2>"$OUT/gpu-check.err" | tee "$OUT/gpu-check.log"
rc=${PIPESTATUS[0]}
echo "gpu_check: exit $rc in $(( $(date +%s) - t0 ))s; table $OUT/gpu_check.md, log $OUT/gpu-check.log, errors $OUT/gpu-check.err"
[ $rc = 0 ] || tail -20 "$OUT/gpu-check.err"
if [ $smoke = 0 ]; then  # LoRA adapters' rows (bench/gpu_adapters.py): about a minute more
  timeout "${GPU_ADAPTERS_LIMIT:-120}" $PY -m bench.gpu_adapters --out "$OUT" 2>"$OUT/gpu-adapters.err" | tee -a "$OUT/gpu-check.log"
  echo "gpu_adapters: exit ${PIPESTATUS[0]}; rows $OUT/gpu_adapters.json, errors $OUT/gpu-adapters.err"
fi
exit $rc
