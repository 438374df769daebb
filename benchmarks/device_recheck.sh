#!/usr/bin/env bash
# The whole project re-checked on a lent GPU machine in one call (about 8 minutes), for a
# session that is lent one after the code moved on: the CUDA tests and the tests of the
# usual step; the unit and CLI suites with a CUDA device visible (paths that branch on
# torch.cuda.is_available()); benchmarks/gpu_features.py (what each feature costs on a
# GPU-bound step); benchmarks/fixed_cost.py on the host CPU (issue 26's tiny model).
# Run from the repository root; everything lands under $OUT (default runs/device_recheck),
# flat, at most 8 files. A part that fails does not stop the next.
#
#   OUT=/some/dir bash benchmarks/device_recheck.sh
#   GPU_ARGS="--device cpu --quick" SUITE_TIMEOUT=60 bash benchmarks/device_recheck.sh  # smoke
set -u -o pipefail
export PYTHONUNBUFFERED=1
OUT="${OUT:-runs/device_recheck}"
PY="${PY:-python3}"
mkdir -p "$OUT"
status=0

# The machine has no registry: install the checkout itself (no dependencies, the image's
# torch), so that the console script the CLI tests call exists; else fall back to src/.
"$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . >"$OUT/install.log" 2>&1 \
    || export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"

{
    date -u +%FT%TZ
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || echo "no nvidia-smi"
    grep -m1 "model name" /proc/cpuinfo
    nproc
    "$PY" -c 'import sys, torch, trainguard; print(sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
"trainguard", trainguard.__version__, trainguard.__file__)'
    tail -3 "$OUT/install.log"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== CUDA tests and the usual step's tests"
timeout "${TEST_TIMEOUT:-150}" "$PY" -m pytest -q -p no:cacheprovider \
    tests/unit/test_cuda.py tests/unit/test_lone.py tests/unit/test_local_row.py \
    tests/unit/test_hot_path.py tests/unit/test_history.py tests/unit/test_rng_snapshot.py \
    tests/unit/test_skip_fidelity.py tests/unit/test_replay_fidelity.py \
    >"$OUT/tests_cuda.log" 2>&1 || { echo "cuda tests: exit $?"; status=1; }
tail -4 "$OUT/tests_cuda.log"

echo "== tests/unit and tests/cli with CUDA visible"
# test_install builds a fresh venv from a registry, which this machine cannot reach.
timeout "${SUITE_TIMEOUT:-170}" "$PY" -m pytest -q -p no:cacheprovider -n "${WORKERS:-12}" \
    tests/unit tests/cli --deselect tests/cli/test_install.py --timeout 100 \
    >"$OUT/suite.log" 2>&1 || { echo "suite: exit $?"; status=1; }
grep -E "^(FAILED|ERROR)" "$OUT/suite.log" | head -20
tail -2 "$OUT/suite.log"

echo "== benchmarks/gpu_features.py"
# shellcheck disable=SC2086  # GPU_ARGS is a list of options
timeout "${GPU_TIMEOUT:-300}" "$PY" benchmarks/gpu_features.py --out "$OUT/gpu_features.json" \
    ${GPU_ARGS:---budget-s 250} >"$OUT/gpu_features.log" 2>&1 \
    || { echo "gpu_features: exit $?"; status=1; }
sed -n '/^| run/,/^$/p' "$OUT/gpu_features.log"

echo "== benchmarks/fixed_cost.py (host CPU)"
timeout "${FIXED_TIMEOUT:-100}" "$PY" benchmarks/fixed_cost.py --pin "${PIN:-3}" \
    --rounds "${ROUNDS:-12}" --label device-host --out "$OUT/fixed_cost.json" \
    >"$OUT/fixed_cost.log" 2>&1 || { echo "fixed_cost: exit $?"; status=1; }
head -13 "$OUT/fixed_cost.log"

echo "== done, status $status"
exit "$status"
