#!/usr/bin/env bash
# device call 1: GPU tests on cores 2-15; CPU LLM/quant benches pinned to cores 0,1
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KILN_CACHE_DIR=/tmp/kiln_cache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nproc; nvidia-smi --query-gpu=name --format=csv,noheader
( taskset -c 0,1 timeout 520 python3 bench/llm_cpu.py --dtypes fp32,bf16 --threads 1,2 --rounds 3 --calls 6 --json $OUT/llm_cpu.json > $OUT/llm_cpu.log 2>&1 ) &
BG=$!
taskset -c 2-15 timeout 530 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" -n 6 tests/ > $OUT/pytest_gpu.log 2>&1
echo "pytest rc=$?"
wait $BG
grep -E "passed|failed" $OUT/pytest_gpu.log | tail -3
grep -E "^FAILED|^ERROR" $OUT/pytest_gpu.log | head -30
tail -12 $OUT/llm_cpu.log
