"""GEMMs that autotuning gave to kiln's register-blocked kernel (backend "cpp"): one
`extern "C" int gemm_<node>(...)` per GEMM in `gemm.cpp`, instantiating `kr::gemm_cpp` with the
chosen tile, or `kr::gemm_cpp_packed` when B is a weight stored prepacked (L.Gemm.packed_b).
The file is compiled with the kernels' flags (-O3), not the wrapper's.

A GEMM with a fused epilogue (L.Gemm.epilogue, kiln/gemm/fuse_cpu.py) also gets
`epi_rows_<node>` (the epilogue over a block of rows and columns of the result, in place) and
`extern "C" epi_<node>` (over the whole result, for a BLAS choice and the Python wrapper); a
"cpp" choice passes `epi_rows_<node>` to the GEMM, which applies it to each part of the result
as soon as that part is final. Both take the epilogue's inputs and size symbols after the
GEMM's own parameters (`epilogue_args`)."""

from __future__ import annotations

import sympy

from kiln.ir import loop as L
from kiln.ir.sym import contiguous_strides, free_size_symbols, ivars, linear_index, to_c
from kiln.options import GemmBackend
from kiln.targets.cpu.kernel import ExprPrinter

PARAMS = ("int64_t nb0, int64_t nb1, int64_t M, int64_t N, int64_t K, const {T}* A, "
          "int64_t as0, int64_t as1, int64_t ar, int64_t ac, const {T}* B, int64_t bs0, "
          "int64_t bs1, int64_t br, int64_t bc, {T}* C")


def function_name(gemm: str) -> str:
    return f"gemm_{gemm}"


#: a GEMM with a prepacked constant B (L.Gemm.packed_b): B's panels, shared by the batch
PACKED_PARAMS = ("int64_t nb0, int64_t nb1, int64_t M, int64_t N, int64_t K, const {T}* A, "
                 "int64_t as0, int64_t as1, int64_t ar, int64_t ac, const {T}* Bp, {T}* C")


def epilogue_args(g: L.Gemm) -> list[tuple[str, str, str]]:
    """(kind "in" or "size", name, C type) of what a fused epilogue reads besides the GEMM's
    result: its input buffers, then the size symbols of its shape and indices."""
    e = g.epilogue
    if e is None:
        return []
    out, syms = {}, set()
    for ld in L.loads(e.body):
        if ld.buf != g.name and ld.buf not in out:
            out[ld.buf] = ld.dtype.c_type
        syms |= free_size_symbols(sympy.sympify(ld.index))
    for d in e.shape:
        syms |= free_size_symbols(sympy.sympify(d))
    return [("in", b, t) for b, t in out.items()] + \
        [("size", s.name, "int64_t") for s in sorted(syms, key=lambda s: s.name)]


def _epi_sig(g: L.Gemm) -> list[str]:
    return [f"const {t}* __restrict__ buf_{n}" if k == "in" else f"int64_t {n}"
            for k, n, t in epilogue_args(g)]


def _epi_names(g: L.Gemm) -> list[str]:
    return [f"buf_{n}" if k == "in" else n for k, n, _ in epilogue_args(g)]


def params(g: L.Gemm) -> str:
    base = (PACKED_PARAMS if g.packed_b else PARAMS).format(T=g.dtype.c_type)
    return ", ".join([base, *_epi_sig(g)])


def declaration(g: L.Gemm) -> str:
    return f'extern "C" int {function_name(g.name)}({params(g)});'


def epilogue_declaration(g: L.Gemm) -> str:
    args = [f"{g.dtype.c_type}*", *(t if k == "size" else f"const {t}*"
                                    for k, _, t in epilogue_args(g))]
    return f'extern "C" void {epilogue_function(g.name)}({", ".join(args)});'


def epilogue_function(gemm: str) -> str:
    return f"epi_{gemm}"


def _rows_loop(g: L.Gemm) -> list[str]:
    """The body of `epi_rows_<node>`: the epilogue over rows [r0, r1) x columns [c0, c1) of
    the result seen as [rows, N], each row's index variables unravelled once, the columns in
    a simd loop."""
    e = g.epilogue
    n = len(e.shape)
    iv = ivars(n)
    lines = ["for (int64_t r = r0; r < r1; ++r) {"]
    if n > 1:
        lines.append("  int64_t q = r;")
        for d in reversed(range(n - 1)):
            if d == 0:
                lines.append(f"  const int64_t {iv[0]} = q;")
            else:
                lines.append(f"  const int64_t {iv[d]} = q % ({to_c(e.shape[d])}); "
                             f"q /= ({to_c(e.shape[d])});")
    p = ExprPrinter({})
    v = p.value(e.body)
    dest = to_c(linear_index(iv, contiguous_strides(e.shape)))
    lines += ["  #pragma omp simd",
              f"  for (int64_t {iv[-1]} = c0; {iv[-1]} < c1; ++{iv[-1]}) {{",
              *("    " + s for s in p.lines),
              f"    buf_{g.name}[{dest}] = {v};",
              "  }", "}"]
    return lines


