"""The GEMM problem an autotuning choice is made for, and its cache key.

A choice is valid for every size in the problem's range: sizes are recorded as integers when
static and as `[min, max]` of the Dim range otherwise (the candidate is profiled at the example
size). Layouts are BLAS's: "n" when an operand's columns are contiguous, "t" when its rows are.
Alignment is the largest power of two (elements, up to 16) dividing every operand offset and
leading dimension (1 when any of them is symbolic); `alignment_out` the same for the output's
row length N."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import sympy

from kiln.ir import loop as L


@dataclass(frozen=True)
class GemmProblem:
    dtype: str
    batch: tuple  # each an int or (min, max)
    m: object
    n: object
    k: object
    layout_a: str  # "n" | "t"
    layout_b: str
    alignment: int  # of the A and B operands
    epilogue: str = ""  # "" when the epilogue stays in a separate kernel
    alignment_out: int = 16  # of the output (its row length N)
    # mixed dtypes: "<side>:<int dtype>[:scaled]" (the operand holding integers), "" if none
    mixed: str = ""
    #: B is a constant (a weight) shared by the batch: CPU candidates may prepack it
    const_b: bool = False

    def key(self, device: str) -> str:
        fields = asdict(self)
        if not self.mixed:  # keys of plain GEMMs are those recorded before the field existed
            del fields["mixed"]
        if not self.const_b:
            del fields["const_b"]
        text = json.dumps({"problem": fields, "device": device}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def describe(self) -> str:
        b = "x".join(map(_fmt, self.batch))
        return (f"{self.dtype} {b + ' x ' if b else ''}{_fmt(self.m)}x{_fmt(self.n)}x"
                f"{_fmt(self.k)} {self.layout_a}{self.layout_b} align={self.alignment}"
                f"{' out_align=' + str(self.alignment_out) if self.alignment_out < 16 else ''}"
                f"{' +' + self.epilogue if self.epilogue else ''}"
                f"{' mixed=' + self.mixed if self.mixed else ''}"
                f"{' const_b' if self.const_b else ''}")


def _fmt(v) -> str:
    return f"[{v[0]}..{v[1]}]" if isinstance(v, (tuple, list)) else str(v)


def _size(e, ranges: dict) -> object:
    e = sympy.sympify(e)
    if e.is_Integer:
        return int(e)
    lo = e.subs({s: ranges[s.name][0] for s in e.free_symbols if s.name in ranges})
    hi = e.subs({s: ranges[s.name][1] for s in e.free_symbols if s.name in ranges})
    return (int(lo), int(hi)) if lo.is_Integer and hi.is_Integer else (str(e), str(e))


def layout(rows, cols) -> str:
    """BLAS layout of an operand with these strides ("n": columns contiguous)."""
    return "n" if sympy.sympify(cols) == 1 else "t"


def _alignment(values) -> int:
    a = 16
    for v in values:
        v = sympy.sympify(v)
        if not v.is_Integer:
            return 1
        v = int(v)
        while a > 1 and v % a:
            a //= 2
    return a


def problem_of(g: L.Gemm, ranges: dict[str, tuple[int, int]], epilogue: str = "") -> GemmProblem:
    """The problem of Loop IR GEMM `g`; `ranges`: symbol name -> (min, max) of its Dim."""
    la, lb = layout(g.a.rows, g.a.cols), layout(g.b.rows, g.b.cols)
    lda = g.a.rows if la == "n" else g.a.cols
    ldb = g.b.rows if lb == "n" else g.b.cols
    mx = g.mixed
    mixed = "" if mx is None else f"{mx.side}:{mx.qdtype.name}" + (
        f":int4g{mx.group}" if mx.group else "") + (":tc" if mx.tc else "") + (
        ":scaled" if mx.scale is not None else "")
    return GemmProblem(g.dtype.name, tuple(_size(b, ranges) for b in g.batch),
                       _size(g.m, ranges), _size(g.n, ranges), _size(g.k, ranges), la, lb,
                       _alignment([g.a.offset, g.b.offset, lda, ldb]), epilogue,
                       _alignment([g.n]), mixed)
