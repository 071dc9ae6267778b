#!/usr/bin/env bash
# The session's GPU benchmark runs in one device call (H100/H200, < 9.5 minutes), from the
# repository root; each step under its own time limit, logs under $OUT, the tables last:
#   1. bench/gpu_peers.py: kiln against eager and reduce-overhead on the bundled models and HF
#      models built from configs (GPU_MODELS, bf16 and fp32, batch 1 and 8);
#   2. bench/llm_gpu.py on the Llama 16x2048 bf16 decoder (ms/token, kernels, roofline);
#   3. bench/llm_gpu.py on a Llama-3-8B-shaped decoder (32 x 4096, 8 kv heads, 128k vocab).
# Env: GPU_MODELS, STEPS ("peers llm llm8b"), T_PEERS / T_LLM / T_8B (seconds per step).
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.log" 2>&1
for step in ${STEPS:-peers llm llm8b}; do
  t0=$SECONDS
  case $step in
    peers) timeout ${T_PEERS:-240} $PY bench/gpu_peers.py --models "${GPU_MODELS:-gpt,bert_like_b4,resnet18,mobilenet_v2}" \
             --modes reduce-overhead --dtypes bf16,fp32 --batches 1,8 --repeat 20 \
             --markdown "$OUT/peers.md" > "$OUT/peers.log" 2>&1 ;;
    llm) timeout ${T_LLM:-120} $PY bench/llm_gpu.py --no-compile --repeat 30 > "$OUT/llm.log" 2>&1 ;;
    llm8b) timeout ${T_8B:-200} $PY bench/llm_gpu.py --layers 32 --hidden 4096 --inter 14336 \
             --heads 32 --kv-heads 8 --vocab 128256 --cache 256 --repeat 20 > "$OUT/llm8b.log" 2>&1 ;;
  esac
  echo "$step: rc $? in $((SECONDS - t0)) s" | tee -a "$OUT/steps.log"
done
echo "== tables"
cat "$OUT/steps.log"
[ -f "$OUT/peers.md" ] && cat "$OUT/peers.md"
for f in llm llm8b; do [ -f "$OUT/$f.log" ] && { echo "-- $f"; sed -n '/^GPU:/,$p' "$OUT/$f.log"; grep -E "^(kiln|eager|reduce|model)" "$OUT/$f.log" | head -8; }; done
