#!/bin/bash
# GPU run for the channels-last CUDA convolution (issue 15 item 2; passes/conv_nhwc.py,
# targets/cuda/conv_template.py): a first set of GPU tests, the peers benchmark (ResNet-18 and
# MobileNetV2 against torch.compile reduce-overhead), then the rest of the GPU tests.
# Usage on the device machine, from the worktree root (about 8 minutes; logs under $OUT):
#   bash scripts/gconv_device.sh
# and for a second run, kiln's two convolution paths A/B with per-convolution figures:
#   GCONV_AB=1 bash scripts/gconv_device.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/device.txt"
if [ -n "$GCONV_AB" ]; then
    # the second run: kiln implicit vs kiln im2col vs eager cuDNN, and per convolution the
    # tuner's best tile against cuDNN (about 6 minutes)
    timeout 420 python3 bench/conv_gpu.py --models resnet18,mobilenet_v2 --dtypes bf16,fp32 \
        --batches 1,8 --repeat 20 --per-conv 2>&1 | grep -v "^DEBUG" | tee "$OUT/conv_ab.md"
    echo "== A/B"; grep "^|" "$OUT/conv_ab.md"
    exit 0
fi
T="python3 -m pytest -m gpu -o addopts= -q -p no:cacheprovider -p no:logging"
G=tests/targets/cuda/test_conv_nhwc_gpu.py
# 1. the stem and the bfloat16 cases (about 2 minutes)
timeout 150 $T $G -k "(stem or bf16) and not zoo" 2>&1 | grep -v "^DEBUG" > "$OUT/tests1.log"
tail -25 "$OUT/tests1.log"
# 2. kiln (default options: the NHWC convolution) against torch.compile reduce-overhead
timeout 330 python3 bench/gpu_peers.py --models resnet18,mobilenet_v2 --dtypes bf16,fp32 \
    --batches 1,8 --modes reduce-overhead --repeat 20 --timeout 150 --json "$OUT/peers.json" \
    > "$OUT/peers.log" 2>&1
grep -v "^DEBUG" "$OUT/peers.log" | grep -v "^{" | tail -20 > "$OUT/peers_table.md"
# 3. the models end to end (tiles tuned here), the other dtypes' cases, as far as time allows
timeout 110 $T $G -k "zoo or not (stem or bf16)" 2>&1 | grep -v "^DEBUG" > "$OUT/tests2.log"
tail -8 "$OUT/tests2.log"
echo "== tests"; grep -h -E "passed|failed|error" "$OUT"/tests*.log | tail -4
echo "== peers (ms; kiln / best = kiln over torch.compile reduce-overhead or eager)"
if [ -s "$OUT/peers.json" ]; then cat "$OUT/peers_table.md"; else
    grep "^{" "$OUT/peers.log" | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print(r['model'], r['dtype'], 'b%d' % r['batch'], 'eager', round(r.get('eager_ms', 0), 3),
          'ro', round(r.get('ro_ms', 0), 3), 'kiln', round(r.get('kiln_ms', 0), 3),
          r.get('kiln_error', ''))"; fi
