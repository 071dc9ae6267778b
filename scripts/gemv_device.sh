#!/usr/bin/env bash
# GPU run for the GEMV template (issue 17.3, branch s4gemv): the GPU tests of the GEMV
# (tests/targets/cuda/test_gemv.py -m gpu: modules and decode steps against float64 / eager)
# and the decode package's kernel list (test_decode_gpu.py), then bench/llm_gpu.py (decode
# ms/token, roofline, kernels/token; torch.compile skipped) and scripts/gemv_bench.py (the
# GEMV alone vs cuBLAS F.linear in GB/s at the Llama 16x2048 merged shapes, and the decode
# step's A/B: GEMVs vs cuBLAS-only, ms/token and kernels). Logs under $OUT, a short table last.
# On the device machine, from the worktree root (< 6 minutes):
#   export PYTHONPATH=$PWD; bash scripts/gemv_device.sh
# Knobs: BENCH_ARGS (llm_gpu.py, e.g. "--layers 4"), GEMV_ARGS (gemv_bench.py), SKIP_TESTS=1,
# SKIP_BENCH=1.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  uptime; } 2>&1 | tee "$OUT/env.log"
t0=$(date +%s)
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-120} $PY -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
    tests/targets/cuda/test_gemv.py tests/targets/cuda/test_decode_gpu.py \
    -k "gemv or whole_cache or (steps_match_eager and (bf16 or fp16))" 2>&1 | grep -v "^DEBUG" | tee "$OUT/pytest_gpu.log" | tail -30
  rc=${PIPESTATUS[0]}
fi
t1=$(date +%s)
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-120} $PY bench/llm_gpu.py --no-compile --repeat 30 ${BENCH_ARGS:-} \
    2>&1 | grep -v "^DEBUG" | tee "$OUT/bench_llm.log" | tail -8
  timeout ${GEMV_TIMEOUT:-120} $PY scripts/gemv_bench.py ${GEMV_ARGS:-} 2>&1 \
    | grep -v "^DEBUG" | tee "$OUT/bench_gemv.log" | tail -16
fi
t2=$(date +%s)
echo "== summary: pytest -m gpu rc=$rc ($((t1 - t0)) s): $(tail -1 "$OUT/pytest_gpu.log" 2>/dev/null); bench $((t2 - t1)) s"
grep -E "^\| (llama|model)" "$OUT/bench_llm.log" 2>/dev/null
grep -E "^\||^decode step" "$OUT/bench_gemv.log" 2>/dev/null
