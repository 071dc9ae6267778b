#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU machine (issue 18), in one command from the repository root:
#   bash scripts/tp_gpu_check.sh            # OUT=tp_out by default; logs and summary there
# 1. the GPU tests of the TP packages (pytest -m gpu tests/targets/cuda/test_tp_cuda.py: each
#    NCCL collective vs numpy on 2 ranks, the TP Llama decoder on 2 GPUs vs 1: logits, tokens)
#    and the CPU (MPI) ones when Open MPI is installed (tests/runtime/test_tp.py; else skipped);
# 2. bench/tp_gpu.py: decode latency and prefill tokens/s on 1 vs 2 GPUs (kiln and torch
#    eager with the same collectives), all-reduce bus bandwidth 1..256 MiB vs NCCL direct.
# Needs: this checkout (on PYTHONPATH, no install), python3 with torch (its nvidia-nccl wheel
# gives libnccl.so.2), triton, numpy, sympy, safetensors; a C++ compiler. No network.
# Env: PY (default python3), BENCH_ARGS (e.g. "--dtype float32 --layers 2"), SKIP_TESTS=1,
# SKIP_BENCH=1, NCCL_NVLS_ENABLE (default 0: NVLink multicast off).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-tp_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
PY=${PY:-python3}
{ nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"gpus", torch.cuda.device_count())'
  $PY -c 'from kiln.runtime.comm import nccl_library_path as p; print("nccl", p())'
} 2>&1 | tee "$OUT/env.log"
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-900} $PY -m pytest -q -p no:cacheprovider -o addopts="" -m "gpu or not slow" \
    tests/targets/cuda/test_tp_cuda.py tests/runtime/test_tp.py -rs 2>&1 | tee "$OUT/pytest_tp.log"
  rc=${PIPESTATUS[0]}
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  timeout ${BENCH_TIMEOUT:-1500} $PY bench/tp_gpu.py --out "$OUT/bench_work" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench_tp.log"
  brc=${PIPESTATUS[0]}
  [ $rc -eq 0 ] && rc=$brc
fi
{ echo "== summary"
  echo "pytest: $(grep -E '(passed|failed|error)' "$OUT/pytest_tp.log" 2>/dev/null | tail -1)"
  sed -n '/^GPU:/,$p' "$OUT/bench_tp.log" 2>/dev/null; } | tee "$OUT/summary.txt"
exit $rc
