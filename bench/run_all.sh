#!/usr/bin/env bash
# Runs every benchmark once and prints one summary line each (also saved to bench/results.txt).
#   bash bench/run_all.sh [--smoke]
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup --dev >/dev/null
.venv/bin/python -m pip install -q -r bench/requirements.txt
# P2's load generator (a bench tool, not a test need); P2 falls back to a Python client without it.
command -v wrk >/dev/null || { apt-get install -y -qq wrk >/dev/null 2>&1 || echo "bench: wrk not installed; P2 uses its Python client"; }
.venv/bin/python -m songserve.pipeline.tiny >/dev/null
out=bench/results.txt
: >"$out"
for script in $(ls bench/p[0-9]*_*.py | sort -V); do
  name=$(basename "$script" .py)
  .venv/bin/python -m "bench.$name" "$@" 2>"/tmp/songserve-$name.err" | tee -a "$out" \
    || echo "$name failed: see /tmp/songserve-$name.err" | tee -a "$out"
done
