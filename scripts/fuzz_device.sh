#!/usr/bin/env bash
# The fuzzer at scale (issue 16): N_CPU programs compiled for the CPU and, at the same time,
# N_CUDA programs compiled for CUDA and run on the GPUs, each process stopped after TIME_LIMIT
# seconds. Run from the repository root; logs, reproducers and a summary go to $OUT (default
# ./fuzz_out); the last lines are the table per device: programs, passed, refused, wrong,
# crashed (and programs torch.export itself refused).
#   [N_CPU=10000] [N_CUDA=1000] [TIME_LIMIT=480] [SEED=16] [CUDA_SEED=17] [MAX_OPS=8]
#   [CUDA_PROCS=3 per GPU] [CPU_PROCS=nproc - CUDA_PROCS] [PY=python3] scripts/fuzz_device.sh
# Sizing: a CPU program costs about 1.6 core-seconds (compile dominates; C++ files built with
# precompiled headers, KILN_PCH=1; 2.3 without, on the 2-core dev box), a CUDA one 2-4, so on
# a 64-core, 4-GPU machine: 12 CUDA processes (3 per GPU, CUDA_VISIBLE_DEVICES each) and 52
# CPU processes; 10,000 CPU programs need about 16,000 core-seconds (about 5 minutes there),
# 1,000 CUDA ones about 3,000 (about 4 minutes).
# TIME_LIMIT stops starting programs (the table counts those run); a process still busy 60 s
# after it is killed (the summary names it and the program it was running), so the script
# ends within TIME_LIMIT + 60 s plus start-up: the default fits a 10-minute command. Without a
# GPU (torch sees none) the CUDA programs are compiled only (--compile-only).
# Rerun one program: kiln fuzz --seed S --start K --n 1 [--device cuda] --out DIR (minimises
# it and writes a pytest reproducer). Programs are numbered per device from 0; shard s of P
# runs programs [s*ceil(N/P), (s+1)*ceil(N/P)).
set -u
OUT=${OUT:-fuzz_out}
N_CPU=${N_CPU:-10000}
N_CUDA=${N_CUDA:-1000}
TIME_LIMIT=${TIME_LIMIT:-480}
SEED=${SEED:-16}
CUDA_SEED=${CUDA_SEED:-$((SEED + 1))}
MAX_OPS=${MAX_OPS:-8}
PY=${PY:-python3}
mkdir -p "$OUT/logs"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache_fuzz} KILN_PCH=${KILN_PCH:-1}
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
cuda_mode=""
[ "${NGPU:-0}" -ge 1 ] || cuda_mode="--compile-only"
CUDA_PROCS=${CUDA_PROCS:-$(( NGPU >= 1 ? 3 * NGPU : 2 ))}
[ "$N_CUDA" -gt 0 ] || CUDA_PROCS=0
# (nproc obeys OMP_NUM_THREADS, exported as 1 above: count the cores without it)
CPU_PROCS=${CPU_PROCS:-$(( $(env -u OMP_NUM_THREADS nproc) - CUDA_PROCS ))}
[ "$CPU_PROCS" -ge 1 ] || CPU_PROCS=1
{ date -u; env -u OMP_NUM_THREADS nproc; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -2
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' 2>&1
  git rev-parse --short HEAD 2>/dev/null
  echo "cpu: $N_CPU programs, seed $SEED, $CPU_PROCS processes; cuda: $N_CUDA programs, seed" \
       "$CUDA_SEED, $CUDA_PROCS processes on ${NGPU:-0} GPU(s) ${cuda_mode}; time limit $TIME_LIMIT s"
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"

# shard DEVICE SEED N PROCS EXTRA...: start PROCS `kiln fuzz` processes over programs [0, N)
shard() {
  local dev=$1 seed=$2 n=$3 procs=$4; shift 4
  [ "$n" -gt 0 ] && [ "$procs" -gt 0 ] || return 0
  local per=$(( (n + procs - 1) / procs ))
  for s in $(seq 0 $((procs - 1))); do
    local start=$((s * per)) count=$per
    [ $start -lt "$n" ] || break
    [ $((start + count)) -le "$n" ] || count=$((n - start))
    # --time-limit stops starting programs; timeout ends one still running 60 s after it
    local gpu=""
    [ "$dev" = cuda ] && [ "${NGPU:-0}" -ge 1 ] && gpu="CUDA_VISIBLE_DEVICES=$((s % NGPU))"
    env $gpu timeout -k 5 $((TIME_LIMIT + 60)) $PY -m kiln.cli.main fuzz --seed "$seed" \
      --start $start --n $count --device "$dev" --max-ops "$MAX_OPS" --no-minimise --verbose \
      --time-limit "$TIME_LIMIT" --out "$OUT/repro_$dev" "$@" \
      > "$OUT/logs/${dev}_$s.log" 2>&1 &
  done
}

t0=$(date +%s)
shard cpu "$SEED" "$N_CPU" "$CPU_PROCS"
shard cuda "$CUDA_SEED" "$N_CUDA" "$CUDA_PROCS" --no-interp $cuda_mode
wait
t1=$(date +%s)
times > "$OUT/times.txt"  # (here: the shell's own children, not a subshell's)
# the processes' CPU time (user + sys of every waited-for descendant: compilers included)
read -r cu cs < <(tail -1 "$OUT/times.txt" | tr -s 'ms' '  ' | awk '{print $1*60+$2, $3*60+$4}')
n_run=$(cat "$OUT"/logs/*.log 2>/dev/null | grep -cE "^\[[0-9]+\] seed -?[0-9]+: [0-9]+ ops, ")

# one line per program: "[k] seed S: n ops, STATUS detail"
count() {  # count DEVICE STATUS
  cat "$OUT"/logs/"$1"_*.log 2>/dev/null | grep -Ec "^\[[0-9]+\] seed -?[0-9]+: [0-9]+ ops, $2( |$)"
}
{
  echo "== failures (first line of each; reproduce with the seed and --start shown)"
  for dev in cpu cuda; do
    grep -HE "^\[[0-9]+\] seed -?[0-9]+: [0-9]+ ops, (mismatch|crash)" "$OUT"/logs/${dev}_*.log \
      2>/dev/null | cut -c1-300
  done
  echo "== kiln refusals, by message (most common first)"
  cat "$OUT"/logs/*.log 2>/dev/null | grep -E "ops, error " | sed -E 's/^.*ops, error //' |
    sed -E 's/[0-9]+/N/g' | cut -c1-140 | sort | uniq -c | sort -rn | head -15
  echo "== processes killed at TIME_LIMIT + 60 s (the program each was running: rerun it)"
  for f in "$OUT"/logs/*.log; do
    [ -e "$f" ] || continue
    grep -qE "^[0-9]+ programs, [0-9]+ mismatches" "$f" && continue
    last=$(grep -E "^\[[0-9]+\] seed" "$f" | tail -1 | cut -d: -f1)
    echo "$(basename "$f" .log): ${last:+after $last}${last:-in its first program}"
  done
  echo "== $(( t1 - t0 )) s wall, $(date -u); $CPU_PROCS CPU + $CUDA_PROCS CUDA processes;" \
       "$(awk -v u="$cu" -v s="$cs" -v n="$n_run" 'BEGIN {printf "%.0f core-s", u + s;
                                                        if (n > 0) printf ", %.2f per program (both devices)", (u + s) / n}')"
  echo "| device | programs | passed | refused | wrong | crashed | invalid (torch.export) |"
  echo "| --- | --- | --- | --- | --- | --- | --- |"
  for dev in cpu cuda; do
    ok=$(count $dev ok); err=$(count $dev error); bad=$(count $dev mismatch)
    crash=$(count $dev crash); inv=$(count $dev invalid)
    label=$dev
    [ "$dev" = cuda ] && [ -n "$cuda_mode" ] && label="cuda (compile only: no GPU)"
    echo "| $label | $((ok + err + bad + crash + inv)) | $ok | $err | $bad | $crash | $inv |"
  done
} | tee "$OUT/summary.txt"
wrong=$(( $(count cpu mismatch) + $(count cpu crash) + $(count cuda mismatch) + $(count cuda crash) ))
[ "$wrong" -eq 0 ] || exit 1
[ "${n_run:-0}" -gt 0 ] || exit 3  # nothing ran: not a pass
