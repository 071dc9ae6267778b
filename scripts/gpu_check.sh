#!/usr/bin/env bash
# One-shot GPU check for the device machine: the GPU tests, then the GPU benchmark; logs and
# a summary go to $OUT (default ./gpu_out). Uses the machine's python3 (torch, Triton) and
# this checkout on PYTHONPATH (no install, no network).
#   [BENCH_ARGS="--no-compile"] [SKIP_TESTS=1] [SKIP_BENCH=1] scripts/gpu_check.sh [pytest args...]
# Every `-m gpu` test of tests/ runs (GPU_WORKERS pytest-xdist workers share the GPU).
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$OUT/env.log"
t0=$(date +%s)
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  workers=$($PY -c 'import xdist' 2>/dev/null && echo "-n ${GPU_WORKERS:-4}")
  timeout ${TEST_TIMEOUT:-420} $PY -m pytest -m gpu -q -p no:cacheprovider -o addopts="" $workers \
    "${@:-tests/}" 2>&1 | tee "$OUT/pytest_gpu.log"
  rc=${PIPESTATUS[0]}
fi
t1=$(date +%s)
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-420} $PY bench/gpu.py --repeat 50 ${BENCH_ARGS:-} --markdown "$OUT/BENCHMARKS_gpu.md" 2>&1 \
    | tee "$OUT/bench_gpu.log"
fi
t2=$(date +%s)
{ echo "== summary"; echo "pytest -m gpu: rc=$rc ($((t1 - t0)) s): $(tail -1 "$OUT/pytest_gpu.log" 2>/dev/null)"
  echo "bench ($((t2 - t1)) s):"; sed -n '/^GPU:/,$p' "$OUT/bench_gpu.log" 2>/dev/null; } | tee "$OUT/summary.txt"
exit $rc
