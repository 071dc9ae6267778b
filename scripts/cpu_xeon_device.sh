#!/usr/bin/env bash
# Issue 14 on the device's CPU: kiln against ONNX Runtime, OpenVINO, AOTInductor and eager,
# 2 threads pinned to TIME_CPUS, every system timed in ONE process, interleaved in rotating
# bursts (bench/cpu_paired.py: on a machine whose vCPUs swing 20-40% between processes, only
# comparisons inside one process hold). From the repository root (the device tool's working
# directory), with the wheels carried in .whl/ and OpenVINO's trimmed archive in .ovwhl/:
#   bash scripts/cpu_xeon_device.sh        # logs and JSON under $OUT, the table last
# 1. compile: bench/cpu_peers.py --rounds 0 --keep per model, LANES models at a time, every
#    export / compile process pinned to COMPILE_CPUS (each system compiles in a fresh process
#    with an empty cache; its compile time is recorded);
# 2. time: per model, bench/cpu_paired.py on the kept directory, pinned to TIME_CPUS, with
#    --threads 2 (wall time per call), ROUNDS rounds of BURST seconds per system; each
#    system's output is checked against eager's before timing;
# 3. THREADS1=1: the same for ORT and kiln at 1 thread on one core (issue 14 item 3);
# 4. the table: median ms, kiln / best of ORT and OpenVINO, kiln / AOTInductor, geometric
#    means, compile seconds.
# Env: PY, MODELS, SYSTEMS (eager,aoti,ort,openvino,kiln,kiln_autotune), LANES (4),
# COMPILE_CPUS (2-15), TIME_CPUS (0,1), ROUNDS (8), BURST (0.4), COMPILE_TIMEOUT (300),
# BUDGET_S (540: phases are skipped, never cut mid-model, when the time is spent), THREADS1.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-xeon_out}
mkdir -p "$OUT"
PY=${PY:-python3}
MODELS=${MODELS:-mlp,resnet18,resnet18_b8,mobilenet_v2,gpt,bert_like_b4,ln_softmax,matmul_3x2}
SYSTEMS=${SYSTEMS:-eager,aoti,ort,openvino,kiln,kiln_autotune}
LANES=${LANES:-4}
COMPILE_CPUS=${COMPILE_CPUS:-2-15}
TIME_CPUS=${TIME_CPUS:-0,1}
ROUNDS=${ROUNDS:-8}
BURST=${BURST:-0.4}
COMPILE_TIMEOUT=${COMPILE_TIMEOUT:-300}
BUDGET_S=${BUDGET_S:-540}
THREADS1=${THREADS1:-0}
START=$(date +%s)
left() { echo $((BUDGET_S - ($(date +%s) - START))); }

SITE=${SITE:-/tmp/site}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target $SITE .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || echo "pip install of .whl/ failed (see $OUT/pip.log)"
fi
if [ -f .ovwhl/openvino_cpu_trimmed.zip ] && ! $PY -c 'import openvino' 2>/dev/null; then
  $PY -m zipfile -e .ovwhl/openvino_cpu_trimmed.zip $SITE >>"$OUT/pip.log" 2>&1
  $PY -m pip install -q --no-index --no-deps --no-compile --target $SITE \
    .ovwhl/openvino_telemetry*.whl >>"$OUT/pip.log" 2>&1
fi
export PYTHONPATH=$SITE:$PWD
export PYTHONUNBUFFERED=1
{
  lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Flags' | cut -c1-300
  $PY -c 'import torch, onnxruntime, openvino; print("torch", torch.__version__, "ort", onnxruntime.__version__, "openvino", openvino.__version__)'
  uptime
} 2>&1 | tee "$OUT/machine.txt"

# 1. compile, LANES models at a time
IFS=, read -r -a MLIST <<<"$MODELS"
for m in "${MLIST[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$LANES" ]; do wait -n; done
  if [ "$(left)" -lt 120 ]; then echo "budget: $m not compiled"; continue; fi
  timeout $((COMPILE_TIMEOUT * 3)) $PY bench/cpu_peers.py --models "$m" --systems "$SYSTEMS" \
    --rounds 0 --keep --compile-taskset "$COMPILE_CPUS" --taskset "$COMPILE_CPUS" \
    --compile-timeout "$COMPILE_TIMEOUT" --json "$OUT/c_$m.json" >"$OUT/compile_$m.log" 2>&1 &
done
wait
echo "compile phase done at $(( $(date +%s) - START )) s"; uptime

