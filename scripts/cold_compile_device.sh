#!/usr/bin/env bash
# Cold CUDA compile time per bundled model (issue 15 item 3) on one GPU, under 5 minutes on a
# 16-core H200 machine, from the repository root (the device tool's working directory):
#   bash scripts/cold_compile_device.sh     # logs under $OUT (default cold_out), the table last
# 1. bench/compile_time.py --systems kiln-cuda: every model of MODELS in bf16 and fp32, each
#    compile in a fresh process with empty kiln / Triton caches (KILN_CACHE_DIR and
#    TRITON_CACHE_DIR per compile), then the first kiln.load of the package in fresh processes
#    (LOAD_ROUNDS of them, each with an empty cache; cuInit timed alone beside it). One line
#    per model: total seconds, the 3 slowest stages, launch_autotune's steps timed /
#    candidates compiled (+ untuned kernels prebuilt by its workers, seconds waiting for
#    compiles), Triton kernels compiled by the cubins stage; then a table of seconds per stage
#    (export, each stage of at least 0.05 s, `compiler_imports` (kiln's compiler imported by
#    the first kiln.compile) among them, `rest`: the compile call outside them); kiln's
#    bytecode is written first (compileall, as pip install does: the device machines set
#    PYTHONDONTWRITEBYTECODE=1, so a source tree is otherwise compiled in every process);
# 2. with the time left (AOTI_MIN_S, default 100 s), AOTInductor on AOTI_MODELS (bf16) for the
#    kiln / AOTI ratio (the target: at most 0.2).
# Env: PY (python3), MODELS (resnet18,mobilenet_v2,gpt,bert_like_b4,ln_softmax,mlp: the
# slowest first, so a run cut short by the budget keeps them), DTYPES (bf16,fp32),
# LOAD_ROUNDS (1; `LOAD_ROUNDS=8 MODELS=resnet18 DTYPES=bf16 SKIP_AOTI=1` looks for slow first
# loads), BUDGET_S (290), AOTI_MODELS (resnet18,gpt), SKIP_AOTI=1, OPTIONS (kiln Options as
# JSON, e.g. '{"tune_prune": false}' for the full search).
# Run time of the pruned tuning against the full search: python bench/tune_prune_ab.py
# (not part of this script: about 2 compiles and 6 timings per model and dtype).
# PKG_BYTECODE (default 1; 0: the image as it is): first write the bytecode of the installed
# packages the compile imports (torch, sympy, triton, numpy, transformers, ...; compileall
# into their own __pycache__, as `pip install` does) where the image has none (env.log:
# `torch bytecode`; the H100 image of 2026-11 has none and sets PYTHONDONTWRITEBYTECODE=1):
# without it every fresh process compiles torch's sources again, 4-5 s of a cold compile
# inside torch.export and kiln's first compile (BENCHMARKS.md, fifteenth session, s15cc).
# AB_TREES (e.g. new=.,base=base) with AB_MODELS / AB_DTYPES: those first, the trees
# interleaved per model (bench/compile_time.py --trees), then MODELS x DTYPES on this tree,
# less the cases the A/B ran.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-cold_out}
mkdir -p "$OUT"
PY=${PY:-python3}
BUDGET_S=${BUDGET_S:-290}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1 \
    || echo "pip install of .whl/ failed (see $OUT/pip.log)"
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
MODELS=${MODELS:-resnet18,mobilenet_v2,gpt,bert_like_b4,ln_softmax,mlp}
DTYPES=${DTYPES:-bf16,fp32}
site=$($PY -c 'import importlib.util as u, os; print(os.path.dirname(os.path.dirname(u.find_spec("torch").origin)))')
stdlib=$($PY -c 'import os; print(os.path.dirname(os.__file__))')
npyc=$(ls "$site/torch/_dynamo/__pycache__" 2>/dev/null | wc -l)
{ nvidia-smi --query-gpu=index,name,driver_version,persistence_mode --format=csv,noheader
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  echo "nproc: $(nproc)  git: $(git rev-parse --short HEAD 2>/dev/null)  load: $(cat /proc/loadavg)"
  echo "torch bytecode: $npyc files in torch/_dynamo/__pycache__ ($site); stdlib:" \
    "$(ls "$stdlib/__pycache__" 2>/dev/null | wc -l) in $stdlib/__pycache__;" \
    "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-}"
} >"$OUT/env.log" 2>&1
cat "$OUT/env.log"
# DIAG_IMPORTS=1: scripts/diag_imports.py (import costs of a fresh process) before and
# after the bytecode step
if [ -n "${DIAG_IMPORTS:-}" ]; then  # (kiln's own bytecode first, as the bench's install step)
  $PY -m compileall -q -j 0 kiln >/dev/null 2>&1
  $PY scripts/diag_imports.py 2>&1 | tee "$OUT/imports.log"
