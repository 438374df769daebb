#!/usr/bin/env bash
# Issue 28 on a lent GPU machine, in one go (about 8 minutes): the CUDA tests, then
# benchmarks/gpu_features.py. Run from the repository root; every part logs under $OUT
# (default runs/gpu_session), and a part that fails does not stop the next.
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh
#   BENCH_ARGS="--device cpu --quick" TEST_TIMEOUT=60 bash benchmarks/gpu_session.sh  # smoke
set -u -o pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-runs/gpu_session}"
PY="${PY:-python3}"
mkdir -p "$OUT"
status=0

{
    date -u +%FT%TZ
    nvidia-smi || echo "no nvidia-smi"
    "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"available", torch.cuda.is_available())'
} >"$OUT/env.txt" 2>&1

echo "== tests/unit/test_cuda.py"
timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_cuda.py \
    2>&1 | tee "$OUT/tests.log" || { echo "tests: exit $?"; status=1; }

echo "== benchmarks/gpu_features.py"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of options
timeout "${BENCH_TIMEOUT:-360}" "$PY" benchmarks/gpu_features.py --out "$OUT/gpu_features.json" \
    ${BENCH_ARGS:---budget-s 320} 2>&1 | tee "$OUT/gpu_features.log" \
    || { echo "gpu_features: exit $?"; status=1; }

echo "== done, status $status"
exit "$status"
