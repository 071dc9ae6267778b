#!/usr/bin/env bash
# session 6, device call 2 (4-GPU kind): the fuzzer at scale on cores 8-63 and GPUs 1-3,
# beside GPU tests + decode bench of the GEMV tuning on GPU 0 (cores 0-5)
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl2/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nproc > $OUT/nproc.txt; nvidia-smi -L >> $OUT/nproc.txt
( CUDA_VISIBLE_DEVICES=1,2,3 OUT=$OUT/fuzz N_CPU=10000 N_CUDA=1000 CPU_PROCS=$(( $(nproc) - 10 )) CUDA_PROCS=8 \
  TIME_LIMIT=${FUZZ_LIMIT:-420} taskset -c 8-$(( $(nproc) - 1 )) bash scripts/fuzz_device.sh > $OUT/fuzz.log 2>&1 ) &
( export CUDA_VISIBLE_DEVICES=0 KILN_CACHE_DIR=/tmp/kc0
  taskset -c 0-5 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" -rfE --tb=short \
     tests/targets/cuda/test_gemv.py tests/targets/cuda/test_decode_gpu.py 2>&1 | grep -v "^DEBUG" > $OUT/pytest_gpu.log
  taskset -c 0-5 timeout 150 python3 bench/llm_gpu.py --no-compile --repeat 30 2>&1 | grep -v "^DEBUG" > $OUT/llm.log
  taskset -c 0-5 timeout 100 python3 scripts/prof_decode.py 16 2>&1 | grep -v "^DEBUG\|arn" > $OUT/prof.log ) &
wait
echo "== gpu tests"; tail -8 $OUT/pytest_gpu.log
echo "== decode"; grep -E "^kiln:|^\| llama" $OUT/llm.log
head -12 $OUT/prof.log
echo "== fuzz"; tail -22 $OUT/fuzz.log
