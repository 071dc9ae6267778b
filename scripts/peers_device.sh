#!/usr/bin/env bash
# Issue 15's rows in one device call: each line of ROWS is "<models> <dtypes> <batches> <modes>",
# run as one bench/gpu_peers.py invocation under its own limit (T_ROW s); logs and tables under
# $OUT, the tables printed last.  Example:
#   ROWS=$'hf_llama,gpt fp32 1 reduce-overhead\nhf_bert_base bf16 8 reduce-overhead,max-autotune' \
#     bash scripts/peers_device.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/env.log" 2>&1
i=0
while read -r models dtypes batches modes; do
  [ -z "$models" ] && continue
  i=$((i + 1)); t0=$SECONDS
  timeout "${T_ROW:-300}" python3 bench/gpu_peers.py --models "$models" --dtypes "$dtypes" \
    --batches "$batches" --modes "$modes" --repeat 20 --timeout "${T_WORKER:-150}" \
    --markdown "$OUT/peers_$i.md" > "$OUT/peers_$i.log" 2>&1
  echo "row $i ($models $dtypes b$batches $modes): rc $? in $((SECONDS - t0)) s; load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/steps.log"
done <<< "$ROWS"
echo "== tables"
cat "$OUT/env.log" "$OUT/steps.log"
for f in "$OUT"/peers_*.md; do [ -f "$f" ] && { echo "-- $f"; cat "$f"; }; done
