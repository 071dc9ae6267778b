#!/usr/bin/env bash
# Decode on the GPU (issue 17, branch s3dec), one device run of < 9 minutes: the decode GPU
# tests, the per-kernel profile of the 16 x 2048 Llama step (scripts/prof_decode.py) and
# bench/llm_gpu.py; logs under $OUT, a short table last.
#   OUT=... scripts/dec_device.sh   (SKIP_TESTS=1 / SKIP_PROF=1 / SKIP_BENCH=1; AT=1: the bench
#                                    also times a max_autotune package, a longer compile)
set -u
OUT=${OUT:-dec_out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  git log --oneline -1 2>/dev/null; } 2>&1 | tee "$OUT/env.log"
t0=$(date +%s); rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  workers=$(python3 -c 'import xdist' 2>/dev/null && echo "-n ${GPU_WORKERS:-4}")
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
    $workers tests/targets/cuda/test_decode_gpu.py tests/targets/cuda/test_llm_cuda.py \
    tests/targets/cuda/test_attention_gpu.py 2>&1 | tee "$OUT/pytest_gpu.log"
  rc=${PIPESTATUS[0]}
fi
t1=$(date +%s)
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-210} python3 bench/llm_gpu.py --repeat 50 ${AT:+--max-autotune} 2>&1 | grep -v Warning \
    | tee "$OUT/llm_gpu.log"
fi
t2=$(date +%s)
if [ -z "${SKIP_PROF:-}" ]; then
  timeout ${PROF_TIMEOUT:-100} python3 scripts/prof_decode.py 2>&1 | grep -v Warning \
    | tee "$OUT/prof_decode.log"
fi
t3=$(date +%s)
{ echo "== summary ($(cat "$OUT/env.log" | head -1))"
  echo "pytest -m gpu (decode, llm, attention): rc=$rc ($((t1 - t0)) s): $(tail -1 "$OUT/pytest_gpu.log" 2>/dev/null)"
  echo "profile ($((t3 - t2)) s): $(grep -E '^compile s|^kernels/token' "$OUT/prof_decode.log" 2>/dev/null | tr '\n' ' ')"
  echo "bench ($((t2 - t1)) s):"; sed -n '/^GPU:/,$p' "$OUT/llm_gpu.log" 2>/dev/null
} | tee "$OUT/summary.txt"
exit $rc
