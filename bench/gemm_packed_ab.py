"""A/B of kiln's prepacked-weight CPU GEMM (kr::gemm_cpp_packed, bias + ReLU epilogue) at the
mlp and hf_bert_base shapes: the base tree's GEMM against this tree's loop orders, all in one
process (bench/gemm_packed_ab.cpp), interleaved burst by burst, at 1 and 2 threads; optionally
ONNX Runtime's MatMul + Add + Relu on the same shapes (MLAS, intra-op threads = the count).

  python bench/gemm_packed_ab.py BASE_ROOT [--rounds 9] [--burst 0.01] [--threads 1,2,2p]
      [--shapes MxNxK,...] [--modes hot,warm,cold] [--variants main,rows,blis,blispf,auto,main2]
      [--ort] [--json OUT]

BASE_ROOT is a checkout (or a folder holding kiln/runtime/model/kiln_gemm.h and
kiln_model_rt.h) whose GEMM is variant "main": its kiln_gemm.h and gemm_cpp_packed are copied
into namespace kr_a. Run it pinned as the issue's table is (`taskset -c 0,1`). Thread count
"2p": 2 threads, each pool member pinned to one CPU of the allowed set. Mode "cold": each call
reads another copy of the weight (--cold-mib of copies, past the L3), as a large model's GEMMs
read theirs from memory; "warm": --warm-mib of copies (past the L2s, within the L3: a small
model's weights); "hot": one weight, cached by the previous call. Times: per round each
variant runs a burst (>= 3 calls, >= --burst s) and keeps the burst's median; the table shows
the median over rounds (us) and the median over rounds of each round's ratio to "main" (the
variants of a round run back to back; "main2" is main again, a control for the noise).
--shapes replaces the mlp / BERT shapes (e.g. the encoders': 128x768x768,750x384x384).
GEMM_AB_HUGE=1 in the environment puts the weight copies on 2 MiB pages (madvise)."""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def base_header(base: Path) -> str:
    """The base tree's kiln_gemm.h and gemm_cpp_packed in namespace kr_a."""
    model = base / "kiln" / "runtime" / "model"
    gemm = (model / "kiln_gemm.h").read_text()
    gemm = gemm.replace("KILN_GEMM_H", "KILN_GEMM_A_H")
    gemm = gemm.replace("namespace kr {", "namespace kr_a {")
    gemm = re.sub(r"#define KILN_NOCLONE.*|#if defined\(__GNUC__\) && !defined\(__clang__\)\n"
                  r"#define KILN_NOCLONE[^\n]*\n#else\n#define KILN_NOCLONE\n#endif", "", gemm)
    rt = (model / "kiln_model_rt.h").read_text()
    m = re.search(r"template <class T, int NR, int MR, int KC[^>]*>\ninline int gemm_cpp_packed"
                  r".*?\n  return 0;\n}\n", rt, re.S)
    if not m:
        raise SystemExit(f"no gemm_cpp_packed in {model / 'kiln_model_rt.h'}")
    fn = m.group(0).replace("__attribute__((noinline))", "")
    return (gemm + "\nnamespace kr_a {\nusing kr::parallel_for;\nusing kr::max_threads;\n"
            + fn + "}  // namespace kr_a\n")


def cpu_flags() -> list[str]:
    out = subprocess.run(["c++", "-march=native", "-dM", "-E", "-x", "c++", "-"], input="",
                         capture_output=True, text=True).stdout
    return ["-march=x86-64-v4" if "__AVX512F__" in out else "-march=native"]


def build(base: Path, tmp: Path) -> Path:
    (tmp / "gemm_a.h").write_text(base_header(base))
    exe = tmp / "gemm_packed_ab"
    subprocess.run(["c++", "-O3", "-std=c++17", *cpu_flags(), "-fno-math-errno",
                    "-fno-trapping-math", "-fopenmp-simd", "-pthread", f"-I{tmp}",
                    f"-I{ROOT}/kiln/runtime/model", f"-I{ROOT}/kiln/runtime/include",
                    str(HERE / "gemm_packed_ab.cpp"), "-o", str(exe)], check=True)
    return exe


SHAPES = [(64, 1024, 1024), (64, 256, 1024), (128, 768, 768), (128, 3072, 768),
          (128, 768, 3072), (1, 768, 768), (8, 768, 768), (16, 768, 768), (16, 3072, 768)]


