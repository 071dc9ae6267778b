"""Per-layer CPU convolution times without oneDNN: kiln_conv.h's `conv2d_nchwc` on one
convolution shape at a time (the layers of ResNet-18/50, MobileNetV2 and ConvNeXt-T at 224,
batch 1, float32, NCHWc with the fused epilogue), for the header of one or more kiln trees
(an A/B of the kernels), on one thread.

Each tree's header is compiled into a small driver with kiln's CPU flags (Options() ->
targets/cpu/build.toolchain, -march of this machine; the tree's own runtime and CPU include
folders). A driver checks its output against a float64 loop over 4000 sampled outputs, then
times each shape's calls (the fastest call over ~--seconds). Rounds alternate the trees
(A, B, A, B, ...); the figure is each shape's fastest call over the rounds, so a round
preempted on a shared machine only loses its own samples. The load average is printed.

    taskset -c 1 python bench/conv_layers_cpu.py [--trees /work/main,.] [--rounds 3]
                                                 [--only dw7x7,r18_] [--seconds 0.3]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.options import Options  # noqa: E402
from kiln.targets.cpu.build import toolchain  # noqa: E402
from kiln.toolchain.cxx import build_executable  # noqa: E402

# name: depthwise, NCHW input, N, IC, H, W, OC, KH, KW, stride, padding, act (0 none, 1 relu,
# 2 relu6), residual
SHAPES = {
    "r18_stem7x7s2": (0, 1, 1, 3, 224, 224, 64, 7, 7, 2, 3, 1, 0),
    "r18_3x3_56": (0, 0, 1, 64, 56, 56, 64, 3, 3, 1, 1, 1, 0),
    "r18_3x3s2_56": (0, 0, 1, 64, 56, 56, 128, 3, 3, 2, 1, 1, 0),
    "r18_1x1s2_56": (0, 0, 1, 64, 56, 56, 128, 1, 1, 2, 0, 0, 0),
    "r18_3x3_28_res": (0, 0, 1, 128, 28, 28, 128, 3, 3, 1, 1, 1, 1),
    "r18_3x3s2_28": (0, 0, 1, 128, 28, 28, 256, 3, 3, 2, 1, 1, 0),
    "r18_3x3_14": (0, 0, 1, 256, 14, 14, 256, 3, 3, 1, 1, 1, 0),
    "r18_3x3_7": (0, 0, 1, 512, 7, 7, 512, 3, 3, 1, 1, 1, 0),
    "r50_1x1_256_64_56": (0, 0, 1, 256, 56, 56, 64, 1, 1, 1, 0, 1, 0),
    "r50_1x1_64_256_56_res": (0, 0, 1, 64, 56, 56, 256, 1, 1, 1, 0, 1, 1),
    "r50_1x1_512_128_28": (0, 0, 1, 512, 28, 28, 128, 1, 1, 1, 0, 1, 0),
    "r50_1x1_1024_256_14": (0, 0, 1, 1024, 14, 14, 256, 1, 1, 1, 0, 1, 0),
    "mv2_stem3x3s2": (0, 1, 1, 3, 224, 224, 32, 3, 3, 2, 1, 2, 0),
    "mv2_dw3x3_112": (1, 0, 1, 32, 112, 112, 32, 3, 3, 1, 1, 2, 0),
    "mv2_dw3x3s2_112": (1, 0, 1, 96, 112, 112, 96, 3, 3, 2, 1, 2, 0),
    "mv2_dw3x3_56": (1, 0, 1, 144, 56, 56, 144, 3, 3, 1, 1, 2, 0),
    "mv2_dw3x3_14": (1, 0, 1, 384, 14, 14, 384, 3, 3, 1, 1, 2, 0),
    "mv2_dw3x3_7": (1, 0, 1, 960, 7, 7, 960, 3, 3, 1, 1, 2, 0),
    "mv2_1x1_32_16_112": (0, 0, 1, 32, 112, 112, 16, 1, 1, 1, 0, 0, 0),
    "mv2_1x1_96_24_56": (0, 0, 1, 96, 56, 56, 24, 1, 1, 1, 0, 0, 0),
    "cnx_stem4x4s4": (0, 1, 1, 3, 224, 224, 96, 4, 4, 4, 0, 0, 0),
    "cnx_dw7x7_56": (1, 0, 1, 96, 56, 56, 96, 7, 7, 1, 3, 0, 0),
    "cnx_dw7x7_28": (1, 0, 1, 192, 28, 28, 192, 7, 7, 1, 3, 0, 0),
    "cnx_dw7x7_14": (1, 0, 1, 384, 14, 14, 384, 7, 7, 1, 3, 0, 0),
    "cnx_dw7x7_7": (1, 0, 1, 768, 7, 7, 768, 7, 7, 1, 3, 0, 0),
    "cnx_2x2s2_28": (0, 0, 1, 192, 28, 28, 384, 2, 2, 2, 0, 0, 0),
}

DRIVER = r'''// bench/conv_layers_cpu.py: times kl::conv2d_nchwc on the shapes given as arguments
#define KILN_CONV_IMPL
#define KILN_CONV_B16
#define KILN_CONV_B8
#include "kiln_conv.h"
#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>
static double one(const int64_t *v, double min_s, double *err) {
  const bool dwise = v[0], plain = v[1];
  const int64_t n = v[2], ic = v[3], ih = v[4], iw = v[5], oc = v[6], kh = v[7], kw = v[8],
                st = v[9], pd = v[10], act = v[11], residual = v[12];
  const int64_t B = @BLOCK@;
  const int64_t icp = plain ? ic : (ic + B - 1) / B * B, ocp = (oc + B - 1) / B * B;
  const int64_t oh = (ih + 2 * pd - kh) / st + 1, ow = (iw + 2 * pd - kw) / st + 1;
  const int64_t icn = plain ? icp : B;
  std::vector<int64_t> xd = plain ? std::vector<int64_t>{n, icp, ih, iw, icp * ih * iw, ih * iw,
                                                        iw, 1}
      : std::vector<int64_t>{n, icp / B, ih, iw, B, icp * ih * iw, ih * iw * B, iw * B, B, 1};
  std::vector<int64_t> wd = dwise ? std::vector<int64_t>{ocp / B, kh, kw, B, kh * kw * B,
                                                        kw * B, B, 1}
      : std::vector<int64_t>{ocp / B, icp / icn, kh, kw, icn, B, icp * kh * kw * B,
                             kh * kw * icn * B, kw * icn * B, icn * B, B, 1};
  const int64_t bd[] = {ocp, 1};
  const int64_t od[] = {n, ocp / B, oh, ow, B, ocp * oh * ow, oh * ow * B, ow * B, B, 1};
  std::vector<float> x(n * icp * ih * iw), w(dwise ? ocp * kh * kw : ocp * icp * kh * kw),
      b(ocp), res(n * ocp * oh * ow), out(res.size());
  uint64_t s = 88172645463325252ull;
  auto rnd = [&]() {
    s ^= s << 13; s ^= s >> 7; s ^= s << 17;
    return float((s >> 11) * 0x1p-53 - 0.5);
  };
  auto xat = [&](int64_t i, int64_t c, int64_t y, int64_t xx) -> float & {
    return plain ? x[((i * icp + c) * ih + y) * iw + xx]
                 : x[(((i * (icp / B) + c / B) * ih + y) * iw + xx) * B + c % B];
  };
  auto wat = [&](int64_t o, int64_t c, int64_t ky, int64_t kx) -> float & {
    return dwise ? w[((o / B * kh + ky) * kw + kx) * B + o % B]
                 : w[(((o / B * (icp / icn) + c / icn) * kh + ky) * kw + kx) * icn * B +
                     (c % icn) * B + o % B];
  };
  for (auto *a : {&b, &res}) for (auto &e : *a) e = rnd();
  for (int64_t i = 0; i < n; ++i)  // padded channels stay zero, as kiln's layout keeps them
    for (int64_t c = 0; c < ic; ++c)
      for (int64_t y = 0; y < ih; ++y)
        for (int64_t xx = 0; xx < iw; ++xx) xat(i, c, y, xx) = rnd();
  for (int64_t o = 0; o < oc; ++o)
    for (int64_t c = 0; c < (dwise ? 1 : ic); ++c)
      for (int64_t ky = 0; ky < kh; ++ky)
        for (int64_t kx = 0; kx < kw; ++kx) wat(o, c, ky, kx) = rnd();
  kr::Pool pool;
  kr::RunScope scope(&pool);
  char msg[512] = "";
  kr::Err e{msg, sizeof msg};
  auto X = kl::view(x.data(), plain ? 4 : 5, xd.data());
  auto W = kl::view(w.data(), dwise ? 4 : 6, wd.data());
  auto Bv = kl::view(b.data(), 1, bd);
  auto R = kl::view(res.data(), 5, od);
  auto call = [&]() {
    return residual ? kl::conv2d_nchwc(e, "conv", out.data(), oh, ow, st, st, pd, pd, 1, 1, dwise,
                                       act, 0, 6, 1, X, W, Bv, R)
                    : kl::conv2d_nchwc(e, "conv", out.data(), oh, ow, st, st, pd, pd, 1, 1, dwise,
                                       act, 0, 6, 1, X, W, Bv);
  };
  if (call()) { std::fprintf(stderr, "%s\n", msg); std::exit(3); }
  *err = 0;
  for (int64_t q = 0; q < 4000; ++q) {
    const int64_t i = q % n, o = (q * 104729) % oc, y = (q * 31) % oh, xx = (q * 17) % ow;
    double acc = b[o];
    for (int64_t ky = 0; ky < kh; ++ky)
      for (int64_t kx = 0; kx < kw; ++kx) {
        const int64_t iy = y * st + ky - pd, ix = xx * st + kx - pd;
        if (iy < 0 || iy >= ih || ix < 0 || ix >= iw) continue;
        if (dwise) acc += double(wat(o, 0, ky, kx)) * xat(i, o, iy, ix);
        else
          for (int64_t c = 0; c < ic; ++c) acc += double(wat(o, c, ky, kx)) * xat(i, c, iy, ix);
      }
    const int64_t oi = (((i * (ocp / B) + o / B) * oh + y) * ow + xx) * B + o % B;
    if (residual) acc += res[oi];
    if (act == 1) acc = acc > 0 ? acc : 0;
    if (act == 2) acc = std::min(6.0, std::max(0.0, acc));
    *err = std::max(*err, std::fabs(acc - out[oi]));
  }
  using clk = std::chrono::steady_clock;
  double best = 1e30, total = 0;
  for (int rep = 0; rep < 100000 && (rep < 10 || total < min_s); ++rep) {
    const auto t0 = clk::now();
    call();
    const double dt = std::chrono::duration<double>(clk::now() - t0).count();
    total += dt;
    best = std::min(best, dt);
  }
  return best;
}
int main(int argc, char **argv) {  // MIN_SECONDS then 13 numbers per shape
  const double min_s = std::atof(argv[1]);
  for (int a = 2; a + 13 <= argc; a += 13) {
    int64_t v[13];
    for (int i = 0; i < 13; ++i) v[i] = std::atoll(argv[a + i]);
    double err;
    const double t = one(v, min_s, &err);
    std::printf("%.9g %.3g\n", t, err);
  }
  return 0;
}
'''


def driver(tree: Path, block: int) -> Path:
    """The timing driver compiled against `tree`'s kiln_conv.h (cached by content)."""
    tc = toolchain(Options())
    inc = tuple(tree / "kiln" / p for p in ("runtime/include", "runtime/model", "runtime/src",
                                            "targets/cpu/include"))
    tc = dataclasses.replace(tc, include_dirs=inc)
    return build_executable(tc, DRIVER.replace("@BLOCK@", str(block)), "conv_layers",
                            "the convolution layer driver's compile")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default=str(ROOT), help="comma-separated kiln trees (A,B,...)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.3, help="timed seconds per shape and round")
    p.add_argument("--only", default="", help="comma-separated name prefixes")
    p.add_argument("--block", type=int, default=16, help="channel block (16: AVX-512, 8)")
    a = p.parse_args()
    trees = [Path(t).resolve() for t in a.trees.split(",")]
    names = [n for n in SHAPES if not a.only or any(n.startswith(o) for o in a.only.split(","))]
    exes = [driver(t, a.block) for t in trees]
    args = [str(a.seconds)] + [str(v) for n in names for v in SHAPES[n]]
    best = [[float("inf")] * len(names) for _ in trees]
    err = [[0.0] * len(names) for _ in trees]
    for _ in range(a.rounds):
        for k, exe in enumerate(exes):
            out = subprocess.run([str(exe), *args], capture_output=True, text=True, check=True)
            for i, line in enumerate(out.stdout.split("\n")[:len(names)]):
                t, e = map(float, line.split())
                best[k][i], err[k][i] = min(best[k][i], t), max(err[k][i], e)
    print(f"load {os.getloadavg()}; trees: " + ", ".join(f"{chr(65 + k)} = {t}"
                                                          for k, t in enumerate(trees)))
    head = " | ".join(f"{chr(65 + k)} us (GMAC/s)" for k in range(len(trees)))
    print(f"| layer | {head} |" + (" B / A |" if len(trees) > 1 else ""))
    print("|---|" + "---:|" * (len(trees) + (len(trees) > 1)))
    for i, n in enumerate(names):
        dwise, _, nb, ic, ih, iw, oc, kh, kw, st, pd, _, _ = SHAPES[n]
        oh, ow = (ih + 2 * pd - kh) // st + 1, (iw + 2 * pd - kw) // st + 1
        macs = nb * oh * ow * oc * (1 if dwise else ic) * kh * kw
        cells = " | ".join(f"{best[k][i] * 1e6:.1f} ({macs / best[k][i] / 1e9:.1f})"
                           for k in range(len(trees)))
        ratio = f" {best[1][i] / best[0][i]:.3f} |" if len(trees) > 1 else ""
        bad = [k for k in range(len(trees)) if err[k][i] > 1e-3]
        print(f"| {n} | {cells} |{ratio}" + (f" ERROR {[err[k][i] for k in bad]}" if bad else ""))


if __name__ == "__main__":
    main()
