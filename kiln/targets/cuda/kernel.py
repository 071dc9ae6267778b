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
Reductions kept in registers (`Kernel.locals`) are [XBLOCK, 1] values `v_<name>`.

Invariants: every load and store is masked with the row and tile bounds; a member that reads a
buffer written earlier in the same kernel is preceded by a barrier (`tl.debug_barrier`: other
threads of the program wrote it); data-dependent indices are bounds-checked, an out-of-range
one sets `*kiln_status = 1` and reads element 0 instead; names are unique per member (Triton
treats a name re-assigned in a loop as loop-carried). Pointers are assumed 16-byte aligned
(the CUDA wrapper guarantees it)."""

from __future__ import annotations

import re

from dataclasses import dataclass, field

import sympy

from kiln.schedule.analysis import kernel_params
from kiln.targets.float8 import triton_round
from kiln.targets.cuda.ops import (COMPUTE, INT_LIMITS, REDUCTIONS, ROUND8, SIG_PTR, TL_DTYPE,
                                     literal, op_spelling, tl_compute, to_tl)
from kiln.ir import loop as L
from kiln.ir.sym import evaluate, ivars, product, rvars, unravel
from kiln.schedule import Kernel
from kiln.ir.sym import contiguous_strides, linear_index
from kiln.targets.cuda.ops import PRELUDE

BIG_INDEX = 2**62  # argmax/argmin: index of a lane that has seen no element yet
_NATIVE = ("float32", "float64", "int32", "int64")  # same-dtype arithmetic keeps the dtype


@dataclass(frozen=True)
class Config:
    xblock: int
    rblock: int
    num_warps: int
    num_stages: int = 0  # software-pipelining depth of loops with loads; 0: Triton's default


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

    @property
    def status(self) -> bool:
        return any(k == "status" for k, _ in self.params)


@dataclass
class _Scope:
    """Prints expressions of one loop body as assignments, sharing repeated subtrees."""

    names: dict[str, str]  # index symbol -> variable name in this scope
    mask: str
    locals: dict[str, str]
    counter: list[int]
    lines: list[str] = field(default_factory=list)
    memo: dict = field(default_factory=dict)
    status: list[bool] = field(default_factory=lambda: [False])

    def fresh(self, base: str = "t") -> str:
        self.counter[0] += 1
        return f"{base}{self.counter[0]}"

    def value(self, e: L.Expr) -> str:
        if e in self.memo:
            return self.memo[e]
        T = tl_compute(e.dtype.name)
        if isinstance(e, L.Const):
            return f"tl.full([], {literal(e.value, e.dtype)}, {T})"
        if isinstance(e, L.Load) and e.buf in self.locals and not e.indirect:
            return self.locals[e.buf]
        if isinstance(e, L.Index):
            if not sympy.sympify(e.expr).free_symbols:
                return f"tl.full([], {int(e.expr)}, {T})"
            text = f"({to_tl(e.expr, self.names)}).to({T})"
        elif isinstance(e, L.Load):
            text = self._load(e)
        elif e.op == "cast":
            x = self.value(e.args[0])
            text = f"({x} != 0)" if e.dtype.name == "bool" else f"{x}.to({T})"
            if e.dtype.name in ROUND8 and e.args[0].dtype != e.dtype:  # round to 8 bits
                text = f"{triton_round(e.dtype.name)}({x}).to({T})"
            elif e.dtype.name in COMPUTE and e.args[0].dtype != e.dtype:  # round to 16 bits
                text = f"{x}.to({TL_DTYPE[e.dtype]}).to({T})"
        else:
            args = [self.value(a) for a in e.args]
            pick = e.args[1] if e.op == "where" else e.args[0]
            text = op_spelling(e.op, pick.dtype).format(*args, T=T)
            same = all(a.dtype == e.dtype for a in e.args[1 if e.op == "where" else 0:])
            if e.dtype.name != "bool" and not (same and e.dtype.name in _NATIVE):
                text = f"{text}.to({T})"
        name = self.fresh()
        self.lines.append(f"{name} = {text}")
        self.memo[e] = name
        return name

    def _load(self, e: L.Load) -> str:
        names = dict(self.names)
        for ind in e.indirect:
            v = self.value(ind.value)
            var = self.fresh(f"{ind.var.name}_")
            b = to_tl(ind.bound, self.names)
            self.lines.append(f"{var} = {v}.to(tl.int64)")
            if ind.wrap:
                self.lines.append(f"{var} = tl.where({var} < 0, {var} + {b}, {var})")
            bad = self.fresh("bad")
            self.lines.append(f"{bad} = {self.mask} & (({var} < 0) | ({var} >= {b}))")
            self.lines.append(f"tl.store(kiln_status + {bad}.to(tl.int32) * 0, 1, mask={bad})")
            self.lines.append(f"{var} = tl.where({bad}, 0, {var})")
            names[ind.var.name] = var
            self.status[0] = True
        idx = to_tl(e.index, names)
        if not any(names.get(str(v), "0") != "0" for v in sympy.sympify(e.index).free_symbols):
            idx += " + xidx * 0"  # a block pointer: the mask is a block
        up = f".to({tl_compute(e.dtype.name)})" if e.dtype.name in COMPUTE else ""
        other = "0.0" if e.dtype.name in ROUND8 else "0"  # Triton casts no int to 8-bit floats
        return f"tl.load(buf_{e.buf} + {idx}, mask={self.mask}, other={other}){up}"


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


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
    rblock = min(_pow2(max(widths)), max_rblock)
    rows = max(1, evaluate(product(kernel.outer), hints))
    xblock = max(1, min(2048 // rblock, _pow2(rows)))
    while xblock > 1 and -(-rows // xblock) < 264:
        xblock //= 2
    warps = num_warps or max(1, min(8, _pow2(xblock * rblock // 256)))
    return Config(xblock, rblock, warps)


def _small_indices(kernel: Kernel, buffers: dict[str, L.Buffer]) -> bool:
    """int32 index arithmetic is safe: every buffer it touches has a static size < 2**31."""
    names = {m.name for m in kernel.members}
    for m in kernel.members:
        names |= {ld.buf for ld in L.loads(m.body)}
    sizes = [buffers[n].numel for n in names] + [product(kernel.outer)]
    return all(sympy.sympify(s).is_Integer and int(s) < 2**31 - 2**20 for s in sizes)


def _tile(lines, var, extent, mask, idx_t, pad, rblock, body_fn):
    """A loop over `extent` elements in RBLOCK tiles (no loop when one tile covers it)."""
    static = sympy.sympify(extent).is_Integer
    ext = to_tl(extent)
    cast = ".to(tl.int64)" if idx_t == "tl.int64" else ""
    single = static and int(extent) <= rblock
    if single:
        lines.append(f"{pad}{var} = tl.arange(0, RBLOCK)[None, :]{cast}")
        inner = pad
    else:
        lines.append(f"{pad}for {var}_off in range(0, {ext}, RBLOCK):")
        inner = pad + "    "
        lines.append(f"{inner}{var} = {var}_off + tl.arange(0, RBLOCK)[None, :]{cast}")
    lines.append(f"{inner}{mask} = xmask & ({var} < {ext})")
    body_fn(inner)


class _Member:
    def __init__(self, kp: "_KernelPrinter", j: int, m: L.Compute) -> None:
        self.kp, self.j, self.m = kp, j, m
        self.rblock = kp.config.rblock

    def names(self) -> dict[str, str]:
        return dict(self.kp.outer_names)

    def inner_defs(self, names, pad, flat: str, dims, first: int, prefix: str) -> list[str]:
        out = []
        syms = (ivars if prefix == "i" else rvars)(first + len(dims))[first:]
        for s, e in zip(syms, unravel(sympy.Symbol("FLAT"), dims)):
            name = f"{s.name}_m{self.j}"
            names[s.name] = name
            out.append(f"{pad}{name} = {to_tl(e, {'FLAT': flat})}")
        return out


class _KernelPrinter:
    def __init__(self, kernel: Kernel, buffers, config: Config, idx_t: str) -> None:
        self.kernel, self.buffers, self.config, self.idx_t = kernel, buffers, config, idx_t
        self.k = len(kernel.outer)
        self.locals = {n: f"v_{n}" for n in kernel.locals}
        self.counter = [0]
        self.status = [False]
        self.outer_names = {f"i{d}": f"i{d}" for d in range(self.k)}

    def scope(self, names, mask) -> _Scope:
        return _Scope(names, mask, self.locals, self.counter, status=self.status)

    def pointwise(self, j: int, m: L.Compute, lines: list[str]) -> None:
        mem = _Member(self, j, m)
        dims = m.shape[self.k:]
        out_idx = _out_index(m)
        if sympy.sympify(product(dims)) == 1:
            names = mem.names()
            for d in range(self.k, len(m.shape)):
                names[f"i{d}"] = "0"
            sc = self.scope(names, "xmask")
            v = _stored(sc.value(m.body), m.dtype)
            lines += ["    " + s for s in sc.lines]
            lines.append(f"    tl.store({_store_ptr(m.name, out_idx, names, self.k)}, {v}, "
                         "mask=xmask)")
            return

        def body(pad):
            names = mem.names()
            lines.extend(mem.inner_defs(names, pad, f"r_m{j}", dims, self.k, "i"))
            sc = self.scope(names, f"mask_m{j}")
            v = _stored(sc.value(m.body), m.dtype)
            lines.extend(pad + s for s in sc.lines)
            lines.append(f"{pad}tl.store({_store_ptr(m.name, out_idx, names, self.k)}, {v}, "
                         f"mask=mask_m{j})")
        _tile(lines, f"r_m{j}", product(dims), f"mask_m{j}", self.idx_t, "    ",
              self.config.rblock, body)

    def reduction(self, j: int, m: L.Compute, lines: list[str]) -> None:
        mem = _Member(self, j, m)
        dims = m.shape[self.k:]
        names = mem.names()
        pad = "    "
        if sympy.sympify(product(dims)) == 1:
            for d in range(self.k, len(m.shape)):
                names[f"i{d}"] = "0"
        else:  # extra non-reduced inner dims: one at a time
            n = to_tl(product(dims))
            lines.append(f"{pad}for jj_m{j} in range(0, {n}):")
            pad += "    "
            lines.extend(mem.inner_defs(names, pad, f"jj_m{j}", dims, self.k, "i"))
        kind = m.reduce.kind
        acc, res = f"acc_{m.name}", f"res_{m.name}"
        shape = "[XBLOCK, RBLOCK]"
        src = m.body.dtype
        if kind in ("argmax", "argmin"):
            lo, hi = INT_LIMITS.get(src.name, (None, None))
            init = ("float('-inf')" if kind == "argmax" else "float('inf')") if src.is_float \
                else str(lo if kind == "argmax" else hi)
            lines.append(f"{pad}{acc} = tl.full({shape}, {init}, {tl_compute(src.name)})")
            lines.append(f"{pad}{acc}_i = tl.full({shape}, {BIG_INDEX}, tl.int64)")
        else:
            fid, iid, _, _ = REDUCTIONS[kind]
            acc_t = "tl.int8" if kind in ("any", "all") else tl_compute(m.dtype.name)
            lo, hi = INT_LIMITS.get(m.dtype.name, (0, 0))
            ident = fid if m.dtype.is_float else iid.format(lo=lo, hi=hi)
            lines.append(f"{pad}{acc} = tl.full({shape}, {ident}, {acc_t})")

        def body(p2):
            nm = dict(names)
            lines.extend(mem.inner_defs(nm, p2, f"r_m{j}", m.reduce.sizes, 0, "r"))
            sc = self.scope(nm, f"mask_m{j}")
            x = sc.value(m.body)
            lines.extend(p2 + s for s in sc.lines)
            if kind in ("argmax", "argmin"):
                cmp = ">" if kind == "argmax" else "<"
                lines.append(f"{p2}take = mask_m{j} & (({acc}_i == {BIG_INDEX}) | ({x} {cmp} "
                             f"{acc}) | (({x} != {x}) & ({acc} == {acc})))")
                lines.append(f"{p2}{acc} = tl.where(take, {x}, {acc})")
                lines.append(f"{p2}{acc}_i = tl.where(take, r_m{j}.to(tl.int64), {acc}_i)")
                return
            fid, iid, comb, _ = REDUCTIONS[kind]
            ident = fid if m.dtype.is_float else iid.format(lo=lo, hi=hi)
            xv = f"{x}.to(tl.int8)" if kind in ("any", "all") else x
            masked = f"tl.where(mask_m{j}, {xv}, {ident})"
            if kind in ("max", "min"):
                fn = "tl.maximum" if kind == "max" else "tl.minimum"
                nan = ", propagate_nan=tl.PropagateNan.ALL" if m.dtype.is_float else ""
                comb = f"{fn}({{acc}}, {{x}}{nan})"
            lines.append(f"{p2}{acc} = {comb.format(acc=acc, x=masked)}")
        _tile(lines, f"r_m{j}", product(m.reduce.sizes), f"mask_m{j}", self.idx_t, pad,
              self.config.rblock, body)
        if kind in ("argmax", "argmin"):
            fn = "_kl_argmax" if kind == "argmax" else "_kl_argmin"
            lines.append(f"{pad}_, {res} = tl.reduce(({acc}, {acc}_i), 1, {fn}, "
                         "keep_dims=True)")
            lines.append(f"{pad}{res} = tl.where({res} == {BIG_INDEX}, 0, {res})")
        else:
            lines.append(f"{pad}{res} = {REDUCTIONS[kind][3].format(acc=acc)}")
        if m.name in self.locals:
            lines.append(f"{pad}{self.locals[m.name]} = {res}")
        else:
            ptr = _store_ptr(m.name, _out_index(m), names, self.k)
            lines.append(f"{pad}tl.store({ptr}, {res}, mask=xmask)")


def _stored(v: str, dt) -> str:
    """The value a store writes: 8-bit floats converted explicitly with eager's rounding (an
    implicit conversion would saturate e5m2's infinities); others convert on store."""
    return f"{triton_round(dt.name)}({v})" if dt.name in ROUND8 else v


