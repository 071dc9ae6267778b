#!/bin/bash
# GPU run for fp8 / int8 / mixed fp16 x int8 GEMMs (kiln issues 5 and 6): the GPU tests, then the benchmark.
# Usage on the device machine, from the worktree root: bash scripts/lowp_gpu.sh  (logs in $OUT)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
python3 -c "
import torch
x = torch.tensor([1e6, float('inf'), 470.0])
for dev in ('cpu', 'cuda'):
    print(dev, 'e4m3fn overflow bytes', x.to(dev).to(torch.float8_e4m3fn).view(torch.uint8).tolist())
from kiln.targets.float8 import e4m3fn_saturates
print('kiln: e4m3fn saturates', e4m3fn_saturates())"
python3 -m pytest -m gpu -o addopts="" -q -p no:cacheprovider tests/targets/cuda/test_lowp_gpu.py \
    tests/gemm/test_gemm_mixed.py -p no:logging 2>&1 \
    | tee "$OUT/tests.log" | grep -v "^DEBUG" | tail -40
timeout 300 python3 bench/lowp_gpu.py --json "$OUT/lowp.json" --markdown "$OUT/lowp.md" 2>&1 \
    | grep -v "^DEBUG" | tail -25
