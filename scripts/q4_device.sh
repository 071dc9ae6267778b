#!/usr/bin/env bash
# One device call for the quantised decode GEMVs (issue 17, s13q4): the quantised GEMV GPU
# tests, then the per-kernel decode profile (scripts/prof_quant_decode.py, 2 layers of the
# Llama-3-8B widths) of bf16 / int8 / int4 and of int4 with the template's previous int4 loop
# (KILN_GEMV_INT4=nib) for an A/B on the same machine. Logs under $OUT, a short table last.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site; bash scripts/q4_device.sh
# Knobs: SKIP_TESTS=1, MODES (default none,int8,int4), AB (default nib: the A/B run's
# KILN_GEMV_INT4; empty: none), LAYERS (default 2).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PY:-python3}
W="4096 14336 32 8 128256"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } 2>&1 | tee "$OUT/env.log"
t0=$(date +%s)
if [ -z "${SKIP_TESTS:-}" ]; then
  KILN_CACHE_DIR=/tmp/kc_t timeout ${TEST_TIMEOUT:-100} $PY -m pytest -m gpu -q -n 8 \
    -p no:cacheprovider -o addopts="" tests/targets/cuda/test_quant_gemv.py \
    tests/targets/cuda/test_quant_cuda.py 2>&1 | grep -v "^DEBUG" > "$OUT/pytest_gpu.log"
fi
t1=$(date +%s)
KILN_CACHE_DIR=/tmp/kc_x timeout ${PROF_TIMEOUT:-170} $PY scripts/prof_quant_decode.py \
  ${LAYERS:-2} $W ${MODES:-none,int8,int4} 2>&1 | grep -v "^DEBUG\|Warning\|warn" > "$OUT/prof.log"
t2=$(date +%s)
if [ -n "${AB-nib}" ]; then
  KILN_GEMV_INT4=${AB:-nib} KILN_CACHE_DIR=/tmp/kc_n timeout ${AB_TIMEOUT:-80} $PY \
    scripts/prof_quant_decode.py ${LAYERS:-2} $W int4 2>&1 | grep -v "^DEBUG\|Warning\|warn" \
    > "$OUT/prof_ab.log"
fi
t3=$(date +%s)
echo "== tests $((t1 - t0)) s, prof $((t2 - t1)) s, A/B $((t3 - t2)) s"
grep -h "^== \|us/token \[" "$OUT/prof.log" "$OUT/prof_ab.log" 2>/dev/null | cut -c1-110
echo "== pytest: $(tail -1 "$OUT/pytest_gpu.log" 2>/dev/null)"
