"""oneDNN's matmul as a further backend of the CPU GEMMs with a constant B
(Options.cpu_gemm_backends).

A float32 GEMM of static size whose B is a package weight (a Linear layer's) may run on
oneDNN's matmul instead of kiln's choice (the "cpp" GEMM, packed or not, or OpenBLAS): same
buffers, the weight stored once in the package as the model holds it (not packed by kiln:
passes/pack_cpu.py packs only "cpp" packed choices) and reordered once into oneDNN's
preferred layout (format_tag any) when the model instance is created, one primitive per GEMM
per instance (include/kiln_dnnl.h, `kl::dnnl::Matmul`), the GEMM's fused epilogue
(kiln/gemm/fuse_cpu.py) as the primitive's bias and post-ops. The choice is the GEMM's
`Choice` (kiln/gemm/select.py) with backend "onednn" and a `DnnlGemmConfig`; the wrapper keeps
one `kl::dnnl::Matmul` per such GEMM in its Instance (`instance_fields`, `create_lines`) and
calls it in place of the GEMM (`call_lines`).

Which epilogues (`post_ops`): the chain of pointwise ops on the GEMM's value v that oneDNN has
exactly: + a row of N (bias; the first becomes the primitive's bias), + / - / * a whole
[M, N] operand (residual) or a row, relu, gelu in torch's erf and tanh forms, silu
(v * sigmoid(v)), sigmoid, tanh, v * c + d (eltwise linear). Anything else (another
operand layout, an op oneDNN has not, v used twice outside these forms) keeps the GEMM off
oneDNN; so do dynamic sizes, batched GEMMs, other dtypes and a B that is not a whole
constant weight.

Which GEMMs (`choose`), as the convolution's (targets/cpu/dnnl.py):
  ("kiln",)            never oneDNN: packages never need libdnnl.
  ("kiln", "onednn")   the default: with Options.max_autotune and libdnnl installed
                       (kiln/toolchain/onednn.py), each candidate GEMM is timed against kiln's
                       choice (the one gemm_autotune made, with the same epilogue code) by a
                       driver compiled with the package's flags, at its thread count,
                       interleaved (the driver also checks the two agree); oneDNN is kept
                       where it is faster by MARGIN (cached on disk per GEMM and CPU).
                       Without max_autotune, kiln's choice always.
  ("onednn",)          every candidate GEMM on oneDNN (an error without libdnnl).

Threads: a run of budget N gives oneDNN's OpenMP team N threads (omp_set_num_threads, the
caller being thread 0 while kiln's pool is parked), as the convolution does."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import sympy

from kiln import config
from kiln.errors import UnsupportedError
from kiln.gemm.configs import BlasConfig, CppConfig
from kiln.gemm.cpu import packed_nr
from kiln.gemm.select import Choice
from kiln.ir import loop as L
from kiln.ir import program as P
from kiln.ir.sym import contiguous_strides, ivars, linear_index, to_c
from kiln.options import GemmBackend, Options
from kiln.targets.cpu.dnnl import driver_result, read_cached, store_cached
from kiln.targets.cpu.gemm import epilogue_args, print_epilogue
from kiln.toolchain.cxx import build_executable
from kiln.toolchain.onednn import find_library

SCHEMA = "kiln.gemm_dnnl/1"
ONEDNN = GemmBackend.ONEDNN
#: oneDNN is kept only where it measured this much faster than kiln's choice (a tie keeps the
#: package free of libdnnl)
MARGIN = 0.95
#: seconds of timing per GEMM (both candidates; calls alternate, each one's fastest kept, at
#: least 20 calls each)
SECONDS = 0.2
#: the manifest's requires.shared_libraries entry (the convolution's: one library)
LIBRARY = "libdnnl.so.3 (onednn-cpu-gomp; OpenMP runtime libgomp)"

#: post-op codes (kiln_dnnl.h kPo*)
ELTWISE = {"relu": 1, "gelu_erf": 2, "gelu_tanh": 3, "swish": 4, "sigmoid": 5, "tanh": 6,
           "linear": 7}
BINARY = {("add", "row"): 16, ("add", "full"): 17, ("mul", "row"): 18, ("mul", "full"): 19,
          ("sub", "row"): 20, ("sub", "full"): 21}


@dataclass(frozen=True)
class PostOp:
    """One op of the epilogue as oneDNN runs it: `kind` a kPo* code; `alpha`, `beta` its
    eltwise parameters; `input` the buffer of a binary op's second operand."""
    kind: int
    alpha: float = 0.0
    beta: float = 0.0
    input: str = ""

    @property
    def binary(self) -> bool:
        return self.kind >= 16


