"""Per-layer times of a CPU package's direct convolutions (and NCHWc max pooling) at 1 and 2
threads (issue 14, items 1 and 3: where a convolution network's 2-thread time goes).

The package's wrapper (src/model.cpp) is read; every `kl::conv2d_nchwc` (and
`kl::max_pool2d_nchwc`) call block is copied verbatim into a C++ program (its buffers become
arrays of the sizes its views reach, filled with small random values), which runs the calls
in the package's order, `--reps` times per thread count, timing each call with
omp_get_wtime, and compiles kiln_conv.h as a package's conv.cpp does (-O3 -march=native
-fopenmp). Calls run back to back as in a package run, so caches hold what they would.
GOMP_SPINCOUNT=1000, as libkiln sets it. Per layer: the median (or --stat p10: the 10th
percentile, a quiet machine's time on a loaded one) call at each thread count, the speed-up,
GFLOPS at 1 thread.

    python bench/conv_layers.py PKG.kiln [--threads 1,2] [--reps 50] [--taskset 0,1] [--top 20]
    python bench/conv_layers.py --model mobilenet_v2 [...]    (bench/conv_cpu.py's models)

--headers DIR compiles kiln_conv.h (and kiln_lib.h) from DIR instead: an A/B of a saved copy
(with --convs-only for a copy from before kl::max_pool2d_nchwc).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BLOCK = re.compile(r"^  \{  // lib\.(conv2d|conv2d_block|max_pool2d)_nchwc -> (\w+).*?^  \}\n",
                   re.S | re.M)
DIMS = re.compile(r"const int64_t (d\d+)\[\] = \{([^}]*)\};")
VIEW = re.compile(r"kl::view\((buf_\w+) \+ 0, (\d+), (d\d+)\)")
OUT = re.compile(r"kl::(?:conv2d|conv2d_block|max_pool2d)_nchwc\(e, \"[^\"]*\", (buf_\w+),")
ARG = re.compile(r"/\*(\w+)=\*/(?:int64_t\()?([-\w.]+)\)?")


def extent(dims: list[int], rank: int) -> int:
    return 1 + sum((dims[i] - 1) * dims[rank + i] for i in range(rank))


def layers(model_cpp: str, pools: bool = True) -> list[dict]:
    out = []
    for m in BLOCK.finditer(model_cpp):
        text = m.group(0)
        if m.group(1) == "max_pool2d" and not pools:
            continue
        dims = {k: [int(v) for v in vals.split(",")] for k, vals in DIMS.findall(text)}
        views = [(buf, int(rank), dims[d]) for buf, rank, d in VIEW.findall(text)]
        args = dict(ARG.findall(text))
        name = m.group(2)
        if m.group(1) == "max_pool2d":  # kiln_conv.h's max pooling: count a max as a MAC
            x = views[0][2]
            oh, ow, kh, kw = (int(args[k]) for k in ("oh", "ow", "kh", "kw"))
            out.append(dict(name=name, text=text, views=views, out=OUT.search(text).group(1),
                            out_size=x[0] * x[1] * oh * ow * x[4],
                            macs=x[0] * x[1] * x[4] * oh * ow * kh * kw,
                            desc=(f"maxpool {kh}x{kw}/{args['sh']} {x[1] * x[4]} "
                                  f"{x[2]}x{x[3]}->{oh}x{ow} n{x[0]}")))
            continue
        if m.group(1) == "conv2d_block":  # inverted residual: expand, depthwise, project
            x, w1, w2, w3 = (views[i][2] for i in (0, 1, 3, 5))
            oh, ow, blk = int(args["oh"]), int(args["ow"]), w2[3]
            hid, kh, kw = w2[0] * blk, w2[1], w2[2]
            macs = x[0] * hid * (x[2] * x[3] * x[1] * blk + oh * ow * (kh * kw + w3[0] * blk))
            out.append(dict(name=name, text=text, views=views, out=OUT.search(text).group(1),
                            out_size=x[0] * w3[0] * oh * ow * blk, macs=macs,
                            desc=(f"block {x[1] * blk}->{hid}->{w3[0] * blk} dw {kh}x{kw}/"
                                  f"{args['sh']} {x[2]}x{x[3]}->{oh}x{ow} n{x[0]}")))
            continue
        x, w = views[0][2], views[1][2]
        dw = args["depthwise"] == "true"
        blk = w[len(w) // 2 - 1]
        oh, ow = int(args["oh"]), int(args["ow"])
        ocb = w[0]
        n = x[0]
        if dw:
            kh, kw, icn, icb = w[1], w[2], 1, 1
        else:
            kh, kw, icn, icb = w[2], w[3], w[4], w[1]
        macs = n * ocb * blk * oh * ow * kh * kw * icb * icn
        out.append(dict(name=name, text=text, views=views, out=OUT.search(text).group(1),
                        out_size=n * ocb * oh * ow * blk, macs=macs,
                        desc=(f"{'dw' if dw else 'conv'} {kh}x{kw}/{args['sh']} "
                              f"{(icb * icn) if not dw else ocb * blk}->{ocb * blk} "
                              f"{x[2]}x{x[3]}->{oh}x{ow} n{n}")))
    return out


def program(ls: list[dict], threads: list[int], reps: int) -> str:
    sizes: dict[str, int] = {}
    for lay in ls:
        for buf, rank, d in lay["views"]:
            sizes[buf] = max(sizes.get(buf, 0), extent(d, rank))
        sizes[lay["out"]] = max(sizes.get(lay["out"], 0), lay["out_size"])
    decl = "".join(f"static float *{b} = alloc({n});\n" for b, n in sizes.items())
    calls = []
    for i, lay in enumerate(ls):
        body = re.sub(r"/\*threads=\*/int64_t\(\d+\)", "/*threads=*/int64_t(T)", lay["text"])
        body = body.replace("goto fail;", "return 1;")
        calls.append(f"  t0 = omp_get_wtime();\n{body}"
                     f"  ms[{i}][r] = 1e3 * (omp_get_wtime() - t0);\n")
    return f"""#define KILN_CONV_IMPL
