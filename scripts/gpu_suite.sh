#!/usr/bin/env bash
# The GPU test suite in lanes: each lane runs its files one after another (one pytest process,
# at most LANE_N workers), lanes run side by side, every lane under its own time limit, so a slow
# file cannot hide the results of the others. Logs per lane under $OUT, a table of counts last.
# On the device machine, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD; bash scripts/gpu_suite.sh
# Knobs: LANE_TIMEOUT (s, default 480), LANE_N (pytest -n for every lane; default per lane, NW),
#        MARK (default "gpu and not slow"), LANES (lane names to run, default all),
#        GPUS (e.g. "1 2 3": lane i runs on GPU i mod n through CUDA_VISIBLE_DEVICES; default:
#        every lane sees every GPU). Not in a lane: tests/gemm/test_autotune_gpu.py (max_autotune
#        with CUTLASS candidates: nvcc builds, minutes per test; run it on its own).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
PY=${PY:-python3}
T=tests/targets/cuda
declare -A LANE=(
  [conv]="$T/test_conv_nhwc_gpu.py"
  [cuda]="$T/test_cuda.py"
  [attn]="$T/test_user_triton_gpu.py $T/test_decode_gpu.py $T/test_attention_gpu.py $T/test_gemv.py"
  [misc]="tests/gemm/test_blas_lt.py tests/gemm/test_gemm_tma.py tests/gemm/test_gemm_mixed.py $T/test_lowp_gpu.py $T/test_quant_cuda.py $T/test_cuda_dds.py $T/test_float8_fnuz_cuda.py tests/ops/test_ops_random.py tests/frontend/test_control_flow.py"
  [state]="$T/test_cuda_unbounded.py $T/test_tp_cuda.py $T/test_generate_cuda.py $T/test_cuda_multi.py $T/test_profile_gpu.py $T/test_llm_cuda.py"
  [hf]="tests/e2e/test_hf_corpus.py"
)
declare -A NW=([conv]=3 [cuda]=2 [attn]=2 [misc]=1 [state]=1 [hf]=2)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.log" 2>&1
$PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' >> "$OUT/env.log" 2>&1
gpus=(${GPUS:-})
i=0
for name in ${LANES:-conv cuda attn misc state hf}; do
  if [ ${#gpus[@]} -gt 0 ]; then export CUDA_VISIBLE_DEVICES=${gpus[$((i % ${#gpus[@]}))]}; fi
  i=$((i + 1))
  ( timeout ${LANE_TIMEOUT:-480} $PY -m pytest -m "${MARK:-gpu and not slow}" -p no:cacheprovider \
      -o addopts="" -n ${LANE_N:-${NW[$name]}} -rfE --tb=short --durations=5 ${LANE[$name]} \
      > "$OUT/lane_$name.log" 2>&1; echo "rc=$?" >> "$OUT/lane_$name.log" ) &
done
wait
echo "== lane summary"
for name in ${LANES:-conv cuda attn misc state hf}; do
  printf '%-6s %s | %s\n' "$name" "$(grep -E '^(=+ .*(passed|failed|error).* =+)$' "$OUT/lane_$name.log" | tail -1)" "$(tail -1 "$OUT/lane_$name.log")"
done
echo "== failures"
grep -hE "^(FAILED|ERROR) " "$OUT"/lane_*.log | cut -c1-240 | head -80
