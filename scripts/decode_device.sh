#!/usr/bin/env bash
# GPU run for the decode step's kernels (issue 17.3, branch s5dec): residual sums stored once
# as the o / down GEMVs' epilogue (passes/store_once.py), tiny kernels gathered across GEMMs
# (schedule's `tiny`), the rotary embedding and the KV-cache writes in one launch
# (schedule/puts.py): 6 kernels per Llama layer instead of 10.
# 1. pytest -m gpu on the decode / GEMV / LLM / generate test files, -k $TESTS (decode steps
#    of 1 and 4 tokens against a float32 eager reference, greedy tokens = eager, the
#    decoder-sized GEMV modules against float64, the package's whole-cache-copy check);
# 2. bench/llm_gpu.py --no-compile --repeat 30 (Llama 16 x 2048 bf16, static cache 256):
#    ms/token, kernels/token and kiln / roofline; then, while the budget lasts, the same with
#    torch.compile(mode="reduce-overhead") next to it (RO=0 skips it).
# Logs under $OUT, a short table last. On the device machine, from the worktree root
# (< 6 minutes on an H200):
#   export PYTHONPATH=$PWD; bash scripts/decode_device.sh
# Knobs: PY (python3), TESTS (pytest -k; "" for every GPU test of the four files, about twice
# the time), BENCH_ARGS (llm_gpu.py, e.g. "--layers 4"), TEST_TIMEOUT (210 s), BENCH_TIMEOUT
# (120 s), RO_TIMEOUT (140 s; run only when under 200 s have passed), RO=0, SKIP_TESTS=1,
# SKIP_BENCH=1.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  echo "git: $(git rev-parse --short HEAD 2>/dev/null)"; uptime; } 2>&1 | tee "$OUT/env.log"
t0=$SECONDS
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-210} $PY -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
    tests/targets/cuda/test_decode_gpu.py tests/targets/cuda/test_gemv.py \
    tests/targets/cuda/test_llm_cuda.py tests/targets/cuda/test_generate_cuda.py \
    -k "${TESTS-steps_match_eager or whole_cache or greedy or big or gemvs_match_eager}" 2>&1 \
    | grep -v "^DEBUG" | tee "$OUT/pytest_gpu.log" | tail -30
  rc=${PIPESTATUS[0]}
fi
t1=$SECONDS
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-120} $PY bench/llm_gpu.py --no-compile --repeat 30 ${BENCH_ARGS:-} \
    2>&1 | grep -v "^DEBUG" | tee "$OUT/bench_llm.log" | tail -8
  if [ "${RO:-1}" != 0 ] && [ $((SECONDS - t0)) -lt 200 ]; then  # reduce-overhead too
    timeout ${RO_TIMEOUT:-140} $PY bench/llm_gpu.py --repeat 30 ${BENCH_ARGS:-} 2>&1 \
      | grep -v "^DEBUG" | tee "$OUT/bench_llm_ro.log" | tail -8
  fi
fi
t2=$SECONDS
echo "== summary: pytest -m gpu rc=$rc ($((t1 - t0)) s): $(tail -1 "$OUT/pytest_gpu.log" 2>/dev/null); bench $((t2 - t1)) s"
grep -E "^kiln:" "$OUT/bench_llm.log" 2>/dev/null
grep -E "^\| (llama|model)|^\|---" "$OUT/bench_llm.log" 2>/dev/null
grep -E "^\| llama" "$OUT/bench_llm_ro.log" 2>/dev/null | sed 's/^/(with reduce-overhead) /'
exit $rc
