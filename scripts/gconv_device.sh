#!/bin/bash
# GPU run for the channels-last CUDA convolution (issue 15 item 2; passes/conv_nhwc.py,
# targets/cuda/conv_template.py). Usage on the device machine, from the worktree root; logs
# and a short table last, under $OUT. Each part stays under 8 minutes:
#   bash scripts/gconv_device.sh             # part 1: bf16 / stem GPU tests, then the peers
#                                            #   benchmark in bf16 (ResNet-18, MobileNetV2,
#                                            #   batch 1 and 8, torch.compile reduce-overhead)
#   GCONV_PART=2 bash scripts/gconv_device.sh  # the same benchmark in fp32, the other tests
#   GCONV_PART=ab bash scripts/gconv_device.sh # kiln implicit vs kiln im2col vs eager cuDNN,
#                                            #   and per convolution the tuner's best tile
#                                            #   against cuDNN (bench/conv_gpu.py)
OUT=${OUT:-/tmp/out}
PART=${GCONV_PART:-1}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/device.txt"
T="python3 -m pytest -m gpu -o addopts= -q -p no:cacheprovider -p no:logging"
G=tests/targets/cuda/test_conv_nhwc_gpu.py

peers() {  # $1: dtypes, $2: seconds per model (each model its own run: one slow compile
           # cannot starve the other)
    for model in resnet18 mobilenet_v2; do
        timeout "$2" python3 bench/gpu_peers.py --models $model --dtypes "$1" \
            --batches 1,8 --modes reduce-overhead --repeat 20 --timeout 200 \
            --json "$OUT/peers_$1_$model.json" > "$OUT/peers_$1_$model.log" 2>&1
    done
    echo "== peers $1 (ms; kiln / best = kiln over the best of eager and reduce-overhead)"
    cat "$OUT"/peers_$1_*.log | grep "^{" | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    k, ro, e = r.get('kiln_ms'), r.get('ro_ms'), r.get('eager_ms')
    best = min(x for x in (ro, e) if x) if (ro or e) else None
    print(r['model'], r['dtype'], 'b%d' % r['batch'], 'eager', e, 'ro', ro, 'kiln', k,
          'kiln/best %.2f' % (k / best) if k and best else '', 'err', r.get('kiln_err'),
          r.get('kiln_error', ''), r.get('error', ''))"
}

case "$PART" in
1)
    timeout 90 $T $G -k "(stem or bf16) and not zoo" 2>&1 | grep -v "^DEBUG" > "$OUT/tests1.log"
    peers bf16 185
    echo "== tests"; tail -3 "$OUT/tests1.log"
    ;;
2)
    peers fp32 165
    timeout 120 $T $G -k "zoo or not (stem or bf16)" 2>&1 | grep -v "^DEBUG" > "$OUT/tests2.log"
    echo "== tests"; grep -E "FAILED|passed|failed" "$OUT/tests2.log" | tail -8
    ;;
ab)
    timeout 440 python3 bench/conv_gpu.py --models resnet18,mobilenet_v2 --dtypes bf16,fp32 \
        --batches 1,8 --repeat 20 --per-conv 2>&1 | grep -v "^DEBUG" > "$OUT/conv_ab.md"
    grep -v "^|" "$OUT/conv_ab.md" | tail -60
    echo "== A/B"; grep "^|" "$OUT/conv_ab.md"
    ;;
esac