@dataclass(frozen=True)
class DnnlGemmConfig:
    """A GEMM on oneDNN's matmul: `bias` the buffer given to the primitive as its bias (the
    epilogue's first op, a row add; "" none), `ops` the other epilogue ops as post-ops."""

    bias: str = ""
    ops: tuple[PostOp, ...] = ()
    backend: ClassVar[GemmBackend] = GemmBackend.ONEDNN

    @property
    def name(self) -> str:
        return "onednn_matmul"

    def to_json(self) -> dict:
        return {"bias": self.bias, "post_ops": [[o.kind, o.alpha, o.beta, o.input]
                                                for o in self.ops]}


# -- which GEMMs, which epilogues ------------------------------------------------------------


def _int(x) -> int | None:
    v = sympy.sympify(x)
    return int(v) if v.is_Integer else None


def _const(e, value: float) -> bool:
    return isinstance(e, L.Const) and isinstance(e.value, (int, float)) and \
        abs(float(e.value) - value) <= 1e-7 * max(1.0, abs(value))


def _pairs(e, op: str) -> list[tuple]:
    """(x, y) and (y, x) of a binary op `op` (commutative matching), else []."""
    if isinstance(e, L.Op) and e.op == op and len(e.args) == 2:
        a, b = e.args
        return [(a, b), (b, a)]
    return []


def _gelu_erf(e):
    """X of 0.5 * X * (1 + erf(X * 1/sqrt(2))) (torch's gelu as kiln lowers it), else None."""
    for half, rest in _pairs(e, "mul"):
        for c, x in _pairs(half, "mul"):
            if not _const(c, 0.5):
                continue
            for one, er in _pairs(rest, "add"):
                if _const(one, 1.0) and isinstance(er, L.Op) and er.op == "erf":
                    for x2, s in _pairs(er.args[0], "mul"):
                        if x2 == x and _const(s, 0.7071067811865476):
                            return x
    return None


def _cube(e, x) -> bool:
    for p, q in _pairs(e, "mul"):
        if p == x and any(a == x and b == x for a, b in _pairs(q, "mul")):
            return True
    return False


def _gelu_tanh(e):
    """X of 0.5 * X * (1 + tanh(sqrt(2/pi) * (X + 0.044715 * X^3))), else None."""
    for half, rest in _pairs(e, "mul"):
        for c, x in _pairs(half, "mul"):
            if not _const(c, 0.5):
                continue
            for one, th in _pairs(rest, "add"):
                if not (_const(one, 1.0) and isinstance(th, L.Op) and th.op == "tanh"):
                    continue
                for k, inner in _pairs(th.args[0], "mul"):
                    if not _const(k, 0.7978845608028654):
                        continue
                    for x2, cub in _pairs(inner, "add"):
                        if x2 == x and any(_const(c3, 0.044715) and _cube(x3, x)
                                           for c3, x3 in _pairs(cub, "mul")):
                            return x
    return None


