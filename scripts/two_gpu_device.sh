#!/usr/bin/env bash
# One device call on a 2-GPU machine (< 9 minutes): the GPU tests of the decode, GEMV,
# quantised-GEMV, attention and LLM files on GPU 1 (cores 16-31), beside the benchmarks on GPU 0
# (cores 0-15): cold compile of ln_softmax / resnet18 / mobilenet_v2 (bf16), the Llama 16x2048
# decode (bench/llm_gpu.py) and its per-kernel profile (scripts/prof_decode.py), bf16 / int8 /
# int4 generation (bench/gen_gpu.py), then reduce-overhead next to kiln while CALL_S (520 s)
# lasts. From the repository root with the wheels in .whl2/ (carry it); logs under $OUT, a
# summary last:   bash scripts/two_gpu_device.sh
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl2/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi -L > $OUT/env.log; git rev-parse --short HEAD >> $OUT/env.log 2>&1; nproc >> $OUT/env.log
( export CUDA_VISIBLE_DEVICES=1 KILN_CACHE_DIR=/tmp/kc1
  T="taskset -c 16-31"; P="python3 -m pytest -m gpu -v -p no:cacheprovider -o addopts= --tb=short"
  $T timeout 210 $P tests/targets/cuda/test_decode_gpu.py tests/targets/cuda/test_gemv.py \
    tests/targets/cuda/test_quant_gemv.py tests/targets/cuda/test_quant_cuda.py 2>&1 | grep -v "^DEBUG" > $OUT/pytest_gpu1.log
  $T timeout 130 $P tests/targets/cuda/test_attention_gpu.py -k "decode_path or fully_masked or variant" 2>&1 | grep -v "^DEBUG" > $OUT/pytest_gpu2.log
  $T timeout 120 $P tests/targets/cuda/test_llm_cuda.py tests/targets/cuda/test_generate_cuda.py 2>&1 | grep -v "^DEBUG" > $OUT/pytest_gpu3.log ) &
( export CUDA_VISIBLE_DEVICES=0 KILN_CACHE_DIR=/tmp/kc0
  t0=$SECONDS
  OUT=$OUT/cold MODELS=ln_softmax,resnet18,mobilenet_v2 DTYPES=bf16 SKIP_AOTI=1 BUDGET_S=130 \
    taskset -c 0-15 timeout 170 bash scripts/cold_compile_device.sh > $OUT/cold.log 2>&1
  echo "cold: $((SECONDS - t0)) s" >> $OUT/steps.log
  taskset -c 0-15 timeout 120 python3 bench/llm_gpu.py --no-compile --repeat 30 2>&1 | grep -v "^DEBUG" > $OUT/llm.log
  echo "llm: $((SECONDS - t0)) s" >> $OUT/steps.log
  taskset -c 0-15 timeout 70 python3 scripts/prof_decode.py 16 2>&1 | grep -v "^DEBUG\|arn" > $OUT/prof.log
  echo "prof: $((SECONDS - t0)) s" >> $OUT/steps.log
  taskset -c 0-15 timeout 170 python3 bench/gen_gpu.py --weight-quant none,int8,int4 --json $OUT/gen.json 2>&1 | grep -v "^DEBUG" > $OUT/gen.log
  echo "gen: $((SECONDS - t0)) s" >> $OUT/steps.log
  left=$(( ${CALL_S:-520} - SECONDS ))
  [ $left -gt 60 ] && taskset -c 0-15 timeout $left python3 bench/llm_gpu.py --repeat 30 2>&1 | grep -v "^DEBUG" > $OUT/llm_ro.log
  echo "ro: $((SECONDS - t0)) s" >> $OUT/steps.log ) &
wait
cat $OUT/steps.log
echo "== gpu tests"; for f in $OUT/pytest_gpu?.log; do echo "$f: $(grep -c PASSED $f) passed, $(grep -c -E 'FAILED|ERROR' $f) failed/error"; grep -E "^(FAILED|ERROR)|Error|assert" $f | head -8; tail -1 $f; done
echo "== cold"; tail -14 $OUT/cold.log
echo "== decode"; grep -E "^kiln:|^\| llama" $OUT/llm.log $OUT/llm_ro.log 2>/dev/null
head -14 $OUT/prof.log
echo "== gen"; tail -12 $OUT/gen.log
