#!/usr/bin/env bash
# Tensor parallelism on the 2- or 4-GPU device machine (issue 18), under 9 minutes, from the
# repository root (the device tool's working directory):
#   bash bench/tp_device.sh          # logs under $OUT (default tp_out), the short table last
# 1. wheels from .whl/ (if any) into /tmp/site (no network);
# 2. in parallel: the CPU (MPI) TP tests, tests/runtime/test_tp.py (2 and 4 ranks; skipped
#    without Open MPI), and the CUDA TP tests, -m gpu tests/targets/cuda/test_tp_cuda.py (2 and 4 GPUs where present)
#    (every NCCL collective vs numpy with graph replays, the overlapped all_reduce vs float64
#    overlapped and serial, the TP Llama on 2 GPUs vs 1);
# 3. bench/tp_gpu.py: decode / prefill on 1 vs 2 GPUs (kiln, eager), the overlap of an
#    all_reduce with independent GEMMs (overlapped vs KILN_NCCL_SERIAL=1), all-reduce bus
#    bandwidth 1..256 MiB, kiln vs NCCL through torch.distributed; its time limit is what is
#    left of the budget.
# Env: PY (python3), WORLDS ("2": the GPU counts bench/tp_gpu.py runs, e.g. "4 2"), BUDGET_S (525: the whole script's seconds), TEST_TIMEOUT (300 s each
# pytest), BENCH_ARGS, SKIP_TESTS=1, SKIP_BENCH=1.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-tp_out}
mkdir -p "$OUT"
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-525}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1 \
    || echo "pip install of .whl/ failed (see $OUT/pip.log)"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
{ nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"gpus", torch.cuda.device_count())'
  $PY -c 'from kiln.runtime.comm import nccl_library_path as p; print("nccl", p())'
  echo "mpirun: $(command -v mpirun || echo none)  nproc: $(nproc)  git: $(git rev-parse --short HEAD 2>/dev/null)"
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  t0=$SECONDS
  timeout ${TEST_TIMEOUT:-300} $PY -m pytest -q -p no:cacheprovider -o addopts="" tests/runtime/test_tp.py -rs \
    >"$OUT/pytest_cpu.log" 2>&1 &
  cpu_pid=$!
  timeout ${TEST_TIMEOUT:-300} $PY -m pytest -q -p no:cacheprovider -o addopts="" -m gpu \
    tests/targets/cuda/test_tp_cuda.py -rs >"$OUT/pytest_gpu.log" 2>&1
  grc=$?
  wait $cpu_pid
  crc=$?
  echo "tests: $((SECONDS - t0)) s (cpu rc $crc, gpu rc $grc; 124: timed out)" | tee "$OUT/tests_rc.log"
  [ $grc -ne 0 ] && rc=$grc
  [ $crc -ne 0 ] && rc=$crc
fi
if [ -z "${SKIP_BENCH:-}" ]; then
  for world in ${WORLDS:-2}; do
    left=$((BUDGET_S - SECONDS - 10))
    [ $left -gt 330 ] && left=330
    if [ $left -lt 60 ]; then
      echo "bench (world $world) skipped: only ${left} s of the budget left" \
        | tee -a "$OUT/bench_tp.log"
      continue
    fi
    t0=$SECONDS
    timeout $left $PY bench/tp_gpu.py --world "$world" --out "$OUT/bench_work$world" \
      ${BENCH_ARGS:-} >>"$OUT/bench_tp.log" 2>&1
    brc=$?
    echo "bench world $world: $((SECONDS - t0)) s (rc $brc, limit $left s)"
    [ $rc -eq 0 ] && rc=$brc
  done
fi
tail_of() {  # pytest's last line, or why there is none
  local t
  t=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$1" 2>/dev/null | tail -1)
  echo "${t:-no result line (timed out or crashed; last lines: $(tail -c 300 "$1" 2>/dev/null | tr '\n' ' '))}"
}
{ echo "== summary ($SECONDS s)"
  cat "$OUT/tests_rc.log" 2>/dev/null
  echo "pytest cpu (MPI) tests/runtime/test_tp.py: $(tail_of "$OUT/pytest_cpu.log")"
  grep -E '^(FAILED|ERROR)' "$OUT/pytest_cpu.log" 2>/dev/null | head -5
  echo "pytest gpu tests/targets/cuda/test_tp_cuda.py: $(tail_of "$OUT/pytest_gpu.log")"
  grep -E '^(FAILED|ERROR)' "$OUT/pytest_gpu.log" 2>/dev/null | head -5
  sed -n '/^GPU:/,$p' "$OUT/bench_tp.log" | grep -v '^tp_gpu: ' 2>/dev/null
  grep -E '^tp_gpu: ' "$OUT/bench_tp.log" 2>/dev/null | head -5
} >"$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $rc