class _Matcher:
    def __init__(self, g: L.Gemm) -> None:
        e = g.epilogue
        iv = ivars(len(e.shape))
        self.name = g.name
        self.full = sympy.expand(linear_index(iv, contiguous_strides(e.shape)))
        self.row = iv[-1]

    def operand(self, e):
        """("row" | "full", buf) of a float32 load, ("const", value), else None."""
        if isinstance(e, L.Const) and isinstance(e.value, (int, float)) and \
                not isinstance(e.value, bool):
            return ("const", float(e.value))
        if isinstance(e, L.Load) and not e.indirect and e.dtype.name == "float32" \
                and e.buf != self.name:
            idx = sympy.expand(sympy.sympify(e.index))
            if idx == self.row:
                return ("row", e.buf)
            if idx == self.full:
                return ("full", e.buf)
        return None

    def chain(self, e) -> list[PostOp] | None:
        """The post-ops computing `e` from the GEMM's value, innermost first, or None."""
        if isinstance(e, L.Load):
            ok = e.buf == self.name and not e.indirect and \
                sympy.expand(sympy.sympify(e.index)) == self.full
            return [] if ok else None
        if not isinstance(e, L.Op):
            return None
        if e.op in ("relu", "tanh", "sigmoid"):
            c = self.chain(e.args[0])
            return None if c is None else [*c, PostOp(ELTWISE[e.op])]
        for kind, pat in (("gelu_erf", _gelu_erf), ("gelu_tanh", _gelu_tanh)):
            x = pat(e)
            if x is not None:
                c = self.chain(x)
                if c is not None:
                    return [*c, PostOp(ELTWISE[kind])]
        for x, s in _pairs(e, "mul"):  # silu
            if isinstance(s, L.Op) and s.op == "sigmoid" and s.args[0] == x:
                c = self.chain(x)
                if c is not None:
                    return [*c, PostOp(ELTWISE["swish"], 1.0)]
        if e.op in ("add", "mul"):
            for x, y in _pairs(e, e.op):
                out = self._with(x, y, e.op)
                if out is not None:
                    return out
            return None
        if e.op == "sub" and len(e.args) == 2:
            out = self._with(e.args[0], e.args[1], "sub")
            if out is not None:
                return out
            c, o = self.chain(e.args[1]), self.operand(e.args[0])  # c - v
            if c is not None and o is not None and o[0] == "const":
                return [*c, PostOp(ELTWISE["linear"], -1.0, o[1])]
        return None

    def _with(self, x, y, op: str) -> list[PostOp] | None:
        c = self.chain(x)
        o = self.operand(y) if c is not None else None
        if o is None:
            return None
        if o[0] == "const":
            a, b = {"add": (1.0, o[1]), "sub": (1.0, -o[1]), "mul": (o[1], 0.0)}[op]
            return [*c, PostOp(ELTWISE["linear"], a, b)]
        return [*c, PostOp(BINARY[(op, o[0])], input=o[1])]


def post_ops(g: L.Gemm) -> DnnlGemmConfig | str:
    """The config running `g`'s epilogue on oneDNN, or why it cannot."""
    if g.epilogue is None:
        return DnnlGemmConfig()
    e = g.epilogue
    if any(_int(d) is None for d in e.shape):
        return "the epilogue has dynamic sizes"
    ops = _Matcher(g).chain(e.body)
    if ops is None:
        return "the epilogue has no exact oneDNN post-op form"
    bias = ""
    if ops and ops[0].kind == BINARY[("add", "row")]:
        bias, ops = ops[0].input, ops[1:]
    if sum(o.binary for o in ops) > 8:
        return "more than 8 binary post-ops"
    return DnnlGemmConfig(bias, tuple(ops))


def candidate(g: L.Gemm, constants: set[str]) -> DnnlGemmConfig | str:
    """The oneDNN config of a GEMM oneDNN can run, or why it cannot."""
    if g.dtype.name != "float32" or g.lowp is not None or g.mixed is not None:
        return "not a float32 GEMM"
    if g.packed_b:
        return "B is already packed"
    if g.batch and any(_int(b) != 1 for b in g.batch):
        return "a batched GEMM"
    if g.b.buf not in constants or g.b.buf == g.a.buf:
        return "B is not a constant weight"
    if not g.blas_operands():
        return "A's rows overlap (a 1-D convolution's im2col view)"
    dims = (g.m, g.n, g.k, g.a.rows, g.a.cols, g.b.rows, g.b.cols, g.b.offset, g.a.offset)
    if any(_int(x) is None for x in dims):
        return "dynamic sizes or strides"
    if _int(g.b.offset):
        return "B is part of a weight"
    if min(_int(g.m), _int(g.n), _int(g.k)) < 1:
        return "an empty GEMM"
    return post_ops(g)


@dataclass(frozen=True)
class Geometry:
    """One GEMM as kiln_dnnl.h's Matmul::init takes it."""
    m: int
    n: int
    k: int
    ar: int
    ac: int
    br: int
    bc: int

    def describe(self) -> str:
        return f"{self.m}x{self.n}x{self.k}"