# 2. (and 3.) time each model in one process
paired() {  # model threads cpus systems-filter out
  local m=$1 thr=$2 cpus=$3 filt=$4 out=$5
  local spec
  spec=$($PY - "$OUT/c_$m.json" "$filt" <<'EOF'
import json, sys
row = json.load(open(sys.argv[1]))["rows"][0]
want = sys.argv[2].split(",") if sys.argv[2] else None
d, names = row.get("dir"), []
for s in ("ort", "openvino", "eager", "aoti", "kiln", "kiln_autotune"):
    r = row["systems"].get(s)
    # rounds 0: every cell says "not timed"; a compiled system has its compile time
    if r is None or (s != "eager" and "compile_s" not in r) or (want and s not in want):
        continue
    names.append(f"{d}/{s}.kiln" if s.startswith("kiln") else s)
print(d, ",".join(names))
EOF
)
  local dir=${spec%% *} names=${spec#* }
  [ -n "$names" ] || { echo "$m: nothing compiled"; return; }
  timeout 240 taskset -c "$cpus" $PY bench/cpu_paired.py "$dir" "$names" --model "$m" \
    --threads "$thr" --wall --rounds "$ROUNDS" --burst "$BURST" --rotate --json "$out" \
    >"${out%.json}.log" 2>&1 || echo "$m: cpu_paired failed (${out%.json}.log)"
  tail -n 8 "${out%.json}.log"
}
for m in "${MLIST[@]}"; do
  [ -f "$OUT/c_$m.json" ] || continue
  if [ "$(left)" -lt 40 ]; then echo "budget: $m not timed"; continue; fi
  paired "$m" 2 "$TIME_CPUS" "" "$OUT/p_$m.json"
done
if [ "$THREADS1" = 1 ]; then
  for m in "${MLIST[@]}"; do
    [ -f "$OUT/c_$m.json" ] || continue
    if [ "$(left)" -lt 30 ]; then echo "budget: $m not timed at 1 thread"; continue; fi
    paired "$m" 1 "${TIME_CPUS%%,*}" "ort,kiln" "$OUT/p1_$m.json"
  done
fi
uptime

# 4. the table
$PY - "$OUT" "$MODELS" <<'EOF'
import json, math, os, sys
out, models = sys.argv[1], sys.argv[2].split(",")
cols = ("eager", "aoti", "ort", "openvino", "kiln", "kiln_autotune")
lab = {"eager": "eager", "aoti": "AOTI", "ort": "ORT", "openvino": "OpenVINO", "kiln": "kiln",
       "kiln_autotune": "kiln ma"}
print("| model | " + " | ".join(lab[c] for c in cols)
      + " | kiln / best peer | kiln ma / kiln | kiln / AOTI | kiln 1 thr / 2 thr | compile s (kiln, ma, ORT, OV, AOTI) |")
print("|---|" + "---:|" * (len(cols) + 5))
r_peer, r_aoti, r_ma = [], [], []
for m in models:
    p = os.path.join(out, f"p_{m}.json")
    if not os.path.exists(p):
        continue
    res = json.load(open(p))
    ms = {}
    for k, v in res["systems"].items():
        key = os.path.basename(k)[:-5] if k.endswith(".kiln") else k
        ms[key] = v["median_s"] * 1e3
    bad = {os.path.basename(k)[:-5] if k.endswith(".kiln") else k for k, v in res["check"].items() if v != "ok"}
    cell = lambda c: "-" if c not in ms else f"{ms[c]:.3f}" + (" MISMATCH" if c in bad else "")
    peers = [ms[c] for c in ("ort", "openvino") if c in ms]
    rp = ms["kiln"] / min(peers) if peers and "kiln" in ms else None
    ra = ms["kiln"] / ms["aoti"] if "aoti" in ms and "kiln" in ms else None
    rm = ms["kiln_autotune"] / ms["kiln"] if "kiln_autotune" in ms and "kiln" in ms else None
    t1 = ""
    p1 = os.path.join(out, f"p1_{m}.json")
    if os.path.exists(p1):
        k1 = [v["median_s"] for k, v in json.load(open(p1))["systems"].items() if k.endswith("kiln.kiln")]
        if k1 and "kiln" in ms:
            t1 = f"{k1[0] * 1e3 / ms['kiln']:.2f}"
    comp = json.load(open(os.path.join(out, f"c_{m}.json")))["rows"][0]["systems"]
    cs = ", ".join(f"{comp[s]['compile_s']:.1f}" if "compile_s" in comp.get(s, {}) else "-"
                   for s in ("kiln", "kiln_autotune", "ort", "openvino", "aoti"))
    f = lambda x: "-" if x is None else f"{x:.2f}"
    print(f"| {m} | " + " | ".join(cell(c) for c in cols)
          + f" | {f(rp)} | {f(rm)} | {f(ra)} | {t1} | {cs} |")
    for lst, x in ((r_peer, rp), (r_aoti, ra), (r_ma, rm)):
        if x:
            lst.append(x)
g = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")
print(f"\ngeometric mean: kiln / best peer {g(r_peer):.3f} ({len(r_peer)} models), "
      f"kiln / AOTI {g(r_aoti):.3f} ({len(r_aoti)}), kiln ma / kiln {g(r_ma):.3f} ({len(r_ma)})")
EOF