def print_epilogue(g: L.Gemm) -> list[str]:
    """`epi_rows_<node>` and `epi_<node>` of a GEMM with a fused epilogue."""
    e = g.epilogue
    T = g.dtype.c_type
    sig = ", ".join([f"{T}* __restrict__ buf_{g.name}", *_epi_sig(g)])
    rows = to_c(sympy.Mul(*e.shape[:-1]))
    cols = to_c(e.shape[-1])
    names = ", ".join([f"buf_{g.name}", *_epi_names(g)])
    return [f"// epilogue of gemm {g.name}, fused into it: {e.name} <- {', '.join(e.source)}",
            f"static inline void epi_rows_{g.name}(int64_t r0, int64_t r1, int64_t c0, "
            f"int64_t c1, {sig}) {{",
            *("  " + s for s in _rows_loop(g)), "}",
            f"// {e.name} over the whole result (after a BLAS GEMM; the Python wrapper)",
            f'extern "C" KILN_KERNEL void {epilogue_function(g.name)}({sig}) {{',
            f"  const int64_t rows = {rows}, cols = {cols};",
            "  // rows over kiln's thread pool (kiln_pool.h), static bands",
            "  kr::parallel_for(rows, rows * cols >= 16384 ? kr::max_threads() : 1, "
            "[&](int64_t r0, int64_t r1) {",
            f"    epi_rows_{g.name}(r0, r1, 0, cols, {names});",
            "  });",
            "}", ""]


def print_gemm_file(steps, choices: dict) -> str | None:
    """gemm.cpp for the "cpp" choices among `steps`' GEMMs; None when there are none."""
    body = []
    for g in steps:
        if isinstance(g, L.Gemm) and g.epilogue is not None:
            body += print_epilogue(g)
        c = choices.get(g.name) if isinstance(g, L.Gemm) else None
        if c is None or c.backend is not GemmBackend.CPP:
            continue
        cfg = c.config
        T = g.dtype.c_type
        epi = ""
        if g.epilogue is not None:
            names = ", ".join(["C", *_epi_names(g)])
            epi = (f", [=](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {{ "
                   f"epi_rows_{g.name}(r0, r1, c0, c1, {names}); }}")
        fused = [] if g.epilogue is None else [
            f"// epilogue fused: {g.epilogue.name} <- {', '.join(g.epilogue.source)}, applied "
            "to each part of C once final"]
        if g.packed_b:
            body += [f"// gemm {g.name} <- {', '.join(g.source)}: {c.problem}",
                     f"// B ({g.b.buf}) prepacked in panels of {g.packed_b} columns; rows in "
                     f"tiles of {cfg.mr}, KC={cfg.kc} ({c.how})", *fused,
                     f'extern "C" int {function_name(g.name)}({params(g)}) {{',
                     f"  return kr::gemm_cpp_packed<{T}, {g.packed_b}, {cfg.mr}, {cfg.kc}>"
                     f"(nb0, nb1, M, N, K, A, as0, as1, ar, ac, Bp, C{epi});",
                     "}", ""]
            continue
        body += [f"// gemm {g.name} <- {', '.join(g.source)}: {c.problem}",
                 f"// tile {cfg.mr} x {cfg.nv} vectors, KC={cfg.kc}, NC={cfg.nc} ({c.how})",
                 *fused,
                 f'extern "C" int {function_name(g.name)}({params(g)}) {{',
                 f"  return kr::gemm_cpp<{T}, {cfg.mr}, {cfg.nv}, {cfg.kc}, "
                 f"{cfg.nc}>(nb0, nb1, M, N, K, A, as0, as1, ar, ac, B, bs0, bs1, br, bc, C"
                 f"{epi});",
                 "}", ""]
    if not body:
        return None
    return "\n".join(["// Generated by kiln: GEMMs on kiln's register-blocked kernel "
                      "(kiln_gemm.h).", '#include "kiln_model_rt.h"', "", *body])