def geometry(g: L.Gemm) -> Geometry:
    return Geometry(*(_int(x) for x in (g.m, g.n, g.k, g.a.rows, g.a.cols, g.b.rows,
                                         g.b.cols)))


def _mark(c: Choice, cfg: DnnlGemmConfig, how: str, timings: dict | None = None) -> Choice:
    return Choice(ONEDNN, cfg, how=how, problem=c.problem, timings=timings or c.timings,
                  dropped=c.dropped, tune_seconds=c.tune_seconds)


def choose(steps, gemms: dict, constants: set[str], opts: Options, tc, dev_id: str,
           progress=None) -> tuple[dict, dict]:
    """(GEMM choices with those given to oneDNN replaced, GEMM name -> what was measured or
    why not). `tc()`: the C++ toolchain (the driver is built with it). See the module
    docstring for when oneDNN is a candidate."""
    backends = tuple(opts.cpu_gemm_backends)
    if "onednn" not in backends:
        return gemms, {}
    forced = "kiln" not in backends
    if not forced and not opts.max_autotune:
        return gemms, {}
    found = find_library()
    if found is None:
        if forced:
            raise UnsupportedError(
                "Options.cpu_gemm_backends=('onednn',) needs oneDNN's libdnnl.so.3, which no "
                "installed wheel provides: pip install onednn-cpu-gomp (PyPI's `onednn` is a "
                "SYCL / TBB build whose threads kiln cannot hold to its budget)")
        return gemms, {}
    notes: dict[str, dict] = {}
    cands = []
    for g in steps:
        if not isinstance(g, L.Gemm) or g.name not in gemms:
            continue
        cfg = candidate(g, constants)
        if isinstance(cfg, str):
            notes[g.name] = {"backend": "kiln", "why": cfg}
        else:
            cands.append((g, cfg))
    out = dict(gemms)
    for i, (g, cfg) in enumerate(cands):
        if forced:
            out[g.name] = _mark(gemms[g.name], cfg, "forced (cpu_gemm_backends)")
            notes[g.name] = {"backend": "onednn", "how": "forced"}
            continue
        if progress is not None:
            progress("GEMMs timed (kiln vs oneDNN)", i, len(cands))
        m = measure(tc(), str(found[0]), g, cfg, gemms[g.name], opts, dev_id)
        notes[g.name] = {"shape": geometry(g).describe(), **m}
        if m.get("backend") == "onednn":
            # the driver's two figures (with the epilogue), beside gemm_autotune's
            timings = {**gemms[g.name].timings,
                       "onednn": [("onednn_matmul", m["onednn_s"]),
                                  ("kiln_choice_with_epilogue", m["kiln_s"])]}
            out[g.name] = _mark(gemms[g.name], cfg, m.get("how", "profiled"), timings)
    return out, notes


def _cache_path(opts: Options, key: str) -> Path:
    root = Path(opts.cache_dir) if opts.cache_dir else config.cache_dir()
    return root / "autotune" / f"gemm_dnnl_{key}.json"


def measure(tc, lib: str, g: L.Gemm, cfg: DnnlGemmConfig, kiln: Choice, opts: Options,
            dev_id: str) -> dict:
    """kiln's (its choice `kiln`) and oneDNN's seconds per call of `g` with its epilogue
    (cached per driver and CPU) and the winner: {"kiln_s", "onednn_s", "impl", "backend"} or
    {"backend": "kiln", "why"}."""
    try:
        src = driver_source(g, cfg, kiln.config, opts.march, lib)
    except ValueError as e:
        return {"backend": "kiln", "why": str(e)}
    key = hashlib.sha256("\0".join([src, dev_id]).encode()).hexdigest()[:24]
    path = _cache_path(opts, key)
    if (cached := read_cached(path, SCHEMA)) is not None:
        return cached
    exe = build_executable(tc, src, "gemm_dnnl", "the oneDNN GEMM timing driver's compile",
                           libs=("-ldl",))
    result = run_driver(exe, opts)
    if "why" in result and result["why"].startswith("driver"):
        return result
    store_cached(path, {"schema": SCHEMA, "device": dev_id, "shape": geometry(g).describe(),
                        "kiln": kiln.config.to_json() | {"backend": kiln.backend.value},
                        "result": result})
    return {**result, "how": "profiled"}