#define KILN_CONV_B16
#define KILN_CONV_B8
#include "kiln_conv.h"
#include <omp.h>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>
static float *alloc(long n) {{
  float *p = static_cast<float *>(aligned_alloc(64, ((n * 4 + 63) / 64) * 64));
  for (long i = 0; i < n; ++i) p[i] = float(rand() % 2001 - 1000) * 1e-4f;
  return p;
}}
static double ms[{len(ls)}][{reps}];
{decl}static int once(kr::Err &e, int T, int r) {{
  double t0;
{''.join(calls)}  return 0;
}}
int main() {{
  kr::Err e;
  for (int T : {{{', '.join(map(str, threads))}}}) {{
    omp_set_num_threads(T);
    for (int r = 0; r < {reps}; ++r)
      if (once(e, T, r)) {{ fprintf(stderr, "failed\\n"); return 1; }}
    for (int i = 0; i < {len(ls)}; ++i) {{
      std::vector<double> v(ms[i], ms[i] + {reps});
      std::sort(v.begin(), v.end());
      printf("%d %d %.5f %.5f\\n", T, i, v[v.size() / 2], v[v.size() / 10]);
    }}
  }}
  return 0;
}}
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("package", nargs="?")
    ap.add_argument("--model", help="build this bench/conv_cpu.py model first")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--taskset", default=None)
    ap.add_argument("--top", type=int, default=0, help="only the N slowest layers at 2 threads")
    ap.add_argument("--stat", choices=("median", "p10"), default="median",
                    help="p10: the 10th percentile call (a quiet machine's time, under load)")
    ap.add_argument("--headers", help="kiln_conv.h from this folder (an A/B against a copy)")
    ap.add_argument("--convs-only", action="store_true",
                    help="leave the pools out (headers from before max_pool2d_nchwc)")
    ap.add_argument("--cxx", default=os.environ.get("CXX", "g++"))
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-conv-layers-"))
    pkg = a.package
    if a.model:
        import kiln  # deferred: only to build the model
        from bench.conv_cpu import models
        module, x = models()[a.model]
        pkg = kiln.compile(module, (x,), options=kiln.Options(num_threads=2)).save(
            work / f"{a.model}.kiln")
    src = zipfile.ZipFile(pkg).read("src/model.cpp").decode()
    ls = layers(src, pools=not a.convs_only)
    threads = [int(t) for t in a.threads.split(",")]
    (work / "layers.cpp").write_text(program(ls, threads, a.reps))
    inc = Path(a.headers) if a.headers else ROOT / "kiln" / "targets" / "cpu" / "include"
    rt = ROOT / "kiln" / "runtime"
    exe = work / "layers"
    subprocess.run([a.cxx, "-std=c++17", "-O3", "-march=native", "-fopenmp", "-fno-math-errno",
                    "-fno-trapping-math", f"-I{inc}", f"-I{rt / 'include'}", f"-I{rt / 'model'}",
                    f"-I{rt / 'src'}", str(work / "layers.cpp"), "-o", str(exe)], check=True)
    cmd = ([ "taskset", "-c", a.taskset] if a.taskset else []) + [str(exe)]
    env = dict(os.environ, GOMP_SPINCOUNT=os.environ.get("GOMP_SPINCOUNT", "1000"))
    print(f"program: {exe}")
    res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout
    t: dict[tuple[int, int], float] = {}
    for line in res.split("\n"):
        if line:
            nt, i, med, p10 = line.split()
            t[int(nt), int(i)] = float(p10 if a.stat == "p10" else med)
    t1, t2 = threads[0], threads[-1]
    rows = sorted(range(len(ls)), key=lambda i: -t[t2, i]) if a.top else range(len(ls))
    rows = list(rows)[: a.top] if a.top else rows
    print(f"load {os.getloadavg()[0]:.2f}; {len(ls)} convolutions; ms per call ({a.stat} of "
          f"{a.reps})")
    print(f"{'#':>3} {'layer':<24} {'shape':<34} {f'{t1}T ms':>8} {f'{t2}T ms':>8} "
          f"{'speedup':>7} {'GF/s 1T':>8}")
    for i in rows:
        lay = ls[i]
        print(f"{i:>3} {lay['name']:<24} {lay['desc']:<34} {t[t1, i]:>8.4f} {t[t2, i]:>8.4f} "
              f"{t[t1, i] / t[t2, i]:>7.2f} {2 * lay['macs'] / t[t1, i] / 1e6:>8.1f}")
    s1 = sum(t[t1, i] for i in range(len(ls)))
    s2 = sum(t[t2, i] for i in range(len(ls)))
    print(f"total {t1}T {s1:.3f} ms, {t2}T {s2:.3f} ms, speed-up {s1 / s2:.2f}")


if __name__ == "__main__":
    main()