def ort_times(threads: list[int], rounds: int, secs: float) -> dict[tuple[int, str], float]:
    """ORT's MatMul(A, W^T) + bias + Relu per shape: median over rounds of each round's median
    call (us), from Python (run_with_iobinding: a few us of per-call overhead are included)."""
    import numpy as np
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    out: dict[tuple[int, str], float] = {}
    rng = np.random.default_rng(0)
    for th in threads:
        for m, n, k in SHAPES:
            w = (rng.random((k, n), dtype=np.float32) - 0.5)
            b = (rng.random(n, dtype=np.float32) - 0.5)
            g = helper.make_graph(
                [helper.make_node("MatMul", ["a", "w"], ["y"]),
                 helper.make_node("Add", ["y", "b"], ["z"]),
                 helper.make_node("Relu", ["z"], ["o"])], "g",
                [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
                [helper.make_tensor_value_info("o", TensorProto.FLOAT, [m, n])],
                [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
            model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
            model.ir_version = 8  # the device's ORT 1.30 reads IR <= 13
            so = ort.SessionOptions()
            so.intra_op_num_threads = th
            so.inter_op_num_threads = 1
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            sess = ort.InferenceSession(model.SerializeToString(), so,
                                        providers=["CPUExecutionProvider"])
            a = rng.random((m, k), dtype=np.float32) - 0.5
            io = sess.io_binding()
            io.bind_cpu_input("a", a)
            io.bind_output("o")
            for _ in range(5):
                sess.run_with_iobinding(io)
            meds = []
            for _ in range(rounds):
                t = []
                t0 = time.perf_counter()
                while len(t) < 3 or time.perf_counter() - t0 < secs:
                    t1 = time.perf_counter()
                    sess.run_with_iobinding(io)
                    t.append(time.perf_counter() - t1)
                meds.append(statistics.median(t) * 1e6)
            out[(th, f"{m}x{n}x{k}")] = statistics.median(meds)
    return out


FMA_SRC = r"""
// Each thread, pinned to one CPU of argv[1] (comma-separated), runs 12 independent chains of
// vector FMAs (the GEMM tile's 24 accumulators' worth of throughput) for argv[2] seconds, all
// threads at once; prints each thread's GFLOP/s. Two CPUs that share a physical core (host
// hyperthreads of a VM's vCPUs) each get about half of one CPU's rate alone.
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>
#if defined(__AVX512F__)
typedef __m512 V;
#define FMA _mm512_fmadd_ps
#define SET1 _mm512_set1_ps
#define FIRST _mm512_cvtss_f32
constexpr int W = 16;
#else
typedef __m256 V;
#define FMA _mm256_fmadd_ps
#define SET1 _mm256_set1_ps
#define FIRST _mm256_cvtss_f32
constexpr int W = 8;
#endif
static double run(double secs) {
  V a[12], b = SET1(0.999f), c = SET1(1e-3f);
  for (int i = 0; i < 12; ++i) a[i] = SET1(float(i));
  long it = 0;
  const auto t0 = std::chrono::steady_clock::now();
  double dt = 0;
  do {
    for (int r = 0; r < 1000; ++r)
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) a[i] = FMA(a[i], b, c);
    it += 1000;
    dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } while (dt < secs);
  float s = 0;
  for (int i = 0; i < 12; ++i) s += FIRST(a[i]);
  if (s == 1234.5f) std::printf("!");
  return it * 12.0 * W * 2 / dt * 1e-9;
}
int main(int argc, char **argv) {
  std::vector<int> cpus;
  for (std::string t, s = argv[1]; !s.empty();) {
    const size_t q = s.find(',');
    cpus.push_back(std::atoi(s.substr(0, q).c_str()));
    s = q == std::string::npos ? "" : s.substr(q + 1);
  }
  const double secs = std::atof(argv[2]);
  std::vector<double> g(cpus.size());
  std::vector<std::thread> th;
  for (size_t i = 0; i < cpus.size(); ++i)
    th.emplace_back([&, i] {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(cpus[i], &set);
      pthread_setaffinity_np(pthread_self(), sizeof set, &set);
      g[i] = run(secs);
    });
  for (auto &t : th) t.join();
  std::printf("FMA cpus %s:", argv[1]);
  for (double x : g) std::printf(" %.1f", x);
  std::printf(" GFLOP/s\n");
}
"""


def fma_pairs(sets: str, secs: float) -> None:
    """Per-thread FMA throughput with threads pinned to each CPU set of `sets` (';'-separated,
    e.g. "0;0,1;0,8"): whether two vCPUs share a physical core."""
    tmp = Path(tempfile.mkdtemp(prefix="fma_"))
    (tmp / "fma.cpp").write_text(FMA_SRC)
    subprocess.run(["c++", "-O3", "-std=c++17", *cpu_flags(), "-pthread", str(tmp / "fma.cpp"),
                    "-o", str(tmp / "fma")], check=True)
    for s in sets.split(";"):
        print(subprocess.run([str(tmp / "fma"), s, str(secs)], check=True, text=True,
                             capture_output=True).stdout, end="", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base", help="the base tree (variant main)")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--burst", type=float, default=0.01)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--modes", default="hot")
    ap.add_argument("--cold-mib", type=float, default=512)
    ap.add_argument("--warm-mib", type=float, default=48)
    ap.add_argument("--variants", default="main,rows,blis,auto")
    ap.add_argument("--shapes", help="M x N x K list instead of the mlp / BERT shapes, e.g. "
                    "'128x768x768,750x384x384'")
    ap.add_argument("--ort", action="store_true", help="also time ONNX Runtime per shape")
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--fma", help="only the FMA throughput of threads pinned to these CPU "
                    "sets (';'-separated, e.g. '0;0,1;0,8'), then exit")
    args = ap.parse_args()
    if args.fma:
        return fma_pairs(args.fma, 0.3)
    if args.shapes:
        SHAPES[:] = [tuple(int(x) for x in t.split("x")) for t in args.shapes.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="gemm_ab_"))
    exe = build(Path(args.base), tmp)
    proc = subprocess.run([str(exe), str(args.rounds), str(args.burst), args.threads, args.modes,
                           str(args.cold_mib), args.variants, str(args.warm_mib)], text=True,
                          capture_output=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               "GEMM_AB_SHAPES": ",".join(f"{m}x{n}x{k}" for m, n, k in SHAPES)})
    print(proc.stdout, end="")
    if proc.returncode:
        raise SystemExit(proc.stderr or f"gemm_packed_ab exited {proc.returncode}")
    res: dict[tuple[str, str, str, str], tuple[float, float, float]] = {}
    pool = []
    for line in proc.stdout.splitlines():
        f = line.split()
        if f and f[0] == "R":
            res[(f[1], f[2], f[3], f[4])] = (float(f[5]), float(f[6]), float(f[7]))
        elif f and f[0] == "P":
            pool.append(line)
    ort_res = {}
    if args.ort:
        ths = sorted({int(t.rstrip("p")) for t in args.threads.split(",")})
        ort_res = ort_times(ths, max(3, args.rounds // 2), args.burst)
    variants = args.variants.split(",")
    for th in args.threads.split(","):
        for mode in args.modes.split(","):
            print(f"\nthreads {th}, {mode}, {args.rounds} rounds: median us (median over "
                  "rounds of the ratio to main, timed next to it)"
                  + ("; ORT: one weight, cached" if ort_res and mode != "hot" else ""))
            hdr = "| shape | " + " | ".join(variants) + (" | ORT |" if ort_res else " |")
            print(hdr)
            print("|---" * (len(variants) + 1 + bool(ort_res)) + "|")
            for m, n, k in SHAPES:
                s = f"{m}x{n}x{k}"
                base = res.get((th, mode, s, "main"), (0, 0))[0]
                cells = []
                for v in variants:
                    t = res.get((th, mode, s, v))
                    ratio = f" ({t[2]:.3f})" if t and base and v != "main" else ""
                    cells.append("-" if t is None else f"{t[0]:.1f}{ratio}")
                if ort_res:
                    o = ort_res.get((int(th.rstrip("p")), s))
                    cells.append("-" if o is None else
                                 f"{o:.1f}" + (f" ({o / base:.3f})" if base else ""))
                print(f"| {s} | " + " | ".join(cells) + " |")
    for line in pool:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"kiln": [[*k, *v] for k, v in res.items()],
             "ort": [[*k, v] for k, v in ort_res.items()], "pool": pool}, indent=1))


if __name__ == "__main__":
    main()
