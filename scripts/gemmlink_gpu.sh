#!/bin/bash
# GPU run for issue 6 (linked GEMM backends): the GPU tests of linked packages, then
# bench/gemm_link.py (zoo mlp/gpt in float16; optionally the one-GEMM sweep). CUTLASS objects
# come prebuilt in build/gpucache (scripts/prebuild_cutlass.py) when the sources match.
# usage (from the worktree root, on the GPU machine): bash scripts/gemmlink_gpu.sh [tests|bench|sweep]...
set -o pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site ../../.whl/nvidia_cutlass*.whl
export PYTHONPATH=/tmp/site:$PWD KILN_CACHE_DIR=$PWD/build/gpucache PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi -L
for what in "$@"; do
  case $what in
    tests) timeout 280 python3 -m pytest -q -x -m gpu -p no:cacheprovider \
             tests/gemm/test_autotune_gpu.py -k "package" 2>&1 | tee $OUT/tests.log | tail -25 ;;
    tests-fast) timeout 200 python3 -m pytest -q -x -m gpu -p no:cacheprovider \
             tests/gemm/test_autotune_gpu.py -k "package and not slow_" \
             --deselect tests/gemm/test_autotune_gpu.py::test_package_max_autotune_all_backends \
             2>&1 | tee $OUT/tests.log | tail -25 ;;
    bench) timeout 280 python3 bench/gemm_link.py --models mlp,gpt --cutlass-configs 1 \
             --json $OUT/zoo.json 2>&1 | tee $OUT/bench.log | grep -v Warn | tail -30 ;;
    sweep) timeout 280 python3 bench/gemm_link.py --models "" --sweep --cutlass-configs 1 \
             --json $OUT/sweep.json 2>&1 | tee $OUT/sweep.log | grep -v Warn | tail -30 ;;
  esac
done
