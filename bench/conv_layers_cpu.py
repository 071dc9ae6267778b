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

--peers ort,openvino adds the same layer in ONNX Runtime and OpenVINO (1 thread): a one-node
ONNX model per shape (Conv [+ Add of a residual input] [+ Relu / Clip(0, 6)]), whose
convolution node's time is read from the runtime's own per-node profile (ORT's profiler;
OpenVINO's PERF_COUNT), so the layout reorders around a lone convolution do not count; the
figure is the fastest call of the node over the rounds (each round ~--seconds of calls),
rounds interleaved with kiln's.

    taskset -c 1 python bench/conv_layers_cpu.py [--trees /work/main,.] [--rounds 3]
                                                 [--only dw7x7,r18_] [--seconds 0.3]
                                                 [--peers ort,openvino]
                                                 [--march x86-64-v3 --block 8]
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
    "r50_3x3s2_256_28": (0, 0, 1, 256, 28, 28, 256, 3, 3, 2, 1, 1, 0),
    "r50_1x1s2_512_1024_28": (0, 0, 1, 512, 28, 28, 1024, 1, 1, 2, 0, 0, 0),
    "r50_1x1_64_64_56": (0, 0, 1, 64, 56, 56, 64, 1, 1, 1, 0, 1, 0),
    "r50_1x1_256_128_56": (0, 0, 1, 256, 56, 56, 128, 1, 1, 1, 0, 1, 0),
    "r50_1x1s2_256_512_56": (0, 0, 1, 256, 56, 56, 512, 1, 1, 2, 0, 0, 0),
    "r50_3x3s2_128_56": (0, 0, 1, 128, 56, 56, 128, 3, 3, 2, 1, 1, 0),
    "r50_1x1_128_512_28_res": (0, 0, 1, 128, 28, 28, 512, 1, 1, 1, 0, 1, 1),
    "r50_1x1_512_256_28": (0, 0, 1, 512, 28, 28, 256, 1, 1, 1, 0, 1, 0),
    "r50_1x1_256_1024_14_res": (0, 0, 1, 256, 14, 14, 1024, 1, 1, 1, 0, 1, 1),
    "r50_1x1_512_2048_7_res": (0, 0, 1, 512, 7, 7, 2048, 1, 1, 1, 0, 1, 1),
    "mv2_stem3x3s2": (0, 1, 1, 3, 224, 224, 32, 3, 3, 2, 1, 2, 0),
    "mv2_dw3x3_112": (1, 0, 1, 32, 112, 112, 32, 3, 3, 1, 1, 2, 0),
    "mv2_dw3x3s2_112": (1, 0, 1, 96, 112, 112, 96, 3, 3, 2, 1, 2, 0),
    "mv2_dw3x3_56": (1, 0, 1, 144, 56, 56, 144, 3, 3, 1, 1, 2, 0),
    "mv2_dw3x3_14": (1, 0, 1, 384, 14, 14, 384, 3, 3, 1, 1, 2, 0),
    "mv2_dw3x3_7": (1, 0, 1, 960, 7, 7, 960, 3, 3, 1, 1, 2, 0),
    "mv2_1x1_32_16_112": (0, 0, 1, 32, 112, 112, 16, 1, 1, 1, 0, 0, 0),
    "mv2_1x1_96_24_56": (0, 0, 1, 96, 56, 56, 24, 1, 1, 1, 0, 0, 0),
    "mv2_1x1_16_96_112": (0, 0, 1, 16, 112, 112, 96, 1, 1, 1, 0, 2, 0),
    "mv2_1x1_24_144_56": (0, 0, 1, 24, 56, 56, 144, 1, 1, 1, 0, 2, 0),
    "mv2_1x1_144_24_56_res": (0, 0, 1, 144, 56, 56, 24, 1, 1, 1, 0, 0, 1),
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


def driver(tree: Path, block: int, march: str | None = None) -> Path:
    """The timing driver compiled against `tree`'s kiln_conv.h (cached by content), for
    -march=`march` (default: this machine's level)."""
    tc = toolchain(Options(), march)
    inc = tuple(tree / "kiln" / p for p in ("runtime/include", "runtime/model", "runtime/src",
                                            "targets/cpu/include"))
    tc = dataclasses.replace(tc, include_dirs=inc)
    return build_executable(tc, DRIVER.replace("@BLOCK@", str(block)), "conv_layers",
                            "the convolution layer driver's compile")


def _onnx_layer(name: str, path: Path) -> list:
    """A one-convolution ONNX model of SHAPES[name] at `path`; returns its inputs."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    dwise, _, n, ic, ih, iw, oc, kh, kw, st, pd, act, residual = SHAPES[name]
    oh, ow = (ih + 2 * pd - kh) // st + 1, (iw + 2 * pd - kw) // st + 1
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((oc, 1 if dwise else ic, kh, kw)) * 0.1).astype(np.float32)
    b = rng.standard_normal(oc).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["y0"], kernel_shape=[kh, kw],
                              strides=[st, st], pads=[pd] * 4, group=ic if dwise else 1,
                              name="conv")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, ic, ih, iw])]
    feeds = [rng.standard_normal((n, ic, ih, iw)).astype(np.float32)]
    y = "y0"
    if residual:
        nodes.append(helper.make_node("Add", [y, "r"], ["y1"], name="add"))
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [n, oc, oh, ow]))
        feeds.append(rng.standard_normal((n, oc, oh, ow)).astype(np.float32))
        y = "y1"
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    if act == 1:
        nodes.append(helper.make_node("Relu", [y], ["y2"], name="act"))
        y = "y2"
    elif act == 2:
        inits += [numpy_helper.from_array(np.float32(0), "lo"),
                  numpy_helper.from_array(np.float32(6), "hi")]
        nodes.append(helper.make_node("Clip", [y, "lo", "hi"], ["y2"], name="act"))
        y = "y2"
    out = helper.make_tensor_value_info(y, TensorProto.FLOAT, [n, oc, oh, ow])
    g = helper.make_graph(nodes, name, inputs, [out], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return feeds


def peer_round(system: str, names: list[str], seconds: float, work: Path) -> list[float]:
    """Each layer's fastest convolution-node call (s) in `system`, ~`seconds` of calls each."""
    import json
    import time

    res = []
    for nm in names:
        path = work / f"{nm}.onnx"
        feeds = _onnx_layer(nm, path)
        times = []
        if system == "ort":
            import onnxruntime as ort

            so = ort.SessionOptions()
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            so.intra_op_num_threads, so.inter_op_num_threads = 1, 1
            so.enable_profiling = True
            so.profile_file_prefix = str(work / "ort")
            sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
            feed = {i.name: a for i, a in zip(sess.get_inputs(), feeds)}
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                sess.run(None, feed)
            prof = sess.end_profiling()
            with open(prof) as f:
                ev = json.load(f)
            os.unlink(prof)
            times = [e["dur"] * 1e-6 for e in ev
                     if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
                     and "Conv" in e.get("args", {}).get("op_name", "")]
        else:
            import openvino as ov

            cm = ov.Core().compile_model(str(path), "CPU", {
                "PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": 1,
                "INFERENCE_PRECISION_HINT": "f32", "PERF_COUNT": "YES"})
            rq = cm.create_infer_request()
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                rq.infer(feeds)
                times += [p.real_time.total_seconds() for p in rq.get_profiling_info()
                          if p.node_type in ("Convolution", "GroupConvolution")
                          and p.real_time.total_seconds() > 0]
        res.append(min(times) if times else float("nan"))
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", default=str(ROOT), help="comma-separated kiln trees (A,B,...)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=0.3, help="timed seconds per shape and round")
    p.add_argument("--only", default="", help="comma-separated name prefixes")
    p.add_argument("--block", type=int, default=16, help="channel block (16: AVX-512, 8)")
    p.add_argument("--peers", default="", help="comma-separated: ort, openvino")
    p.add_argument("--march", help="compile the drivers for this -march (x86-64-v3: the AVX2 "
                                   "code, with --block 8)")
    a = p.parse_args()
    peers = [q for q in a.peers.split(",") if q]
    trees = [Path(t).resolve() for t in a.trees.split(",")]
    names = [n for n in SHAPES if not a.only or any(n.startswith(o) for o in a.only.split(","))]
    exes = [driver(t, a.block, a.march) for t in trees]
    args = [str(a.seconds)] + [str(v) for n in names for v in SHAPES[n]]
    best = [[float("inf")] * len(names) for _ in trees]
    err = [[0.0] * len(names) for _ in trees]
    pbest = {q: [float("inf")] * len(names) for q in peers}
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="conv-layers-peers-"))
    for _ in range(a.rounds):
        for k, exe in enumerate(exes):
            out = subprocess.run([str(exe), *args], capture_output=True, text=True, check=True)
            for i, line in enumerate(out.stdout.split("\n")[:len(names)]):
                t, e = map(float, line.split())
                best[k][i], err[k][i] = min(best[k][i], t), max(err[k][i], e)
        for q in peers:
            for i, t in enumerate(peer_round(q, names, a.seconds, work)):
                pbest[q][i] = min(pbest[q][i], t)
    print(f"load {os.getloadavg()}; trees: " + ", ".join(f"{chr(65 + k)} = {t}"
                                                          for k, t in enumerate(trees)))
    head = " | ".join(f"{chr(65 + k)} us (GMAC/s)" for k in range(len(trees)))
    phead = "".join(f" {q} us |" for q in peers)
    if peers:
        phead += "".join(f" {chr(65 + k)} / best peer |" for k in range(len(trees)))
    print(f"| layer | {head} |" + (" B / A |" if len(trees) > 1 else "") + phead)
    print("|---|" + "---:|" * (len(trees) + (len(trees) > 1) + len(peers)
                             + (len(trees) if peers else 0)))
    for i, n in enumerate(names):
        dwise, _, nb, ic, ih, iw, oc, kh, kw, st, pd, _, _ = SHAPES[n]
        oh, ow = (ih + 2 * pd - kh) // st + 1, (iw + 2 * pd - kw) // st + 1
        macs = nb * oh * ow * oc * (1 if dwise else ic) * kh * kw
        cells = " | ".join(f"{best[k][i] * 1e6:.1f} ({macs / best[k][i] / 1e9:.1f})"
                           for k in range(len(trees)))
        ratio = f" {best[1][i] / best[0][i]:.3f} |" if len(trees) > 1 else ""
        bad = [k for k in range(len(trees)) if err[k][i] > 1e-3]
        pc = "".join(f" {pbest[q][i] * 1e6:.1f} |" for q in peers)
        if peers:
            bp = min(pbest[q][i] for q in peers)
            pc += "".join(f" {best[k][i] / bp:.3f} |" for k in range(len(trees)))
        flag = f" ERROR {[err[k][i] for k in bad]}" if bad else ""
        print(f"| {n} | {cells} |{ratio}{pc}" + flag)


if __name__ == "__main__":
    main()