fi
PKG_BYTECODE=${PKG_BYTECODE:-1}
[ "$PKG_BYTECODE" = 0 ] && PKG_BYTECODE=""
if [ -n "$PKG_BYTECODE" ] && [ "$npyc" -eq 0 ]; then
  t0=$SECONDS
  pkgs=()
  for p in torch torchgen sympy mpmath networkx numpy triton cuda filelock fsspec jinja2 \
      markupsafe tqdm tabulate safetensors opt_einsum transformers huggingface_hub tokenizers \
      packaging regex yaml typing_extensions.py; do
    [ -e "$site/$p" ] && pkgs+=("$site/$p")
  done
  [ "$(ls "$stdlib/__pycache__" 2>/dev/null | wc -l)" -eq 0 ] && pkgs+=("$stdlib")
  $PY -m compileall -q -j 0 -x '/tests?/' "${pkgs[@]}" >"$OUT/bytecode.log" 2>&1
  brc=$?
  echo "bytecode of ${#pkgs[@]} packages written in $((SECONDS - t0)) s (rc $brc)" \
    | tee -a "$OUT/env.log"
fi
[ -n "${DIAG_IMPORTS:-}" ] && [ -n "$PKG_BYTECODE" ] && [ "$npyc" -eq 0 ] && \
  $PY scripts/diag_imports.py 2>&1 | sed 's/^/with bytecode: /' | tee -a "$OUT/imports.log"
rc=0
ab_cases=""
if [ -n "${AB_TREES:-}" ]; then
  timeout $((BUDGET_S - SECONDS - 10)) $PY bench/compile_time.py --systems kiln-cuda \
    --models "${AB_MODELS:-resnet18,mobilenet_v2}" --dtypes "${AB_DTYPES:-bf16}" \
    --trees "$AB_TREES" --load-rounds "${LOAD_ROUNDS:-1}" --options "${OPTIONS:-}" \
    --timeout 120 --json "$OUT/ab.json" >"$OUT/ab.log" 2>&1 || rc=$?
  [ $rc -eq 124 ] && echo "A/B compiles: timed out (partial rows in $OUT/ab.log)"
  ab_cases=$(IFS=,; for m in ${AB_MODELS:-resnet18,mobilenet_v2}; do
    for d in ${AB_DTYPES:-bf16}; do echo "$m:$d"; done; done)
fi
# the cases left, as --cases (model:dtype pairs), in MODELS' order (the slowest first)
cases=$(IFS=,; for m in $MODELS; do for d in $DTYPES; do
  grep -qx "$m:$d" <<<"$ab_cases" || echo "$m:$d"; done; done | paste -sd, -)
if [ -n "$cases" ] && [ $((BUDGET_S - SECONDS)) -gt 30 ]; then
  timeout $((BUDGET_S - SECONDS - 10)) $PY bench/compile_time.py --systems kiln-cuda \
    --cases "$cases" --load-rounds "${LOAD_ROUNDS:-1}" --options "${OPTIONS:-}" \
    --timeout 120 --json "$OUT/kiln.json" >"$OUT/kiln.log" 2>&1 || rc=$?
  [ $rc -eq 124 ] && echo "kiln compiles: timed out (partial rows in $OUT/kiln.log)"
fi
left=$((BUDGET_S - SECONDS))
if [ -z "${SKIP_AOTI:-}" ] && [ $left -ge "${AOTI_MIN_S:-100}" ]; then
  timeout $((left - 10)) $PY bench/compile_time.py --systems aoti \
    --models "${AOTI_MODELS:-resnet18,gpt}" --dtypes bf16 --timeout $((left - 15)) \
    --json "$OUT/aoti.json" >"$OUT/aoti.log" 2>&1 \
    || echo "AOTInductor: rc $? (see $OUT/aoti.log)"
else
  echo "AOTInductor skipped (${left} s left of ${BUDGET_S})" | tee "$OUT/aoti.log"
fi
echo
echo "== cold compiles ($SECONDS s in all) =="
for log in "$OUT/ab.log" "$OUT/kiln.log"; do
  [ -s "$log" ] || continue
  if grep -qE '^(no GPU|GPU:)' "$log"; then
    sed -n -E '/^(no GPU|GPU:)/,$p' "$log"
  else  # cut short: the rows finished so far
    grep -E '^\|' "$log"
  fi
done
if [ -s "$OUT/aoti.json" ]; then
  echo
  echo "== kiln / AOTInductor =="
  $PY - "$OUT/kiln.json" "$OUT/aoti.json" <<'PYEOF'
import json, sys
kiln = json.load(open(sys.argv[1])) if sys.argv[1] else []
aoti = {(r["model"], r["dtype"]): r for r in json.load(open(sys.argv[2]))}
for r in kiln:
    a = aoti.get((r["model"], r["dtype"]))
    if a and not r.get("error") and not a.get("error"):
        print(f"{r['model']} {r['dtype']}: kiln {r['compile_s']:.1f} s, AOTI "
              f"{a['compile_s']:.1f} s, ratio {r['compile_s'] / a['compile_s']:.2f}")
PYEOF
fi
exit $rc
