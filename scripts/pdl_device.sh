#!/usr/bin/env bash
# GPU run for programmatic dependent launch (Options.cuda_pdl) and the decode path: the GPU
# tests of the decode / GEMV / LLM / generate / PDL files, then bench/llm_gpu.py with the
# PDL A/B row, then the per-kernel decode profile. Logs under $OUT, a short summary last.
# On the device machine, from the repository root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD; bash scripts/pdl_device.sh
# Knobs: TEST_TIMEOUT (240 s), BENCH_TIMEOUT (240 s), BENCH_ARGS, SKIP_TESTS=1.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
PY=${PY:-python3}
T=tests/targets/cuda
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-240} $PY -m pytest -m gpu -q -p no:cacheprovider -o addopts="" -n 4 \
    -rfE --tb=short $T/test_pdl.py $T/test_decode_gpu.py $T/test_gemv.py $T/test_quant_gemv.py \
    $T/test_llm_cuda.py $T/test_generate_cuda.py > "$OUT/pytest_gpu.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest_gpu.log"
fi
timeout ${BENCH_TIMEOUT:-240} $PY bench/llm_gpu.py --pdl-ab --repeat 30 ${BENCH_ARGS:-} \
  > "$OUT/bench_llm.log" 2>&1
timeout 100 $PY scripts/prof_decode.py 16 > "$OUT/prof.log" 2>&1
echo "== tests"; grep -E "passed|failed|^FAILED|^ERROR|rc=" "$OUT/pytest_gpu.log" | tail -15
echo "== bench"; grep -E "^kiln|^PDL|^eager|^\| llama|^model" "$OUT/bench_llm.log"
echo "== profile"; head -14 "$OUT/prof.log" | grep -v Warn
