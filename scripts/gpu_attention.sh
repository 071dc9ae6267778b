#!/usr/bin/env bash
# GPU check of the flash-attention kernel on the device machine: its GPU tests, then
# bench/attention_gpu.py; logs go to $OUT (default ./gpu_out).
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
PY=${PY:-python3}
nproc; $PY -c 'import torch, triton; print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)'
XD=$($PY -c 'import xdist' 2>/dev/null && echo "-n 6")
timeout ${TEST_TIMEOUT:-150} $PY -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
  $XD tests/test_attention_gpu.py "$@" > "$OUT/pytest.log" 2>&1
rc=$?
tail -30 "$OUT/pytest.log"
timeout ${BENCH_TIMEOUT:-120} $PY bench/attention_gpu.py ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
cat "$OUT/bench.log" | tail -60
exit $rc