def driver_env(threads: int | None) -> dict[str, str]:
    """The driver's environment: OMP_NUM_THREADS for kiln's pool (and so oneDNN's team), and
    OpenMP's idle spinning bounded as a package's run bounds it (runtime/preload.py: oneDNN's
    idle threads must not hold the cores kiln's pool needs in the next call)."""
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if not (env.get("OMP_WAIT_POLICY") or env.get("GOMP_SPINCOUNT")):
        env["GOMP_SPINCOUNT"] = "1000"  # runtime/src/cpu.h kSpinCount
    return env


def run_driver(exe: Path, opts: Options, seconds: float = SECONDS) -> dict:
    """Runs a timing driver: {"kiln_s", "onednn_s", "impl", "backend"} or {"backend":
    "kiln", "why"}."""
    env = driver_env(opts.num_threads)
    try:
        proc = subprocess.run([str(exe), str(seconds)], capture_output=True, text=True,
                              timeout=opts.autotune_timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return {"backend": "kiln", "why": "driver timed out"}
    result = driver_result(proc.stdout, "KILN_GEMM_DNNL", "onednn", "kiln", MARGIN)
    if result is None:
        return {"backend": "kiln",
                "why": f"driver failed: {(proc.stderr or proc.stdout).strip()[-300:]}"}
    return result


# -- the timing driver ---------------------------------------------------------------------


def _canonical(g: L.Gemm) -> tuple[L.Gemm, dict[str, str]]:
    """`g` with its result named C, its epilogue's inputs in0, in1, ... and no source ops (so
    that GEMMs of one shape, epilogue and kiln choice share one driver and its timing: the
    transformer layers of a model), and the renaming."""
    names = {g.name: "C"}
    for k, (kind, n, _) in enumerate(a for a in epilogue_args(g) if a[0] == "in"):
        names[n] = f"in{k}"

    def ren(e):
        if isinstance(e, L.Load):
            return replace(e, buf=names.get(e.buf, e.buf))
        if isinstance(e, L.Op):
            return replace(e, args=tuple(ren(a) for a in e.args))
        return e
    epi = None if g.epilogue is None else replace(g.epilogue, name="C", body=ren(g.epilogue.body),
                                                  source=())
    return replace(g, name="C", epilogue=epi, source=()), names


def _f(v: float) -> str:
    if v in (float("inf"), float("-inf")):
        return "-INFINITY" if v < 0 else "INFINITY"
    return f"{float(v)!r}f"


def _op_arrays(cfg: DnnlGemmConfig) -> str:
    """`kinds`, `alpha`, `beta` (C++ arrays of the post-ops; nullptr-safe when empty)."""
    n = len(cfg.ops) or 1
    kinds = ", ".join(str(o.kind) for o in cfg.ops) or "0"
    alpha = ", ".join(_f(o.alpha) for o in cfg.ops) or "0.f"
    beta = ", ".join(_f(o.beta) for o in cfg.ops) or "0.f"
    return (f"static const int kinds[{n}] = {{{kinds}}};\n"
            f"  static const float alpha[{n}] = {{{alpha}}}, beta[{n}] = {{{beta}}};")


def driver_source(g: L.Gemm, cfg: DnnlGemmConfig, kcfg, march: str, lib: str) -> str:
    """The driver timing kiln's choice `kcfg` (with the package's epilogue code) against
    oneDNN's matmul for `g`, compiled with the package's flags."""
    geo = geometry(g)
    cg, names = _canonical(g)
    ins = [names[n] for k, n, _ in epilogue_args(g) if k == "in"]
    epi_code = print_epilogue(cg) if g.epilogue is not None else []
    epi_call = ", ".join(["C", *(f"buf_{n}" for n in ins)])
    lam = (f", [=](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {{ "
           f"epi_rows_C(r0, r1, c0, c1, {epi_call}); }}") if g.epilogue is not None else ""
    nr = 0
    if isinstance(kcfg, CppConfig) and kcfg.packed:
        nr = packed_nr("float32", march)
        call = (f"kr::gemm_cpp_packed<float, {nr}, {kcfg.mr}, {kcfg.kc}>(1, 1, M, N, K, A, 0, "
                f"0, ar, ac, Bp, C{lam});")
    elif isinstance(kcfg, CppConfig):
        call = (f"kr::gemm_cpp<float, {kcfg.mr}, {kcfg.nv}, {kcfg.kc}, {kcfg.nc}>(1, 1, M, N, "
                f"K, A, 0, 0, ar, ac, B, 0, 0, br, bc, C{lam});")
    elif isinstance(kcfg, BlasConfig):
        call = ("kr::gemm<float>(e, \"blas\", 1, 1, M, N, K, A, 0, 0, ar, ac, B, 0, 0, br, bc, "
                "C)" + (f" || (epi_C({epi_call}), 0);" if g.epilogue is not None else ";"))
    else:
        raise ValueError(f"kiln's choice {kcfg!r} has no driver")
    pack = f"kr::pack_b_panels<float, {nr}>(K, N, B, br, bc, Bp);" if nr else ""
    psize = f"(N + {nr} - 1) / {nr} * {nr} * K + 1" if nr else "1"
    bias = f"buf_{names[cfg.bias]}" if cfg.bias else "nullptr"
    dins = ", ".join(f"buf_{names[o.input]}" for o in cfg.ops if o.binary) or "nullptr"
    text = (_DRIVER.replace("@LIB@", lib).replace("@EPILOGUE@", "\n".join(epi_code))
            .replace("@M@", str(geo.m)).replace("@N@", str(geo.n)).replace("@K@", str(geo.k))
            .replace("@AR@", str(geo.ar)).replace("@AC@", str(geo.ac))
            .replace("@BR@", str(geo.br)).replace("@BC@", str(geo.bc))
            .replace("@NIN@", str(max(1, len(ins))))
            .replace("@INS@", "\n".join(f"  const float *buf_{n} = in[{k}].data();"
                                        for k, n in enumerate(ins)))
            .replace("@KILN@", call).replace("@PACK@", pack).replace("@PSIZE@", psize)
            .replace("@OPS@", _op_arrays(cfg)).replace("@NOPS@", str(len(cfg.ops)))
            .replace("@HASBIAS@", "true" if cfg.bias else "false")
            .replace("@BIAS@", bias).replace("@DINS@", dins)
            .replace("@WHAT@", f"{geo.describe()} {kcfg!r}"))
    return text


_DRIVER = r'''// Generated by kiln (kiln/targets/cpu/dnnl_gemm.py): times kiln's GEMM and oneDNN's
// matmul of one GEMM with its epilogue, interleaved, on kiln's pool (OMP_NUM_THREADS or all CPUs).
// @WHAT@
#include "kiln_model_rt.h"
#define KILN_DNNL_PATH "@LIB@"
#include "kiln_dnnl.h"
#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>
@EPILOGUE@
int main(int argc, char **argv) {
  if (argc != 2) { std::fprintf(stderr, "usage: MIN_SECONDS\n"); return 2; }
  const double min_s = std::atof(argv[1]);
  const int64_t M = @M@, N = @N@, K = @K@, ar = @AR@, ac = @AC@, br = @BR@, bc = @BC@;
  kr::blas_single_threaded();
  kr::Pool pool;
  kr::RunScope scope(&pool);
  std::vector<float> a((M - 1) * ar + (K - 1) * ac + 1), b((K - 1) * br + (N - 1) * bc + 1),
      c1(M * N), c2(M * N), bp(@PSIZE@);
  std::vector<std::vector<float>> in(@NIN@, std::vector<float>(M * N));
  uint64_t s = 88172645463325252ull;
  auto rnd = [&]() {
    s ^= s << 13; s ^= s >> 7; s ^= s << 17;
    return float((s >> 11) * 0x1p-53 - 0.5);
  };
  for (auto &x : a) x = rnd();
  for (auto &x : b) x = rnd();
  for (auto &v : in) for (auto &x : v) x = rnd();
  const float *A = a.data(), *B = b.data();
  float *Bp = bp.data();
  (void)Bp;
@INS@
  @PACK@
  char msg[512] = "";
  kr::Err e{msg, sizeof msg};
  auto kiln = [&]() {
    float *C = c1.data();
    return @KILN@
  };
  @OPS@
  kl::dnnl::Matmul mm;
  if (mm.init(e, "onednn", M, N, K, ar, ac, br, bc, @HASBIAS@, @NOPS@, kinds, alpha, beta, B)) {
    std::fprintf(stderr, "%s\n", msg);
    return 3;
  }
  const float *dins[] = {@DINS@};
  auto dnnl = [&]() { return mm.run(e, "onednn", c2.data(), A, @BIAS@, dins); };
  if (kiln() || dnnl()) { std::fprintf(stderr, "%s\n", msg); return 3; }
  double err = 0, mag = 0;
  for (size_t i = 0; i < c1.size(); ++i) {
    const double d = std::fabs(double(c1[i]) - c2[i]);
    err = std::isnan(d) || d > err ? d : err;
    mag = std::max(mag, std::fabs(double(c1[i])));
  }
  const double tol = (1e-5 + 4 * K * 1.2e-7) * std::max(1.0, mag);
  double best[2];
  kl::dnnl::time_alternating(kiln, dnnl, min_s, best);
  std::printf("KILN_GEMM_DNNL %.9g %.9g %.9g %.9g %s\n", best[0], best[1], err, tol,
              mm.impl[0] ? mm.impl : "?");
  return 0;
}
'''


# -- the wrapper's part ------------------------------------------------------------------------


def _member(g: L.Gemm) -> str:
    return f"dnnl_{g.name}"


def dnnl_gemms(lines, gemm_choices: dict) -> list[L.Gemm]:
    """The GEMMs of a Program's lines given to oneDNN."""
    return [x.gemm for x in P.walk(lines) if isinstance(x, P.CallGemm)
            and getattr(gemm_choices.get(x.gemm.name), "backend", None) is ONEDNN]


def uses_dnnl(gemms: dict) -> bool:
    return any(c.backend is ONEDNN for c in gemms.values())


def instance_fields(lines, gemm_choices: dict) -> list[str]:
    """The Instance's members: one oneDNN matmul per GEMM given to oneDNN."""
    return [f"  kl::dnnl::Matmul {_member(g)};  // oneDNN matmul of {', '.join(g.source)}"
            for g in dnnl_gemms(lines, gemm_choices)]


def create_lines(lines, gemm_choices: dict, weight_index: dict[str, int]) -> list[str]:
    """create()'s lines: each oneDNN matmul built, its weight reordered once."""
    out = []
    for g in dnnl_gemms(lines, gemm_choices):
        cfg = gemm_choices[g.name].config
        geo = geometry(g)
        w = weight_index[g.b.buf]
        where = json.dumps(", ".join(g.source) or g.name)
        out += [f"  {{  // oneDNN matmul of gemm {g.name}: its weight reordered to its layout "
                "once",
                "    " + _op_arrays(cfg).replace("\n  ", "\n    "),
                "    kr::Err e{err, errlen};",
                f"    if (self->{_member(g)}.init(e, {where}, {geo.m}, {geo.n}, {geo.k}, "
                f"{geo.ar}, {geo.ac}, {geo.br}, {geo.bc}, {'true' if cfg.bias else 'false'}, "
                f"{len(cfg.ops)}, kinds, alpha, beta,",
                f"        static_cast<const float*>(self->w[{w}]))) {{ delete self; "
                "return nullptr; }",
                "  }"]
    return out


def call_lines(g: L.Gemm, cfg: DnnlGemmConfig, where: str) -> list[str]:
    """The run's call of a oneDNN matmul (in place of the GEMM and its epilogue)."""
    ins = ", ".join(f"buf_{o.input}" for o in cfg.ops if o.binary) or "nullptr"
    bias = f"buf_{cfg.bias}" if cfg.bias else "nullptr"
    return ["{",
            f"  const float* const ins[] = {{{ins}}};",
            f"  if (self->{_member(g)}.run(e, {where}, buf_{g.name}, buf_{g.a.buf} + "
            f"{to_c(g.a.offset)}, {bias}, ins)) goto fail;",
            "}"]


def include_lines() -> list[str]:
    found = find_library()
    path = str(found[0]) if found else ""
    return [f"#define KILN_DNNL_PATH {json.dumps(path)}  // the build machine's, after the soname",
            '#include "kiln_dnnl.h"  // oneDNN matmuls (Options.cpu_gemm_backends)']