def _store_ptr(buf: str, idx: sympy.Expr, names: dict[str, str], k: int) -> str:
    """The store pointer, shaped like the row mask even when `idx` ignores the rows."""
    row = any(v in sympy.sympify(idx).free_symbols for v in ivars(k))
    return f"buf_{buf} + {to_tl(idx, names)}" + ("" if row else " + xidx * 0")


def _out_index(m: L.Compute) -> sympy.Expr:
    return linear_index(ivars(len(m.shape)), contiguous_strides(m.shape))


def print_triton_kernel(kernel: Kernel, buffers: dict[str, L.Buffer], hints: dict[str, int],
                        config: Config | None = None) -> TritonKernel:
    config = config or choose_config(kernel, hints)
    idx_t = "tl.int32" if _small_indices(kernel, buffers) else "tl.int64"
    kp = _KernelPrinter(kernel, buffers, config, idx_t)
    body: list[str] = []
    read_later: set[str] = set()
    for j, m in enumerate(kernel.members):
        for later in kernel.members[j + 1:]:
            if m.name in {ld.buf for ld in L.loads(later.body)} and m.name not in kp.locals:
                read_later.add(m.name)
    for j, m in enumerate(kernel.members):
        body.append(f"    # {m.name} <- {', '.join(m.source)}")
        (kp.reduction if m.reduce is not None else kp.pointwise)(j, m, body)
        if m.name in read_later:
            body.append("    tl.debug_barrier()  # later members read what this one stored")
    params = list(kernel_params(kernel, buffers))
    if kp.status[0]:
        params.append(("status", "kiln_status"))
    sig: dict[str, str] = {}
    for kind, n in params:
        if kind == "size":
            sig[n] = "i64"
        elif kind == "status":
            sig[n] = "*i32"
        else:
            sig[f"buf_{n}"] = SIG_PTR[buffers[n].dtype]
    sig["XBLOCK"] = sig["RBLOCK"] = "constexpr"
    rows = product(kernel.outer)
    head = [
        "@triton.jit",
        f"def {kernel.name}({', '.join(a for a in sig if a not in ('XBLOCK', 'RBLOCK'))}"
        f"{', ' if len(sig) > 2 else ''}XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):",
        f"    # {kernel.name}: {', '.join(m.name for m in kernel.members)}",
        f"    #   from graph nodes: {', '.join(kernel.source)}",
    ]
    if idx_t == "tl.int64":
        head.append("    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + "
                    "tl.program_id(0)")
    else:
        head.append("    pid = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)")
    head.append("    xidx = pid * XBLOCK + tl.arange(0, XBLOCK)[:, None]")
    head.append(f"    xmask = xidx < {to_tl(rows)}")
    for s, e in zip(ivars(kp.k), unravel(sympy.Symbol("xidx"), kernel.outer)):
        head.append(f"    {s.name} = {to_tl(e)}")
    src = "\n".join(head + _value_number(body)) + "\n"
    return TritonKernel(kernel.name, src, tuple(params), sig, config, rows, kernel.source)


