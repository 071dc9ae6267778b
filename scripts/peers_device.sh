#!/usr/bin/env bash
# Issue 15's rows in one device call: each line of ROWS is "<models> <dtypes> <batches> <modes>
# [<limit s>]", run as one bench/gpu_peers.py invocation under that limit (default T_ROW s;
# the table is written after every model, so a row stopped at its limit keeps what it timed,
# and a worker stopped at T_WORKER keeps the systems timed before it); logs and tables under
# $OUT, the tables printed last.  On a machine of several GPUs the rows go round-robin to one
# lane per GPU (CUDA_VISIBLE_DEVICES), each lane running its rows one after another, so no two
# rows share a GPU; LANES=1 runs them all on GPU 0.  Example:
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
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader > "$OUT/env.log" 2>&1
GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
# GPU_LIST (e.g. "2 3"): the GPUs the lanes use, when others run something else
read -r -a GPU_IDS <<< "${GPU_LIST:-$(seq -s ' ' 0 $(( GPUS > 0 ? GPUS - 1 : 0 )))}"
LANES=${LANES:-${#GPU_IDS[@]}}

run_row() {  # <row number> <lane> <models> <dtypes> <batches> <modes> [<limit s>]
  local i=$1 lane=$2 t0=$SECONDS limit=${7:-${T_ROW:-300}}
  CUDA_VISIBLE_DEVICES=${GPU_IDS[$lane]:-$lane} KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}_$lane \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache_$lane \
    timeout "$limit" python3 bench/gpu_peers.py --models "$3" --dtypes "$4" \
    --batches "$5" --modes "$6" --repeat 20 --timeout "${T_WORKER:-150}" \
    --markdown "$OUT/peers_$i.md" > "$OUT/peers_$i.log" 2>&1
  echo "row $i (gpu ${GPU_IDS[$lane]:-$lane}: $3 $4 b$5 $6): rc $? in $((SECONDS - t0)) s; load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$OUT/steps.log"
}

i=0
declare -a LANE_ROWS
while read -r models dtypes batches modes limit; do
  [ -z "$models" ] && continue
  lane=$(( i % LANES )); i=$((i + 1))
  LANE_ROWS[$lane]+="$i $models $dtypes $batches $modes ${limit:-}"$'\n'
done <<< "$ROWS"
for lane in $(seq 0 $((LANES - 1))); do
  ( while read -r n models dtypes batches modes limit; do
      [ -z "$n" ] && continue
      run_row "$n" "$lane" "$models" "$dtypes" "$batches" "$modes" $limit
    done <<< "${LANE_ROWS[$lane]:-}" ) &
done
wait
# what comes back is at most 8 files: one archive of the logs, one file of all the tables
tar -C "$OUT" -czf "$OUT/logs.tgz" $(cd "$OUT" && ls peers_*.log 2>/dev/null) && rm -f "$OUT"/peers_*.log
for f in $(ls "$OUT"/peers_*.md 2>/dev/null | sort -V); do echo "-- $(basename "$f")"; cat "$f"; done > "$OUT/tables.md"
rm -f "$OUT"/peers_*.md
echo "== tables"
cat "$OUT/env.log"; sort -V "$OUT/steps.log"
grep -h "^| \|geometric" "$OUT/tables.md" | grep -v "^| model\|^|---"
