#!/usr/bin/env bash
# The CUDA coverage kernels on the GPU machine (issue 16): the `-m gpu` tests of the files that
# moved ops off ATen on CUDA (sorts, the merge sort, masked_scatter / embedding_bag, accumulating
# scatters, unique, complex masks), every test's result named (-rA), then bench/sort_gpu.py's
# cases named by BENCH_ONLY (';'-separated). Logs to $OUT (default ./cov_out); each phase
# stopped at its timeout.
#   [TEST_TIMEOUT=150] [BENCH_TIMEOUT=60] [BENCH_ONLY='unique'] [JOBS=12] [PY=python3]
#   [TESTS='file ...'] scripts/cov_device.sh
set -u
OUT=${OUT:-cov_out}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
D=tests/targets/cuda
TESTS=${TESTS:-"$D/test_cuda_unique.py $D/test_cuda_mask_complex.py $D/test_cuda_sort_merge.py \
$D/test_cuda_sort_cov.py $D/test_cuda_bag_mask.py $D/test_cuda_put_reduce.py"}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
} 2>&1 | tee "$OUT/env.log"
t0=$(date +%s)
# shellcheck disable=SC2086
timeout "${TEST_TIMEOUT:-150}" $PY -m pytest -m gpu -rA -p no:cacheprovider -o addopts="" \
  -n "${JOBS:-12}" $TESTS > "$OUT/pytest.log" 2>&1
rc=$?
t1=$(date +%s)
timeout "${BENCH_TIMEOUT:-60}" $PY bench/sort_gpu.py --repeat 10 --only "${BENCH_ONLY:-unique}" \
  > "$OUT/bench.log" 2>&1
t2=$(date +%s)
echo "== tests rc=$rc ($((t1 - t0)) s)"
grep -E '^(PASSED|FAILED|ERROR|SKIPPED)' "$OUT/pytest.log" | sort | uniq -c | sort -rn | head -60
tail -1 "$OUT/pytest.log"
echo "== bench ($((t2 - t1)) s)"
grep '^|' "$OUT/bench.log"