_TOP = re.compile(r"^    (\w+) = (.+)$")  # an assignment at the kernel's top level
_NAME = re.compile(r"\b\w+\b")


def _value_number(lines: list[str]) -> list[str]:
    """Top-level assignments that repeat an earlier one (after renaming) become that earlier
    name. Members of a kernel print their loads and index math independently; when their
    tiles are single (no loop), a softmax's three passes then load each element once instead
    of three times. A store to a buffer forgets the loads of that buffer seen before it."""
    counts: dict[str, int] = {}
    for ln in lines:
        m = re.match(r"^\s*(\w+) = ", ln)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    alias: dict[str, str] = {}
    seen: dict[str, str] = {}
    out = []
    for ln in lines:
        if alias:
            ln = _NAME.sub(lambda w: alias.get(w.group(0), w.group(0)), ln)
        for buf in re.findall(r"tl\.store\((buf_\w+)", ln):
            seen = {k: v for k, v in seen.items() if f"tl.load({buf} " not in k}
        m = _TOP.match(ln)
        if m and counts[m.group(1)] == 1 and not m.group(2).startswith("tl.full("):
            if m.group(2) in seen:
                alias[m.group(1)] = seen[m.group(2)]
                continue
            seen[m.group(2)] = m.group(1)
        out.append(ln)
    return out


def print_triton_module(kernels: list[TritonKernel]) -> str:
    return PRELUDE + "".join("\n\n" + k.source for k in kernels)
