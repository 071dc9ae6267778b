"""oneDNN as a further backend of the CPU direct convolution (Options.cpu_conv_backends).

Each `conv2d_nchwc` step (passes/conv_nchwc.py; not the fused inverted residual blocks) may
run on oneDNN instead of kiln_conv.h: same buffers (kiln's NCHWc layout is oneDNN's nChw16c /
nChw8c), same packed weights in the package (reordered once into oneDNN's preferred layout
when the model instance is created: include/kiln_dnnl.h), same epilogue as oneDNN post-ops.
The choice is the step's attribute ("backend", "onednn"); the wrapper then keeps one
`kl::dnnl::Conv` per such step in its Instance (`instance_fields`, `create_lines`) and calls
it in place of kl::conv2d_nchwc (`call_lines`).

Which steps (`choose`):
  ("direct",)            never oneDNN: packages never need libdnnl.
  ("direct", "onednn")   the default: with Options.max_autotune and libdnnl installed
                         (kiln/toolchain/onednn.py), every convolution shape is timed both ways
                         by a driver compiled with the package's flags, in its layout, with its
                         epilogue and at its thread count, interleaved (the driver also checks
                         the two agree); oneDNN is kept where it is faster by MARGIN (cached
                         on disk per shape and CPU). Without max_autotune, kiln's own always.
  ("onednn",)            every direct convolution on oneDNN (an error without libdnnl).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kiln import config
from kiln.errors import CompileError, UnsupportedError
from kiln.ir import loop as L
from kiln.ir import program as P
from kiln.ir.sym import to_c
from kiln.options import Options
from kiln.targets.cpu.conv import ONEDNN, ROUTINE
from kiln.toolchain.cxx import build_executable
from kiln.toolchain.onednn import find_library

SCHEMA = "kiln.conv_dnnl/1"
#: oneDNN is kept only where it measured this much faster than kiln's own (a tie keeps the
#: package free of libdnnl; single timings on a shared box vary by several percent)
MARGIN = 0.95
#: seconds of timing per shape (both candidates; calls alternate, each one's fastest kept,
#: at least 20 calls each)
SECONDS = 0.2
#: the manifest's requires.shared_libraries entry (naming libgomp: libkiln then bounds
#: OpenMP's spinning before the package's library is opened, runtime/src/cpu.cpp)
LIBRARY = "libdnnl.so.3 (onednn-cpu-gomp; OpenMP runtime libgomp)"


@dataclass(frozen=True)
class Geometry:
    """One convolution as kiln_dnnl.h's Conv::init takes it (channels padded to the block;
    a plain NCHW stem input keeps its real channel count)."""
    n: int
    icp: int
    ih: int
    iw: int
    ocp: int
    oh: int
    ow: int
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    dh: int
    dw: int
    depthwise: bool
    plain: bool
    block: int
    act: int
    lo: float
    hi: float
    residual: bool
    threads: int

    def args(self) -> list[str]:
        return [str(int(v)) if isinstance(v, bool) else str(v) for v in self.__dict__.values()]

    def describe(self) -> str:
        kind = "depthwise" if self.depthwise else "dense"
        return (f"{kind} {self.kh}x{self.kw} s{self.sh} p{self.ph} d{self.dh} "
                f"{self.icp}->{self.ocp} {self.ih}x{self.iw} n{self.n}"
                + (" +res" if self.residual else "") + f" act{self.act}")


def geometry(x: L.Extern) -> Geometry:
    """The Geometry of a conv2d_nchwc step (its operands' shapes and its attributes)."""
    a = dict(x.attrs)
    xs = [int(d) for d in x.args[0].shape]
    ws = [int(d) for d in x.args[1].shape]
    block = ws[-1]
    plain = len(xs) == 4
    icp = xs[1] if plain else xs[1] * xs[4]
    ocp = ws[0] * block
    kh, kw = (ws[1], ws[2]) if a["depthwise"] else (ws[2], ws[3])
    return Geometry(xs[0], icp, xs[2], xs[3], ocp, int(a["oh"]), int(a["ow"]), kh, kw,
                    int(a["sh"]), int(a["sw"]), int(a["ph"]), int(a["pw"]), int(a["dh"]),
                    int(a["dw"]), bool(a["depthwise"]), plain, block, int(a["act"]),
                    float(a["lo"]), float(a["hi"]), len(x.args) > 3, int(a["threads"]))


def dnnl_steps(lines) -> list[L.Extern]:
    """The convolution steps of a Program's lines (or Loop IR steps) given to oneDNN."""
    if any(isinstance(x, L.CONTROL) for x in lines):
        lines = L.flat_steps(lines)
    calls = [x.call if isinstance(x, P.CallLib) else x for x in P.walk(lines)]
    return [x for x in calls if isinstance(x, L.Extern) and x.routine == ROUTINE
            and x.attr("backend") == ONEDNN]


# -- the choice --------------------------------------------------------------------------------


def _mark(x: L.Extern) -> L.Extern:
    return L.Extern(x.routine, x.outs, x.args, (*x.attrs, ("backend", ONEDNN)), x.source)


def choose(steps, opts: Options, tc, dev_id: str, progress=None) -> tuple[list, dict]:
    """(steps with the convolutions given to oneDNN marked, step name -> what was measured).
    `tc()`: the C++ toolchain (the driver is built with it). See the module docstring for
    when oneDNN is a candidate."""
    backends = tuple(opts.cpu_conv_backends)
    if ONEDNN not in backends:
        return steps, {}
    forced = "direct" not in backends
    found = find_library()
    if found is None:
        if forced:
            raise UnsupportedError(
                "Options.cpu_conv_backends=('onednn',) needs oneDNN's libdnnl.so.3, which no "
                "installed wheel provides: pip install onednn-cpu-gomp (PyPI's `onednn` is a "
                "SYCL / TBB build whose threads kiln cannot hold to its budget)")
        return steps, {}
    if not forced and not opts.max_autotune:
        return steps, {}
    convs = [s for s in steps if isinstance(s, L.Extern) and s.routine == ROUTINE]
    notes: dict[str, dict] = {}
    if not convs:
        return steps, {}
    exe = None if forced else build_driver(tc(), str(found[0]), geometry(convs[0]).block)
    out = []
    for s in steps:
        if not (isinstance(s, L.Extern) and s.routine == ROUTINE):
            out.append(s)
            continue
        if forced:
            out.append(_mark(s))
            notes[s.name] = {"backend": ONEDNN, "how": "forced (cpu_conv_backends)"}
            continue
        if progress is not None:
            progress("convolutions timed (kiln vs oneDNN)", len(notes), len(convs))
        g = geometry(s)
        m = measure(exe, g, opts, dev_id)
        notes[s.name] = {"shape": g.describe(), **m}
        out.append(_mark(s) if m.get("backend") == ONEDNN else s)
    return out, notes


def _cache_path(opts: Options, key: str) -> Path:
    root = Path(opts.cache_dir) if opts.cache_dir else config.cache_dir()
    return root / "autotune" / f"conv_dnnl_{key}.json"


def read_cached(path: Path, schema: str) -> dict | None:
    """The timing result cached at `path` (marked "how": "cache"), or None."""
    try:
        entry = json.loads(path.read_text())
        if entry.get("schema") == schema:
            return {**entry["result"], "how": "cache"}
    except (OSError, ValueError, KeyError):
        pass
    return None


def store_cached(path: Path, entry: dict) -> None:
    """`entry` (with its schema and "result") written to `path`, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(entry, f, indent=1)
    Path(tmp).replace(path)


def driver_result(stdout: str, marker: str, onednn: str, kiln: str,
                  margin: float) -> dict | None:
    """The winner from a timing driver's line `marker kiln_s onednn_s err tol [impl]`:
    {"kiln_s", "onednn_s", "impl", "backend"} (backend `onednn` where it is faster than
    `margin` x kiln's time, else `kiln`), {"backend": kiln, "why"} where the two results
    differ beyond tol, None without such a line (the driver failed)."""
    for line in stdout.splitlines():
        p = line.split()
        if len(p) >= 5 and p[0] == marker:
            kiln_s, dnnl_s, err, tol = map(float, p[1:5])
            if not err <= tol:
                return {"backend": kiln, "why": f"oneDNN differs: {err:g} > {tol:g}"}
            return {"kiln_s": kiln_s, "onednn_s": dnnl_s, "impl": p[5] if len(p) > 5 else "?",
                    "backend": onednn if dnnl_s < margin * kiln_s else kiln}
    return None


def measure(exe: Path, g: Geometry, opts: Options, dev_id: str) -> dict:
    """kiln's and oneDNN's seconds per call for `g` (cached per shape, driver and CPU) and
    the winner: {"kiln_s", "onednn_s", "impl", "backend"} or {"backend": "direct", "why"}."""
    key = hashlib.sha256("\0".join([exe.name, dev_id, *g.args()]).encode()).hexdigest()[:24]
    path = _cache_path(opts, key)
    if (cached := read_cached(path, SCHEMA)) is not None:
        return cached
    env = {**os.environ, **({"OMP_NUM_THREADS": str(opts.num_threads)}
                            if opts.num_threads else {})}
    try:
        proc = subprocess.run([str(exe), *g.args(), str(SECONDS)], capture_output=True, text=True,
                              timeout=opts.autotune_timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"backend": "direct", "why": "timing timed out"}
    result = driver_result(proc.stdout, "KILN_CONV_PROFILE", ONEDNN, "direct", MARGIN)
    if result is None:
        return {"backend": "direct",
                "why": f"driver failed: {(proc.stderr or proc.stdout).strip()[-300:]}"}
    store_cached(path, {"schema": SCHEMA, "device": dev_id, "shape": g.describe(),
                        "result": result})
    return {**result, "how": "profiled"}


# -- the timing driver ---------------------------------------------------------------------


def build_driver(tc, lib: str, block: int) -> Path:
    """The driver that times kiln's and oneDNN's convolution of one shape (channel block
    `block`), compiled with the package's flags (cached by content hash)."""
    src = DRIVER.replace("@LIB@", lib).replace("@BLOCK@", str(block))
    return build_executable(tc, src, "conv_dnnl", "the convolution timing driver's compile",
                            libs=("-ldl",))


DRIVER = r'''// Generated by kiln (kiln/targets/cpu/dnnl.py): times kiln_conv.h's and oneDNN's
// convolution of one shape, interleaved, on kiln's pool (OMP_NUM_THREADS or all CPUs).
#define KILN_CONV_IMPL
#define KILN_CONV_B@BLOCK@
#include "kiln_conv.h"
#define KILN_DNNL_PATH "@LIB@"
#include "kiln_dnnl.h"
#include <chrono>
#include <cstdio>
#include <vector>
int main(int argc, char **argv) {
  if (argc != 25) { std::fprintf(stderr, "usage: GEOMETRY(23) MIN_SECONDS\n"); return 2; }
  int64_t v[23];
  for (int i = 0; i < 23; ++i) v[i] = std::atoll(argv[i + 1]);
  const int64_t n = v[0], icp = v[1], ih = v[2], iw = v[3], ocp = v[4], oh = v[5], ow = v[6],
                kh = v[7], kw = v[8], sh = v[9], sw = v[10], ph = v[11], pw = v[12],
                dh = v[13], dw = v[14], B = v[17], act = v[18], threads = v[22];
  const bool dwise = v[15], plain = v[16], residual = v[21];
  const double lo = std::atof(argv[20]), hi = std::atof(argv[21]), min_s = std::atof(argv[24]);
  kr::Pool pool;
  kr::RunScope scope(&pool);
  const int64_t icn = plain ? icp : B;
  std::vector<int64_t> xd = plain ? std::vector<int64_t>{n, icp, ih, iw, icp * ih * iw, ih * iw,
                                                        iw, 1}
                                  : std::vector<int64_t>{n, icp / B, ih, iw, B, icp * ih * iw,
                                                        ih * iw * B, iw * B, B, 1};
  std::vector<int64_t> wd = dwise ? std::vector<int64_t>{ocp / B, kh, kw, B, kh * kw * B, kw * B,
                                                        B, 1}
      : std::vector<int64_t>{ocp / B, icp / icn, kh, kw, icn, B, icp * kh * kw * B,
                             kh * kw * icn * B, kw * icn * B, icn * B, B, 1};
  const int64_t bd[] = {ocp, 1};
  const int64_t od[] = {n, ocp / B, oh, ow, B, ocp * oh * ow, oh * ow * B, ow * B, B, 1};
  std::vector<float> x(n * icp * ih * iw), w(dwise ? ocp * kh * kw : ocp * icp * kh * kw),
      b(ocp), res(n * ocp * oh * ow), o1(res.size()), o2(res.size());
  uint64_t s = 88172645463325252ull;
  auto rnd = [&]() {
    s ^= s << 13; s ^= s >> 7; s ^= s << 17;
    return float((s >> 11) * 0x1p-53 - 0.5);
  };
  for (auto *a : {&x, &w, &b, &res}) for (auto &e : *a) e = rnd();
  char msg[512] = "";
  kr::Err e{msg, sizeof msg};
  auto X = kl::view(x.data(), plain ? 4 : 5, xd.data());
  auto W = kl::view(w.data(), dwise ? 4 : 6, wd.data());
  auto Bv = kl::view(b.data(), 1, bd);
  auto R = kl::view(res.data(), 5, od);
  auto kiln = [&]() {
    return residual ? kl::conv2d_nchwc(e, "kiln", o1.data(), oh, ow, sh, sw, ph, pw, dh, dw, dwise,
                                       act, lo, hi, threads, X, W, Bv, R)
                    : kl::conv2d_nchwc(e, "kiln", o1.data(), oh, ow, sh, sw, ph, pw, dh, dw, dwise,
                                       act, lo, hi, threads, X, W, Bv);
  };
  kl::dnnl::Conv conv;
  if (conv.init(e, "onednn", n, icp, ih, iw, ocp, oh, ow, kh, kw, sh, sw, ph, pw, dh, dw, dwise,
                plain, B, act, lo, hi, residual, threads, w.data(), b.data())) {
    std::fprintf(stderr, "%s\n", msg);
    return 3;
  }
  auto dnnl = [&]() { return conv.run(e, "onednn", o2.data(), x.data(), res.data()); };
  if (kiln() || dnnl()) { std::fprintf(stderr, "%s\n", msg); return 3; }
  double err = 0;
  for (size_t i = 0; i < o1.size(); ++i) {
    const double d = std::fabs(double(o1[i]) - o2[i]);
    err = std::isnan(d) || d > err ? d : err;
  }
  const double k = double(dwise ? kh * kw : icp * kh * kw);
  const double tol = 1e-5 + 4 * k * 1.2e-7;
  // calls timed one by one, kiln's and oneDNN's alternating; the fastest call of each kept
  double best[2];
  kl::dnnl::time_alternating(kiln, dnnl, min_s, best);
  std::printf("KILN_CONV_PROFILE %.9g %.9g %.9g %.9g %s\n", best[0], best[1], err, tol,
              conv.impl[0] ? conv.impl : "?");
  return 0;
}
'''


# -- the wrapper's part ------------------------------------------------------------------------


def _member(x: L.Extern) -> str:
    return f"dnnl_{x.name}"


def instance_fields(lines) -> list[str]:
    """The Instance's members: one oneDNN convolution per step given to oneDNN."""
    return [f"  kl::dnnl::Conv {_member(x)};  // oneDNN convolution of {', '.join(x.source)}"
            for x in dnnl_steps(lines)]


def create_lines(lines, weight_index: dict[str, int]) -> list[str]:
    """create()'s lines: each oneDNN convolution built, its weights reordered once."""
    out = []
    for x in dnnl_steps(lines):
        g = geometry(x)
        w, b = (weight_index.get(x.args[k].buf) for k in (1, 2))
        if w is None or b is None or x.args[1].offset or x.args[2].offset:
            raise CompileError(f"oneDNN convolution {x.name}: its weight and bias are not whole "
                               "package weights")
        where = ", ".join(x.source) or x.name
        geo = ", ".join(_c(v) for v in g.__dict__.values())
        out += [f"  {{  // oneDNN primitive of {where}: weights reordered to its layout once",
                "    kr::Err e{err, errlen};",
                f"    if (self->{_member(x)}.init(e, {json.dumps(where)}, {geo},",
                f"        static_cast<const float*>(self->w[{w}]), "
                f"static_cast<const float*>(self->w[{b}]))) {{ delete self; return nullptr; }}",
                "  }"]
    return out


def _c(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v in (float("inf"), float("-inf")):
        return "-INFINITY" if v < 0 else "INFINITY"
    return repr(v)


def call_lines(x: L.Extern, where: str) -> list[str]:
    """The run's call of a oneDNN convolution (in place of kl::conv2d_nchwc)."""
    ptr = lambda a: f"buf_{a.buf} + {to_c(a.offset)}"  # noqa: E731
    res = ptr(x.args[3]) if len(x.args) > 3 else "nullptr"
    return [f"if (self->{_member(x)}.run(e, {where}, buf_{x.outs[0]}, {ptr(x.args[0])}, {res})) "
            "goto fail;"]


def include_lines() -> list[str]:
    found = find_library()
    path = str(found[0]) if found else ""
    return [f"#define KILN_DNNL_PATH {json.dumps(path)}  // the build machine's, after the soname",
            '#include "kiln_dnnl.h"  // oneDNN convolutions (Options.cpu_conv_backends)']
