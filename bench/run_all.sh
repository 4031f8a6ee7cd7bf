#!/usr/bin/env bash
# Runs every benchmark once and prints one summary line each (also saved to bench/results.txt).
#   bash bench/run_all.sh [--smoke]
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup --dev >/dev/null
.venv/bin/python -m pip install -q -r bench/requirements.txt
# P2's and P11's load generator (a bench tool, not a test need); they fall back to a Python client without it.
command -v wrk >/dev/null || { apt-get install -y -qq wrk >/dev/null 2>&1 || echo "bench: wrk not installed; P2/P11 use their Python client"; }
# P11's PostgreSQL (a throw-away server, tests/support/pg.py); without it P11 measures its SQLite parts alone.
if ! command -v initdb >/dev/null && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null 2>&1 \
    || echo "bench: postgresql not installed; P11 measures SQLite alone"
fi
.venv/bin/python -m songserve.pipeline.tiny >/dev/null
out=bench/results.txt
: >"$out"
for script in $(ls bench/p[0-9]*_*.py | sort -V); do
  name=$(basename "$script" .py)
  .venv/bin/python -m "bench.$name" "$@" 2>"/tmp/songserve-$name.err" | tee -a "$out" \
    || echo "$name failed: see /tmp/songserve-$name.err" | tee -a "$out"
done
