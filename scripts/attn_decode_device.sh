#!/usr/bin/env bash
# GPU run for the attention template's decode path (issue 17, branch s6att): GQA heads packed
# per kv head, keys split among programs with a combine kernel, masked key tiles skipped.
# 1. pytest -m gpu on the attention and decode-step GPU files, -k $TESTS (default: the decode
#    path against a float64 reference at Llama's shapes, S 37 .. 8192, the tuned split; the
#    flash path's variants and fully masked rows; the bf16 tiny-Llama steps and the
#    Llama-shaped 32 / 4-head step over a 256 cache; TESTS="" runs both files whole, about
#    twice the time);
# 2. bench/attention_gpu.py --decode: the attention alone, CUDA-graph replays, against eager
#    SDPA with the mask and on the filled keys, and the memory floor;
# 3. scripts/prof_decode.py 16: the 16 x 2048 Llama step's per-kernel device time (the
#    attention line was 16 x 7.43 us).
# Logs under $OUT, a summary last. On the device machine, from the worktree root; in two
# calls of under 10 minutes: SKIP_BENCH=1 SKIP_PROF=1, then SKIP_TESTS=1:
#   bash scripts/attn_decode_device.sh   (TESTS=..., SKIP_TESTS=1 / SKIP_BENCH=1 / SKIP_PROF=1)
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
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-300} $PY -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
    tests/targets/cuda/test_attention_gpu.py tests/targets/cuda/test_decode_gpu.py \
    -k "${TESTS-decode_path or variant or fully_masked or llama_shaped or whole_cache or (steps_match_eager and bf16)}" 2>&1 \
    | grep -v "^DEBUG" | tee "$OUT/pytest_gpu.log" | tail -30
  rc=${PIPESTATUS[0]}
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-150} $PY bench/attention_gpu.py --decode --repeat 30 2>&1 \
    | grep -v "^DEBUG" | tee "$OUT/bench_attn_decode.log" | tail -14
fi
if [ -z "${SKIP_PROF:-}" ]; then
  timeout ${PROF_TIMEOUT:-240} $PY scripts/prof_decode.py 16 2>&1 | grep -v "^DEBUG" \
    | tee "$OUT/prof_decode.log" | head -20
fi
echo "== summary: pytest -m gpu rc=$rc: $(tail -1 "$OUT/pytest_gpu.log" 2>/dev/null)"
grep -E "attn_" "$OUT/prof_decode.log" 2>/dev/null
exit $rc
