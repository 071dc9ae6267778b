#!/usr/bin/env bash
# User Triton kernels on the device machine: the CPU-side tests (torch/Triton of that machine),
# the GPU tests, then the latency table (scripts/user_triton_bench.py). Logs go to $OUT.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
PY=${PY:-python3}
$PY -c 'import torch, triton, sys; print("torch", torch.__version__, "triton", triton.__version__, "python", sys.version.split()[0])' 2>&1 | tee "$OUT/env.log"
timeout ${TEST_TIMEOUT:-200} $PY -m pytest -q -p no:cacheprovider -o addopts="" \
  tests/test_user_triton.py tests/test_user_triton_gpu.py "$@" 2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
timeout ${BENCH_TIMEOUT:-120} $PY scripts/user_triton_bench.py 2>&1 | tee "$OUT/bench.log"
{ echo "== summary"; echo "pytest rc=$rc: $(tail -1 "$OUT/pytest.log")"
  sed -n '/^GPU:/,$p' "$OUT/bench.log"; } | tee "$OUT/summary.txt"
exit $rc
