#!/usr/bin/env bash
# GPU run for generation on CUDA (issue 17, branch s3gen): the GPU tests of the device sampler,
# the CUDA generation loop (Python, CLI, examples/c/generate.c), one weight upload per package,
# the int8 / int4 weight-only GEMMs (against the dequantised model, KL report)
# and the CUDA LLM tests, then bench/gen_gpu.py (decode ms/token and tokens/s of
# `kiln generate` on CUDA; bf16, int8, int4 weights). Logs under $OUT, a short table last.
# On the device machine, from the worktree root (< 8 minutes):
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD; bash scripts/gen_device.sh
# Knobs: BENCH_ARGS (e.g. "--layers 4"), WQ (default none,int8,int4), SKIP_TESTS=1, SKIP_BENCH=1.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln_cache}
PY=${PY:-python3}
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  uptime; } 2>&1 | tee "$OUT/env.log"
t0=$(date +%s)
rc=0
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout ${TEST_TIMEOUT:-200} $PY -m pytest -m gpu -q -p no:cacheprovider -o addopts="" \
    tests/targets/cuda/test_generate_cuda.py tests/targets/cuda/test_quant_cuda.py \
    tests/targets/cuda/test_llm_cuda.py \
    ${GEN_TESTS:-} 2>&1 | grep -v "^DEBUG" | tee "$OUT/pytest_gpu.log" | tail -30
  rc=${PIPESTATUS[0]}
fi
t1=$(date +%s)
if [ -z "${SKIP_BENCH:-}" ]; then
  cc -O2 -Wall -Wextra -I kiln/runtime/include examples/c/generate.c \
    -L"$($PY -c 'from kiln.runtime.build import build_libkiln; print(build_libkiln().parent)')" \
    -lkiln -Wl,-rpath,"$($PY -c 'from kiln.runtime.build import build_libkiln; print(build_libkiln().parent)')" \
    -ldl -o "$OUT/generate" 2>&1 | tee "$OUT/cc.log"
  timeout ${BENCH_TIMEOUT:-240} $PY bench/gen_gpu.py --weight-quant "${WQ:-none,int8,int4}" \
    --json "$OUT/gen_gpu.json" --c-exe "$OUT/generate" ${BENCH_ARGS:-} 2>&1 \
    | grep -v "^DEBUG" | tee "$OUT/bench_gen.log" | tail -25
fi
t2=$(date +%s)
echo "== summary: pytest -m gpu rc=$rc ($((t1 - t0)) s): $(tail -1 "$OUT/pytest_gpu.log" 2>/dev/null); bench $((t2 - t1)) s"
# the rows the bench finished (each printed as JSON when done, also after a timeout)
$PY - "$OUT/bench_gen.log" <<'PYEOF' 2>/dev/null
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.startswith('{"weights"')]
print("weights | decode ms/token device greedy (tok/s) | host greedy | device sampled | "
      "prefill ms | roofline ms | compile s")
for r in rows:
    if "error" in r:
        print(r["weights"], "|", r["error"][:100])
        continue
    f = lambda k: f"{r[k]:.3f} ({r[k + ' tok/s']:.0f})"
    roof = f"{r['roofline_ms']:.3f}" if r.get("roofline_ms") else "-"
    print(f"{r['weights']} | {f('device greedy')} | {f('host greedy')} | "
          f"{f('device sampled')} | {r['prefill_ms']:.2f} | {roof} | {r['compile_s']:.0f}")
PYEOF
