#!/usr/bin/env bash
# session 6, device call 1: quiet CPU peers (cores 0,1; compiles on 2-7) beside the GPU decode bench (cores 8-15)
set -u
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 KILN_CACHE_DIR=/tmp/kiln_cache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200 > $OUT/cpu.txt
( timeout 560 python3 bench/cpu_peers.py --taskset 0,1 --compile-taskset 2-7 --systems eager,ort,openvino,kiln \
   --models mlp,resnet18,mobilenet_v2,gpt,bert_like_b4,ln_softmax,matmul_3x2,resnet18_b8 --rounds 3 --min-time 0.5 \
   --json $OUT/cpu_peers.json --markdown $OUT/cpu.md > $OUT/cpu_peers.log 2>&1; echo "cpu rc $?" >> $OUT/cpu_peers.log ) &
( SKIP_TESTS=1 RO_TIMEOUT=200 taskset -c 8-15 bash scripts/decode_device.sh > $OUT/decode.log 2>&1 ) &
wait
tail -25 $OUT/decode.log
sed -n '/cpu-peers:begin/,/cpu-peers:end/p' $OUT/cpu.md | grep -E "^\||Geomean" 
tail -3 $OUT/cpu_peers.log
