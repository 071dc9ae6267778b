"""Schedule -> Triton kernels (one `@triton.jit` function per `Kernel`).

Input: a `Kernel` (kiln/schedule), the Loop IR buffers and size hints (the export's example
sizes, used only to pick block sizes). Output: a `TritonKernel`: the function's source, its
parameters (`kernel_params` order, then `kiln_status` when it indexes through data), the Triton
signature, the launch config (XBLOCK, RBLOCK, num_warps) and the number of rows of its grid.

Mapping: the kernel's outer index space is flattened to rows; program p handles rows
[p*XBLOCK, (p+1)*XBLOCK) (grid x, continued in grid y past 2**31-1 programs). Each member runs
in order over its own inner space, flattened and walked in RBLOCK-wide tiles, so a tile is
[XBLOCK, RBLOCK]. A reduction accumulates tiles lane-wise and reduces the lanes at the end
(tl.sum / tl.reduce); one with extra non-reduced inner dims loops over them one by one.
A pointwise kernel of too few rows to fill the GPU (a 1-d tensor is a single row) splits each
row into chunks (`row_split`): its grid's rows are (row, chunk) pairs, so a vector of 2**20
elements runs on about a thousand programs, not on one that walks it all.
Reductions kept in registers (`Kernel.locals`) are [XBLOCK, 1] values `v_<name>`.

The body is printed as statements (kiln/targets/cuda/cse.py), every member on its own;
`cse.value_number` then removes the top-level assignments that repeat an earlier member's (with
single tiles, a softmax's passes load each element once), and `cse.render` prints the rest.

Invariants: every load and store is masked with the row and tile bounds; a member that reads a
buffer written earlier in the same kernel is preceded by a barrier (`tl.debug_barrier`: other
threads of the program wrote it); data-dependent indices are bounds-checked, an out-of-range
one sets `*kiln_status = 1` and reads element 0 instead; names are unique per member (Triton
treats a name re-assigned in a loop as loop-carried). Pointers are assumed 16-byte aligned
(the CUDA wrapper guarantees it)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import sympy

from kiln.schedule.analysis import indexes_through_data, kernel_params, read_after_store
from kiln.targets.float8 import check_fnuz_rule, triton_round
from kiln.targets.cuda.cse import Assign, Code, Line, Ref, Stmt, Store, code, render, value_number
from kiln.errors import UnsupportedError
from kiln.targets.cuda.ops import (COMPLEX_PART, COMPUTE, FLOAT_OPS, FNUZ, INT_LIMITS,
                                   REDUCTIONS, ROUND8, SIG_PTR, TL_DTYPE, literal, op_spelling,
                                   part_literal, tl_compute, to_tl)
from kiln.ir import loop as L
from kiln.ir.sym import FloorDiv, evaluate, ivars, product, rvars, unravel
from kiln.schedule import Kernel
from kiln.ir.sym import contiguous_strides, linear_index
from kiln.targets.cuda.ops import PRELUDE, pow2

BIG_INDEX = 2**62  # argmax/argmin: index of a lane that has seen no element yet
_NATIVE = ("float32", "float64", "int32", "int64")  # same-dtype arithmetic keeps the dtype


@dataclass(frozen=True)
class Config:
    xblock: int
    rblock: int
    num_warps: int
    num_stages: int = 0  # software-pipelining depth of loops with loads; 0: Triton's default
    #: which of a template's kernels ("": its own; a GEMV of tc-ordered int4 weights, "cc":
    #: the CUDA-core loop instead of the tensor-core kernel, gemm/gemv.py `gemv_configs`)
    variant: str = ""


@dataclass(frozen=True)
class TritonKernel:
    name: str
    source: str
    params: tuple[tuple[str, str], ...]  # (kind, name): out / in / size / status
    signature: dict[str, str]
    config: Config
    rows: sympy.Expr  # grid: ceil(rows / XBLOCK) programs
    source_ops: tuple[str, ...] = ()  # graph nodes the kernel computes
    #: a persistent kernel (the GEMM template): its grid is min(tiles, #SMs), computed at run
    #: time; it takes the SM count as parameter kind "sms" (None: a row kernel)
    tiles: sympy.Expr | None = None
    #: the compile-time constants (XBLOCK/RBLOCK for row kernels) and cp.async stages
    constexprs: tuple[tuple[str, int], ...] = ()
    num_stages: int = 0  # 0: Triton's default
    #: launched with programmatic stream serialisation: its source waits for the previous
    #: kernel first (`with_pdl`)
    pdl: bool = False

    @property
    def status(self) -> bool:
        return any(k == "status" for k, _ in self.params)


#: the lines `with_pdl` puts first in a kernel's body
PDL_LINES = ("    _kl_pdl()  # programmatic dependent launch: wait for the kernel before",)
#: a line of a kernel's body where `with_pdl` puts the wait instead (what comes before it
#: reads only buffers no kernel writes: a GEMV's first weight loads, gemv_template.py)
PDL_MARK = "    # (the programmatic dependent launch's wait)"


def with_pdl(k: TritonKernel) -> TritonKernel:
    """`k` for a launch with programmatic stream serialisation (sm_90+, Options.cuda_pdl): its
    body starts by waiting until the previous kernel has finished and its writes are visible
    (the launch itself may come before: as the previous kernel's programs exit); nothing it
    reads or writes is touched before. Every kernel launched this way waits, so each wait
    also covers all earlier kernels. (On a launch without the attribute the wait does
    nothing.)"""
    if k.pdl:
        return k
    lines = k.source.split("\n")
    if PDL_MARK in lines:
        at = lines.index(PDL_MARK)
        return replace(k, source="\n".join([*lines[:at], *PDL_LINES, *lines[at + 1:]]),
                       pdl=True)
    start = next(i for i, ln in enumerate(lines) if ln.startswith("def "))
    end = next(i for i in range(start, len(lines)) if lines[i].rstrip().endswith(":"))
    source = "\n".join([*lines[:end + 1], *PDL_LINES, *lines[end + 1:]])
    return replace(k, source=source, pdl=True)


def _index(e, names: dict[str, str]) -> Code:
    """An index expression (`to_tl`) as Code: the variables `names` gives are `Ref`s."""
    refs = [v for v in dict.fromkeys(names.values()) if v.isidentifier()]
    slot = {v: f"{{{i}}}" for i, v in enumerate(refs)}  # to_tl prints no braces of its own
    return code(to_tl(e, {k: slot.get(v, v) for k, v in names.items()}), *map(Ref, refs))


@dataclass
class _Scope:
    """Prints expressions of one loop body as assignments (`cse.Assign`, `depth` loops deep),
    sharing repeated subtrees; `value` gives the Code that names an expression's value."""

    names: dict[str, str]  # index symbol -> variable name in this scope
    mask: str
    locals: dict[str, str]
    counter: list[int]
    lines: list[Stmt] = field(default_factory=list)
    memo: dict = field(default_factory=dict)
    depth: int = 0  # of the statements, in loops
    #: the variables that are blocks, the others being scalars (None: every variable `names`
    #: gives is a block, as in the GEMM and GEMV templates' epilogues)
    blocks: set[str] | None = None

    def fresh(self, base: str = "t") -> str:
        self.counter[0] += 1
        return f"{base}{self.counter[0]}"

    def value(self, e: L.Expr) -> Code:
        if e in self.memo:
            return self.memo[e]
        if isinstance(e, L.Op) and e.op in ("real", "imag"):  # a part of a complex element
            bits = self.part(e.args[0], 0 if e.op == "real" else 1)
            name = self.fresh()
            if e.args[0].dtype.name == "complex32":  # float16 bits, computed in float32
                text = code("{}.to(tl.float16, bitcast=True).to({})", bits,
                            tl_compute(e.dtype.name))
            else:
                text = code(FLOAT_OPS[e.op], bits, T=tl_compute(e.dtype.name))
            self.lines.append(Assign(name, text, self.depth, None))
            self.memo[e] = (Ref(name),)
            return self.memo[e]
        if e.dtype.is_complex or any(a.dtype.is_complex for a in getattr(e, "args", ())):
            raise UnsupportedError(f"{getattr(e, 'op', type(e).__name__)} on "
                                   f"{e.dtype.name if e.dtype.is_complex else e.args[0].dtype.name}"
                                   " values in a Triton kernel (kernels read and write complex "
                                   "values as their parts: real, imag, complex)")
        T = tl_compute(e.dtype.name)
        if isinstance(e, L.Const):
            return code("tl.full([], {}, {})", literal(e.value, e.dtype), T)
        if isinstance(e, L.Load) and e.buf in self.locals and not e.indirect:
            return (Ref(self.locals[e.buf]),)
        if isinstance(e, L.Index):
            expr = sympy.sympify(e.expr)  # symbols of size-1 dims print as 0: a constant
            expr = expr.subs({s: int(self.names[str(s)]) for s in expr.free_symbols
                              if self.names.get(str(s), "x").lstrip("-").isdigit()})
            if not expr.free_symbols:
                return code("tl.full([], {}, {})", str(int(expr)), T)
            text = code("({}).to({})", _index(e.expr, self.names), T)
        elif isinstance(e, L.Load):
            text = self._load(e)
        elif e.op == "cast":
            x = self.value(e.args[0])
            text = code("({} != 0)", x) if e.dtype.name == "bool" else code("{}.to({})", x, T)
            if e.dtype.name in ROUND8 and e.args[0].dtype != e.dtype:  # round to 8 bits
                text = code("{}({}).to({})", triton_round(e.dtype.name), x, T)
            elif e.dtype.name in FNUZ and e.args[0].dtype != e.dtype:  # round to fnuz bits
                check_fnuz_rule(e.dtype.name)
                dec, enc = FNUZ[e.dtype.name]
                text = code("{}({}({}))", dec, enc, x)
            elif e.dtype.name in COMPUTE and e.args[0].dtype != e.dtype:  # round to 16 bits
                text = code("{}.to({}).to({})", x, TL_DTYPE[e.dtype], T)
        else:
            args = [self.value(a) for a in e.args]
            pick = e.args[1] if e.op == "where" else e.args[0]
            text = code(op_spelling(e.op, pick.dtype), *args, T=T)
            if e.op == "pow" and pick.dtype.is_float and isinstance(e.args[1], L.Const) \
                    and e.args[1].value == 2:  # x * x, as eager's pow: not libdevice's powf
                text = code("({} * {})", args[0], args[0])  # (~25 instructions a value)
            same = all(a.dtype == e.dtype for a in e.args[1 if e.op == "where" else 0:])
            if e.dtype.name != "bool" and not (same and e.dtype.name in _NATIVE):
                text = code("{}.to({})", text, T)
        name = self.fresh()
        self.lines.append(Assign(name, text, self.depth,
                                 e.buf if isinstance(e, L.Load) else None))
        self.memo[e] = (Ref(name),)
        return self.memo[e]

    def part(self, e: L.Expr, part: int) -> Code:
        """Part `part` (0 real, 1 imaginary) of complex value `e`, as its bits: complex
        buffers are pairs of parts (`SIG_PTR`); a complex value is a load, a `where` between
        them, a constant, a cast to its own type, or `complex` of two floats (whose part is
        the float's bits: lowering/complex.py writes complex arithmetic on the parts)."""
        key = (e, part)
        if key in self.memo:
            return self.memo[key]
        T = COMPLEX_PART[e.dtype.name][0]
        if isinstance(e, L.Const):
            return code("tl.full([], {}, {})", part_literal(e.value, e.dtype, part), T)
        if isinstance(e, L.Load) and not e.indirect and e.buf in self.locals:
            raise UnsupportedError(f"a complex value kept in registers ({e.buf})")
        if isinstance(e, L.Load):
            text = self._load(e, part)
        elif isinstance(e, L.Op) and e.op == "where" and e.args[1].dtype == e.args[2].dtype \
                == e.dtype:
            text = code("tl.where({}, {}, {})", self.value(e.args[0]),
                        self.part(e.args[1], part), self.part(e.args[2], part))
        elif isinstance(e, L.Op) and e.op == "cast" and e.args[0].dtype == e.dtype:
            return self.part(e.args[0], part)
        elif isinstance(e, L.Op) and e.op == "complex" and e.dtype.name == "complex32":
            # float16 parts are computed in float32: rounded (exactly: they were) first
            text = code("{}.to(tl.float16).to(tl.int16, bitcast=True)", self.value(e.args[part]))
        elif isinstance(e, L.Op) and e.op == "complex":  # made of two floats: one's bits
            text = code(FLOAT_OPS["complex"], self.value(e.args[part]), T=T)
        else:
            return self.value(e)  # (raises: an operator computing on complex values)
        name = self.fresh()
        self.lines.append(Assign(name, text, self.depth,
                                 e.buf if isinstance(e, L.Load) else None))
        self.memo[key] = (Ref(name),)
        return self.memo[key]

    def _load(self, e: L.Load, part: int | None = None) -> Code:
        names = dict(self.names)
        d, mask = self.depth, Ref(self.mask)
        for ind in e.indirect:
            v = self.value(ind.value)
            var = self.fresh(f"{ind.var.name}_")
            b = _index(ind.bound, self.names)
            self.lines.append(Assign(var, code("{}.to(tl.int64)", v), d))
            x = Ref(var)
            if ind.wrap:
                self.lines.append(Assign(var, code("tl.where({x} < 0, {x} + {b}, {x})",
                                                   x=x, b=b), d))
            bad = self.fresh("bad")
            self.lines.append(Assign(bad, code("{} & (({x} < 0) | ({x} >= {b}))", mask, x=x,
                                               b=b), d))
            self.lines.append(Line(code("tl.store(kiln_status + {bad}.to(tl.int32) * 0, 1, "
                                        "mask={bad})", bad=Ref(bad)), d))
            self.lines.append(Assign(var, code("tl.where({}, 0, {})", Ref(bad), x), d))
            names[ind.var.name] = var
            if self.blocks is not None:
                self.blocks.add(var)  # (a tl.where over the mask)
        index = e.index if part is None else 2 * e.index + part  # a complex value's part
        idx = _index(index, names)
        if not _is_block(index, names, self.blocks):
            idx = code("{} + xidx * 0", idx)  # a block pointer: the mask is a block
        if part is not None:
            return code("tl.load(buf_{} + {}, mask={}, other=0)", e.buf, idx, mask)
        up = f".to({tl_compute(e.dtype.name)})" if e.dtype.name in COMPUTE else ""
        other = "0.0" if e.dtype.name in ROUND8 else "0"  # Triton casts no int to 8-bit floats
        if e.dtype.name in FNUZ:  # bytes, decoded to float32
            return code("{}(tl.load(buf_{} + {}, mask={}, other=0))", FNUZ[e.dtype.name][0],
                        e.buf, idx, mask)
        return code("tl.load(buf_{} + {}, mask={}, other={}){}", e.buf, idx, mask, other, up)


#: a pointwise kernel whose rows give fewer programs than this splits its rows (`row_split`)
SPLIT_BELOW = 264  # 2 per H100 SM
#: the programs a split kernel aims at (8 per H100 SM)
SPLIT_TARGET = 1056
#: the widest tile of a split kernel's heuristic config
SPLIT_RBLOCK = 1024


def row_split(kernel: Kernel, hints: dict[str, int], rblock: int, tail: bool = False) -> int:
    """The elements of a row each program takes (a multiple of `rblock`), or 0 for a kernel
    whose rows are not split: pointwise kernels with fewer rows than SPLIT_BELOW (at the
    example sizes) and rows of at least two tiles, whose members share one inner extent and
    read nothing another member stored (a chunk's program then needs no other program's
    stores). A kernel followed by more work in the same program (`tail`) is not split."""
    if tail or kernel.locals or read_after_store(kernel) or \
            any(m.reduce is not None for m in kernel.members):
        return 0
    k = len(kernel.outer)
    inner = {sympy.expand(product(m.shape[k:])) for m in kernel.members}
    if len(inner) != 1:
        return 0
    n = evaluate(inner.pop(), hints)
    rows = max(1, evaluate(product(kernel.outer), hints))
    if rows >= SPLIT_BELOW or n < 2 * rblock:
        return 0
    chunk = max(rblock, pow2(-(-n // -(-SPLIT_TARGET // rows))))
    return chunk if chunk < n else 0


def _chunks(kernel: Kernel, chunk: int) -> sympy.Expr:
    """The chunks of a split kernel's row: ceil(inner extent / chunk)."""
    n = sympy.sympify(product(kernel.members[0].shape[len(kernel.outer):]))
    if n.is_Integer:
        return sympy.Integer(-(-int(n) // chunk))
    return FloorDiv(n + chunk - 1, chunk)


def choose_config(kernel: Kernel, hints: dict[str, int], max_rblock: int = 4096,
                  num_warps: int = 0) -> Config:
    """Block sizes from the example sizes (the autotuning hook: a tuner would replace this).
    RBLOCK covers the widest member (up to max_rblock: rows up to 4096 wide are one tile, so
    each element of a norm or softmax row is loaded once); XBLOCK fills a tile of about 2048
    elements but keeps at least ~264 programs (2 per H100 SM) when there are enough rows."""
    k = len(kernel.outer)
    widths = [1]
    for m in kernel.members:
        n = m.reduce.sizes if m.reduce is not None else m.shape[k:]
        widths.append(max(1, evaluate(product(n), hints)))
    rblock = min(pow2(max(widths)), max_rblock)
    rows = max(1, evaluate(product(kernel.outer), hints))
    xblock = max(1, min(2048 // rblock, pow2(rows)))
    while xblock > 1 and -(-rows // xblock) < 264:
        xblock //= 2
    if row_split(kernel, hints, min(rblock, SPLIT_RBLOCK)):
        rblock, xblock = min(rblock, SPLIT_RBLOCK), 1
    warps = num_warps or max(1, min(8, pow2(xblock * rblock // 256)))
    return Config(xblock, rblock, warps)


def _small_indices(kernel: Kernel, buffers: dict[str, L.Buffer]) -> bool:
    """int32 index arithmetic is safe: every buffer it touches has a static size < 2**31."""
    names = {m.name for m in kernel.members}
    for m in kernel.members:
        names |= {ld.buf for ld in L.loads(m.body)}
    sizes = [buffers[n].numel * (2 if buffers[n].dtype.is_complex else 1) for n in names]
    sizes.append(product(kernel.outer))
    return all(sympy.sympify(s).is_Integer and int(s) < 2**31 - 2**20 for s in sizes)


def _tile(body: list[Stmt], var, extent, mask, idx_t, depth, rblock, body_fn, chunk: int = 0):
    """A loop over `extent` elements in RBLOCK tiles (no loop when one tile covers it); in a
    split kernel (`chunk` > 0), over the program's chunk of them."""
    static = sympy.sympify(extent).is_Integer
    ext = to_tl(extent)
    cast = ".to(tl.int64)" if idx_t == "tl.int64" else ""
    single = static and int(extent) <= rblock
    if chunk:
        start = f"xsplit * {chunk}"
        if chunk == rblock:
            body.append(Assign(var, code(f"{start} + tl.arange(0, RBLOCK)[None, :]{cast}"),
                               depth))
            inner = depth
        else:
            off = Ref(f"{var}_off")
            body.append(Line(code(f"for {{}} in range(0, {chunk}, RBLOCK):", off), depth))
            inner = depth + 1
            body.append(Assign(var, code(f"{start} + {{}} + tl.arange(0, RBLOCK)[None, :]{cast}",
                                         off), inner))
    elif single:
        body.append(Assign(var, code("tl.arange(0, RBLOCK)[None, :]{}", cast), depth))
        inner = depth
    else:
        off = Ref(f"{var}_off")
        body.append(Line(code("for {} in range(0, {}, RBLOCK):", off, ext), depth))
        inner = depth + 1
        body.append(Assign(var, code("{} + tl.arange(0, RBLOCK)[None, :]{}", off, cast), inner))
    body.append(Assign(mask, code("xmask & ({} < {})", Ref(var), ext), inner))
    body_fn(inner)


class _Member:
    def __init__(self, kp: "_KernelPrinter", j: int, m: L.Compute) -> None:
        self.kp, self.j, self.m = kp, j, m
        self.rblock = kp.config.rblock

    def names(self) -> dict[str, str]:
        return dict(self.kp.outer_names)

    def inner_defs(self, names, depth, flat: str, dims, first: int, prefix: str) -> list[Stmt]:
        """The indices of `dims` unravelled from the flat position `flat`: blocks where `flat`
        is one (a tile), scalars where it is a loop counter; "0" for a constant index."""
        out: list[Stmt] = []
        syms = (ivars if prefix == "i" else rvars)(first + len(dims))[first:]
        for s, e in zip(syms, unravel(sympy.Symbol("FLAT"), dims)):
            if not sympy.sympify(e).free_symbols:  # a dim of size 1: a constant, no variable
                names[s.name] = str(int(e))
                continue
            name = f"{s.name}_m{self.j}"
            names[s.name] = name
            if flat in self.kp.blocks:
                self.kp.blocks.add(name)
            out.append(Assign(name, _index(e, {"FLAT": flat}), depth))
        return out


class _KernelPrinter:
    def __init__(self, kernel: Kernel, buffers, config: Config, idx_t: str,
                 chunk: int = 0) -> None:
        self.kernel, self.buffers, self.config, self.idx_t = kernel, buffers, config, idx_t
        self.chunk = chunk  # a split kernel's elements of a row per program (`row_split`)
        self.k = len(kernel.outer)
        self.locals = {n: f"v_{n}" for n in kernel.locals}
        self.counter = [0]
        self.outer_names = {f"i{d}": f"i{d}" for d in range(self.k)}
        # row indices are [XBLOCK, 1] blocks, except constant ones (dims of size 1)
        self.blocks = set()
        for s, e in zip(ivars(self.k), unravel(sympy.Symbol("xidx"), kernel.outer)):
            if sympy.sympify(e).free_symbols:
                self.blocks.add(s.name)
            else:
                self.outer_names[s.name] = str(int(e))

    def scope(self, names, mask, depth: int) -> _Scope:
        return _Scope(names, mask, self.locals, self.counter, depth=depth, blocks=self.blocks)

    def tile_var(self, j: int) -> str:
        """The name of member j's tile positions (a [1, RBLOCK] block)."""
        self.blocks.add(f"r_m{j}")
        return f"r_m{j}"

    def pointwise(self, j: int, m: L.Compute, body: list[Stmt]) -> None:
        mem = _Member(self, j, m)
        dims = m.shape[self.k:]
        out_idx = _out_index(m)
        if sympy.sympify(product(dims)) == 1:
            names = mem.names()
            for d in range(self.k, len(m.shape)):
                names[f"i{d}"] = "0"
            sc = self.scope(names, "xmask", 0)
            for idx, v in _values(sc, m, out_idx):
                body += sc.lines
                sc.lines = []
                body.append(Store(m.name, _store_offset(idx, names, self.blocks), v,
                                  (Ref("xmask"),)))
            return

        def tile_body(depth):
            names = mem.names()
            body.extend(mem.inner_defs(names, depth, f"r_m{j}", dims, self.k, "i"))
            sc = self.scope(names, f"mask_m{j}", depth)
            for idx, v in _values(sc, m, out_idx):
                body.extend(sc.lines)
                sc.lines = []
                body.append(Store(m.name, _store_offset(idx, names, self.blocks), v,
                                  (Ref(f"mask_m{j}"),), depth))
        _tile(body, self.tile_var(j), product(dims), f"mask_m{j}", self.idx_t, 0,
              self.config.rblock, tile_body, self.chunk)

    def reduction(self, j: int, m: L.Compute, body: list[Stmt]) -> None:
        mem = _Member(self, j, m)
        dims = m.shape[self.k:]
        names = mem.names()
        depth = 0
        if sympy.sympify(product(dims)) == 1:
            for d in range(self.k, len(m.shape)):
                names[f"i{d}"] = "0"
        else:  # extra non-reduced inner dims: one at a time
            n = to_tl(product(dims))
            body.append(Line(code("for {} in range(0, {}):", Ref(f"jj_m{j}"), n)))
            depth += 1
            body.extend(mem.inner_defs(names, depth, f"jj_m{j}", dims, self.k, "i"))
        kind = m.reduce.kind
        acc, acc_i, res = f"acc_{m.name}", f"acc_{m.name}_i", f"res_{m.name}"
        shape = "[XBLOCK, RBLOCK]"
        src = m.body.dtype
        if kind in ("argmax", "argmin"):
            lo, hi = INT_LIMITS.get(src.name, (None, None))
            init = ("float('-inf')" if kind == "argmax" else "float('inf')") if src.is_float \
                else str(lo if kind == "argmax" else hi)
            body.append(Assign(acc, code("tl.full({}, {}, {})", shape, init,
                                         tl_compute(src.name)), depth))
            body.append(Assign(acc_i, code("tl.full({}, {}, tl.int64)", shape, str(BIG_INDEX)),
                               depth))
        else:
            fid, iid, _, _ = REDUCTIONS[kind]
            acc_t = "tl.int8" if kind in ("any", "all") else tl_compute(m.dtype.name)
            lo, hi = INT_LIMITS.get(m.dtype.name, (0, 0))
            ident = fid if m.dtype.is_float else iid.format(lo=lo, hi=hi)
            body.append(Assign(acc, code("tl.full({}, {}, {})", shape, ident, acc_t), depth))

        def tile_body(d2):
            nm = dict(names)
            body.extend(mem.inner_defs(nm, d2, f"r_m{j}", m.reduce.sizes, 0, "r"))
            sc = self.scope(nm, f"mask_m{j}", d2)
            x = sc.value(m.body)
            body.extend(sc.lines)
            mask = Ref(f"mask_m{j}")
            if kind in ("argmax", "argmin"):
                cmp = ">" if kind == "argmax" else "<"
                body.append(Assign("take", code(
                    "{mask} & (({acc_i} == {big}) | ({x} {cmp} {acc}) | "
                    "(({x} != {x}) & ({acc} == {acc})))", mask=mask, acc_i=Ref(acc_i),
                    big=str(BIG_INDEX), x=x, cmp=cmp, acc=Ref(acc)), d2))
                body.append(Assign(acc, code("tl.where(take, {}, {})", x, Ref(acc)), d2))
                body.append(Assign(acc_i, code("tl.where(take, {}.to(tl.int64), {})",
                                               Ref(f"r_m{j}"), Ref(acc_i)), d2))
                return
            fid, iid, comb, _ = REDUCTIONS[kind]
            ident = fid if m.dtype.is_float else iid.format(lo=lo, hi=hi)
            xv = code("{}.to(tl.int8)", x) if kind in ("any", "all") else x
            masked = code("tl.where({}, {}, {})", mask, xv, ident)
            if kind in ("max", "min"):
                fn = "tl.maximum" if kind == "max" else "tl.minimum"
                nan = ", propagate_nan=tl.PropagateNan.ALL" if m.dtype.is_float else ""
                comb = f"{fn}({{acc}}, {{x}}{nan})"
            body.append(Assign(acc, code(comb, acc=Ref(acc), x=masked), d2))
        _tile(body, self.tile_var(j), product(m.reduce.sizes), f"mask_m{j}", self.idx_t, depth,
              self.config.rblock, tile_body)
        if kind in ("argmax", "argmin"):
            fn = "_kl_argmax" if kind == "argmax" else "_kl_argmin"
            body.append(Line(code("_, {} = tl.reduce(({}, {}), 1, {}, keep_dims=True)",
                                  Ref(res), Ref(acc), Ref(acc_i), fn), depth))
            body.append(Assign(res, code("tl.where({r} == {big}, 0, {r})", r=Ref(res),
                                         big=str(BIG_INDEX)), depth))
        else:
            body.append(Assign(res, code(REDUCTIONS[kind][3], acc=Ref(acc)), depth))
        if m.name in self.locals:
            body.append(Assign(self.locals[m.name], (Ref(res),), depth))
        else:
            body.append(Store(m.name, _store_offset(_out_index(m), names, self.blocks),
                              (Ref(res),),
                              (Ref("xmask"),), depth))


def _values(sc: _Scope, m: L.Compute, out_idx: sympy.Expr):
    """(offset, value) of each store of pointwise member `m`: one, or a complex value's two
    parts (its buffer holds pairs of parts)."""
    if not m.dtype.is_complex:
        yield out_idx, _stored(sc.value(m.body), m.dtype)
        return
    for part in (0, 1):
        yield 2 * out_idx + part, sc.part(m.body, part)


def _stored(v: Code, dt) -> Code:
    """The value a store writes: 8-bit floats converted explicitly with eager's rounding (an
    implicit conversion would saturate e5m2's infinities); others convert on store."""
    if dt.name in FNUZ:  # float32 -> the fnuz byte
        check_fnuz_rule(dt.name)
        return code("{}({})", FNUZ[dt.name][1], v)
    return code("{}({})", triton_round(dt.name), v) if dt.name in ROUND8 else v


def _is_block(idx: sympy.Expr, names: dict[str, str], blocks: set[str] | None) -> bool:
    """Whether the printed `idx` is a block: it reads a variable that is one (else it is a
    scalar: constants, size symbols, loop counters and indices computed from them only)."""
    used = [names.get(str(v)) for v in sympy.sympify(idx).free_symbols]
    if blocks is None:
        return any(n is not None and n.isidentifier() for n in used)
    return any(n in blocks for n in used)


def _store_offset(idx: sympy.Expr, names: dict[str, str], blocks: set[str]) -> Code:
    """The store's offset, a block like the mask even when `idx` is a scalar (a pointer that
    is not a block takes no block mask)."""
    return _index(idx, names) if _is_block(idx, names, blocks) \
        else code("{} + xidx * 0", _index(idx, names))


def _out_index(m: L.Compute) -> sympy.Expr:
    return linear_index(ivars(len(m.shape)), contiguous_strides(m.shape))


def kernel_body(kernel: Kernel, buffers: dict[str, L.Buffer], config: Config,
                chunk: int = 0) -> list[Stmt]:
    """The kernel's body as statements, every member printed on its own (before
    `cse.value_number`); `chunk`: a split kernel's (`row_split`)."""
    idx_t = "tl.int32" if _small_indices(kernel, buffers) else "tl.int64"
    kp = _KernelPrinter(kernel, buffers, config, idx_t, chunk)
    body: list[Stmt] = []
    read_later = read_after_store(kernel)
    for j, m in enumerate(kernel.members):
        body.append(Line(code("# {} <- {}", m.name, ", ".join(m.source))))
        (kp.reduction if m.reduce is not None else kp.pointwise)(j, m, body)
        if m.name in read_later:
            body.append(Line(("tl.debug_barrier()  # later members read what this one stored",)))
    return body


def signature(params, buffers: dict[str, L.Buffer]) -> dict[str, str]:
    """Triton's signature of a kiln kernel's parameters ((kind, name) pairs: sizes are i64,
    the status flag *i32, buffers `buf_<name>` pointers of their dtype), then XBLOCK and
    RBLOCK as constexprs."""
    sig: dict[str, str] = {}
    for kind, n in params:
        if kind == "size":
            sig[n] = "i64"
        elif kind == "status":
            sig[n] = "*i32"
        else:
            sig[f"buf_{n}"] = SIG_PTR[buffers[n].dtype]
    sig["XBLOCK"] = sig["RBLOCK"] = "constexpr"
    return sig


def print_triton_kernel(kernel: Kernel, buffers: dict[str, L.Buffer], hints: dict[str, int],
                        config: Config | None = None, *, name: str | None = None,
                        params: list | None = None, tail: tuple[str, ...] = (),
                        source: tuple[str, ...] | None = None) -> TritonKernel:
    """`name`, `params` (a superset of the kernel's, with the status flag where one is
    taken), `tail` (lines run after the members, a barrier before them) and `source`: a
    kernel followed by more work in the same program (targets/cuda/put.py's fused puts)."""
    config = config or choose_config(kernel, hints)
    idx_t = "tl.int32" if _small_indices(kernel, buffers) else "tl.int64"
    chunk = row_split(kernel, hints, config.rblock, bool(tail))
    body = kernel_body(kernel, buffers, config, chunk)
    if params is None:
        params = list(kernel_params(kernel, buffers))
        if indexes_through_data(kernel):
            params.append(("status", "kiln_status"))
    kname, ksource = name or kernel.name, source or kernel.source
    sig = signature(params, buffers)
    rows = product(kernel.outer)
    chunks = _chunks(kernel, chunk) if chunk else sympy.Integer(1)
    head = [
        "@triton.jit",
        f"def {kname}({', '.join(a for a in sig if a not in ('XBLOCK', 'RBLOCK'))}"
        f"{', ' if len(sig) > 2 else ''}XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):",
        f"    # {kname}: {', '.join(m.name for m in kernel.members)}",
        f"    #   from graph nodes: {', '.join(ksource)}",
    ]
    if idx_t == "tl.int64":
        head.append("    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + "
                    "tl.program_id(0)")
    else:
        head.append("    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)")
    head.append("    xidx = pid * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
    head.append(f"    xmask = xidx < {to_tl(rows * chunks)}")
    if chunk:  # grid rows are (row, chunk) pairs
        head.append(f"    xsplit = xidx % {to_tl(chunks)}  # this program's chunk of "
                    f"{chunk} elements of its row")
        head.append(f"    xidx = xidx // {to_tl(chunks)}")
    for s, e in zip(ivars(len(kernel.outer)), unravel(sympy.Symbol("xidx"), kernel.outer)):
        head.append(f"    {s.name} = {to_tl(e)}")
    tail = ["    tl.debug_barrier()  # what follows reads what the members stored",
            *tail] if tail else []
    src = "\n".join(head + render(value_number(body)) + tail) + "\n"
    return TritonKernel(kname, src, tuple(params), sig, config, rows * chunks, ksource)


def print_triton_module(kernels: list[TritonKernel]) -> str:
    return PRELUDE + "".join("\n\n" + k.source for k in kernels)
