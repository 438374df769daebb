#!/usr/bin/env bash
# The fixed-cost work (issue 26) on a lent GPU machine, in one go (about 5 minutes): the CUDA
# tests and the tests of the usual step, then on the host CPU the A/B of two trees
# (fixed_cost_ab.py, when BEFORE names a tree) and one fixed_cost.py run with its breakdown.
# Run from the repository root; everything lands under $OUT (default runs/fixed_cost_device).
#
#   git archive cd23712 src | tar -x -C .ab/before        # the "before" tree, carried
#   BEFORE=.ab/before/src OUT=/some/dir bash benchmarks/fixed_cost_device.sh
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-runs/fixed_cost_device}"
PY="${PY:-python3}"
PIN="${PIN:-3}"
mkdir -p "$OUT"
status=0

{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version --format=csv || echo "no nvidia-smi"
    grep -m1 "model name" /proc/cpuinfo
    "$PY" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__,
"cuda available", torch.cuda.is_available())'
} >"$OUT/env.txt" 2>&1

echo "== tests (CUDA, the usual step, the hot path)"
timeout "${TEST_TIMEOUT:-200}" "$PY" -m pytest -q -p no:cacheprovider -x \
    tests/unit/test_cuda.py tests/unit/test_lone.py tests/unit/test_local_row.py \
    tests/unit/test_hot_path.py tests/unit/test_history.py tests/unit/test_rng_snapshot.py \
    >"$OUT/tests.log" 2>&1 || { echo "tests: exit $?"; status=1; }
tail -3 "$OUT/tests.log"

if [ -n "${BEFORE:-}" ]; then
    echo "== A/B on the host CPU: $BEFORE vs src"
    timeout "${AB_TIMEOUT:-300}" "$PY" benchmarks/fixed_cost_ab.py --before "$BEFORE" \
        --after src --pairs "${PAIRS:-3}" --rounds "${ROUNDS:-16}" --pin "$PIN" \
        --label device-host --out "$OUT/fixed_cost_ab.json" 2>&1 | tee "$OUT/ab.log" \
        || { echo "ab: exit $?"; status=1; }
fi

echo "== fixed_cost.py (host CPU, breakdown)"
timeout "${BENCH_TIMEOUT:-120}" "$PY" benchmarks/fixed_cost.py --pin "$PIN" --rounds 24 \
    --label device-host --out "$OUT/fixed_cost.json" 2>&1 | tee "$OUT/fixed_cost.log" \
    || { echo "fixed_cost: exit $?"; status=1; }

echo "== done, status $status"
exit "$status"
