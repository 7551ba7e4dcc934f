#!/usr/bin/env bash
# One GPU session in one call: install, test, check, sweep, benchmark; logs under $OUT.
#   bash benchmark/gpu_session.sh [sweep-ops...]
# Peers come from .whl/ when present (see README, "Benchmarks").
set -u -o pipefail
OUT=${OUT:-/tmp/gemslib_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  pip install -q --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$OUT/gpu.txt"
status=0
python -m pytest -q -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -15 || status=1
python -m gemslib 2>&1 | tee "$OUT/main.log" || status=1
for op in "$@"; do
  python -m benchmark.sweep "$op" --out "$OUT/sweep_$op.json" 2>&1 | tee "$OUT/sweep_$op.log"
done
python -m benchmark --quick --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" || status=1
exit $status
