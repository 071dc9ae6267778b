#!/usr/bin/env bash
# The sort kernels on the GPU machine (s17cov, issue 16): the `-m gpu` tests of the merge sort
# and 64-bit sorts (tests/targets/cuda/test_cuda_sort_merge.py) and the one-tile sorts of
# test_cuda_sort_cov.py, then bench/sort_gpu.py (kiln against eager torch.sort / topk /
# median). Logs to $OUT (default ./sort_out); each phase stopped at its timeout.
#   [TEST_TIMEOUT=110] [BENCH_TIMEOUT=80] [BENCH_ONLY='a;b'] [PY=python3] scripts/sort_device.sh
set -u
OUT=${OUT:-sort_out}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$OUT/env.log"
t0=$(date +%s)
timeout "${TEST_TIMEOUT:-110}" $PY -m pytest -m gpu -v -p no:cacheprovider -o addopts="" -n 8 \
  tests/targets/cuda/test_cuda_sort_merge.py \
  "tests/targets/cuda/test_cuda_sort_cov.py::test_gpu_sorts_match_eager" \
  2>&1 | tee "$OUT/pytest.log"
rc=${PIPESTATUS[0]}
t1=$(date +%s)
timeout "${BENCH_TIMEOUT:-80}" $PY bench/sort_gpu.py --repeat 10 --only "${BENCH_ONLY:-}" 2>&1 \
  | tee "$OUT/bench.log"
t2=$(date +%s)
echo "== tests rc=$rc ($((t1 - t0)) s): $(tail -1 "$OUT/pytest.log")"
echo "== bench ($((t2 - t1)) s)"
grep '^|' "$OUT/bench.log"
