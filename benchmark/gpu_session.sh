#!/usr/bin/env bash
# One GPU session in one call: install, test, check, tune, benchmark; logs under $OUT.
#   bash benchmark/gpu_session.sh [ops-to-tune...]    (SKIP_TESTS=1 skips pytest and the main job,
#   NO_BENCH=1 the benchmark, FULL=1 runs every shape instead of the headline ones (either run
#   times the backward kernels too), EXPERIMENT="a b" runs benchmark/experiments/a.py and b.py first,
#   JOBS the pytest processes, 14 by default: the whole suite in ~6 minutes on the H200)
# Peers come from .whl/ when present (docs/notes/interpreter.md). At most 8 files land in $OUT, so
# no plots: `python -m benchmark.readme $OUT/bench/results.json --plots DIR` draws them anywhere.
set -u -o pipefail
OUT=${OUT:-/tmp/gemslib_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python -m pip install -q --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
{
  python -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | grep -v "Running pip as"
  python -c "import gemslib.ops.silu, sys; print(sys.executable, gemslib.__file__)" || exit 1
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
} > "$OUT/env.log" 2>&1 || { cat "$OUT/env.log"; exit 1; }
cat "$OUT/env.log"
status=0
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # bounded: a kernel that hangs (a cross-program wait gone wrong) must not eat the whole call
  timeout "${TEST_TIMEOUT:-440}" python -m pytest -q -n "${JOBS:-14}" -p no:cacheprovider \
    --durations=15 2>&1 \
    | tee "$OUT/pytest.log" | tail -35 || status=1
  python -m gemslib 2>&1 | tee "$OUT/main.log" || status=1
fi
for experiment in ${EXPERIMENT:-}; do  # a space-separated list
  python -m "benchmark.experiments.$experiment" 2>&1 | tee "$OUT/experiment_$experiment.log"
done
if [ "$#" -gt 0 ]; then  # the tuned file lands in $OUT; the benchmark below runs with it
  timeout "${TUNE_TIMEOUT:-540}" python -m gemslib.tune --ops "$@" --out "$OUT/tuned.yaml" 2>&1 \
    | tee "$OUT/tune.log" && export GEMSLIB_TUNE_CONFIG="$OUT/tuned.yaml"
fi
if [ "${NO_BENCH:-0}" = 1 ]; then
  :
elif [ "${FULL:-0}" = 1 ]; then  # every shape
  python -m benchmark --no-plot --out "$OUT/full" 2>&1 | tee "$OUT/bench.log" || status=1
else
  python -m benchmark --quick --no-plot --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" || status=1
fi
exit $status
