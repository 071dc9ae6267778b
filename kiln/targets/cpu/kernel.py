"""Schedule -> C++ kernel functions.

One `Kernel` becomes one `extern "C"` function: an OpenMP parallel loop over the kernel's outer
index space; inside it each member runs its inner loops in order, the innermost one marked `omp
simd` so the compiler vectorises it. Expressions are printed once per distinct subtree (common
subexpressions become `const` temporaries); statements that no loop of the member changes are
printed before its loops (loops of static, non-zero size only). Buffers are `buf_<name>`
pointers with `__restrict__` (the memory plan never lets two live buffers overlap), except the
two parameters of an in-place pair (an output stored into its dying input's bytes, see
kiln/memory/inplace.py): `aliased` names them (Program IR's `Alloc.reuse`); when the caller
gives none, every pair that the kernel alone allows to alias loses it (`alias_pairs`, a safe
superset)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection

import sympy

from kiln.targets.float8 import cpp_cast
from kiln.targets.cpu.ops import ACC_TYPES, CPP_OPS, REDUCTIONS
from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir.sym import contiguous_strides, ivars, linear_index, rvars, to_c as _to_c
from kiln.memory.inplace import alias_pairs
from kiln.schedule import Kernel
from kiln.schedule.analysis import indexes_through_data, kernel_params


def to_c(e) -> str:
    """An index or size as kernel C++ (Max / Min by value: kiln/ir/sym.py's to_c)."""
    return _to_c(e, kernel=True)


def _storage(dt) -> bool:
    """A 16- or 8-bit float storage type (a kr:: struct in C++: kr::bfloat16, kr::half, ...)."""
    return dt.is_float and dt.itemsize <= 2


def _plain_cast(dt) -> bool:
    """Whether the conversion to `dt` is its struct's constructor (cpp_cast's static_cast; not
    float8_e4m3fn's overflow-to-NaN variant), which kr::to_bits / kr::round_as apply."""
    return cpp_cast(dt.c_type, dt.name, "x").startswith("static_cast<")


def _narrowing(e: L.Expr) -> bool:
    """A cast from a computed (non-storage) value to a storage type."""
    return (isinstance(e, L.Expr) and not isinstance(e, (L.Const, L.Index, L.Load))
            and e.op == "cast" and _storage(e.dtype) and not _storage(e.args[0].dtype)
            and _plain_cast(e.dtype))


def c_literal(value, dt) -> str:
    if dt.name == "bool":
        return "true" if value else "false"
    if dt.is_float and dt.itemsize <= 2:  # a storage type: rounded from the float32 value
        text = c_literal(value, dtypes.float32)
        return cpp_cast(dt.c_type, dt.name, text) if dt.itemsize == 1 else f"{dt.c_type}({text})"
    if dt.is_float:
        v = float(value)
        if v != v:
            return f"std::numeric_limits<{dt.c_type}>::quiet_NaN()"
        if v in (float("inf"), float("-inf")):
            sign = "" if v > 0 else "-"
            return f"{sign}std::numeric_limits<{dt.c_type}>::infinity()"
        text = repr(v)
        return f"{text}f" if dt.name == "float32" else text
    v = int(value)
    if v == -(2**63):  # the literal 9223372036854775808 does not fit int64 before negation
        text = "(-INT64_C(9223372036854775807) - 1)"
    else:
        text = f"INT64_C({v})"
    return text if dt.name == "int64" else f"static_cast<{dt.c_type}>({text})"


@dataclass
class ExprPrinter:
    """Prints expression trees as a list of `const` statements, sharing repeated subtrees.

    16- and 8-bit float storage structs (kr::bfloat16, kr::half, ...) get no temporaries in
    the usual shapes: a load of one is printed where it is used (not hoisted), a value rounded
    to one and widened back is `kr::round_as<S>(x)`, and a member's store of a narrowed value
    `.bits = kr::to_bits<S>(x)` (kiln_kernels.h says why: a struct temporary keeps an `omp
    simd` loop scalar). Other uses (a storage value selected or cast to another storage type)
    still print one."""

    locals: dict[str, str]  # reduction buffers held in registers: name -> variable
    rows: dict = field(default_factory=dict)  # row-local buffer -> base index of the row
    lines: list[str] = field(default_factory=list)
    memo: dict = field(default_factory=dict)
    counter: int = 0
    #: the variables of the loops the statements go inside; a statement that depends on none
    #: of them goes to `hoisted` (printed before the loops) instead of `lines`, so an
    #: embedding row looked up through data is found once per row, not gathered per element
    inner: frozenset = frozenset()
    hoisted: list[str] = field(default_factory=list)
    varies: dict = field(default_factory=dict)  # expression -> depends on `inner` (memo)

    def _varies(self, e: L.Expr) -> bool:
        if isinstance(e, L.Const):
            return False
        if e not in self.varies:
            if isinstance(e, L.Index):
                v = bool(sympy.sympify(e.expr).free_symbols & self.inner)
            elif isinstance(e, L.Load):
                v = bool(sympy.sympify(e.index).free_symbols & self.inner) or any(
                    self._varies(ind.value) for ind in e.indirect)
            else:
                v = any(self._varies(a) for a in e.args)
            self.varies[e] = v
        return self.varies[e]

    def fresh(self) -> str:
        self.counter += 1
        return f"t{self.counter}"

    def value(self, e: L.Expr) -> str:
        if isinstance(e, L.Const):
            return c_literal(e.value, e.dtype)
        key = e
        if key in self.memo:
            return self.memo[key]
        if self.inner and not self._varies(e):  # loop-invariant: printed before the loops
            inner, lines = self.inner, self.lines
            self.inner, self.lines = frozenset(), self.hoisted
            try:
                return self.value(e)
            finally:
                self.inner, self.lines = inner, lines
        if isinstance(e, L.Index):
            text = f"static_cast<{e.dtype.c_type}>({to_c(e.expr)})"
        elif isinstance(e, L.Load):
            text = self._load(e)
            if _storage(e.dtype) or e.dtype.is_complex:  # read where it is used, no struct
                # temporary (a complex element's parts are read as `.re` / `.im` of it)
                self.memo[key] = text
                return text
        elif e.op in ("real", "imag") and e.args[0].dtype.name == "complex32":
            # float16 bits in the element: read where used (as loads of storage types)
            text = f"kr::half_of_bits({self.value(e.args[0])}.{e.op[:2]})"
            self.memo[key] = text
            return text
        elif e.op == "complex" and e.dtype.name == "complex32":  # float16 parts: their bits
            re, im = (f"kr::to_bits<kr::half>({self.value(a.args[0])})" if _narrowing(a)
                      else f"({self.value(a)}).bits" for a in e.args)
            text = f"kr_complex32{{{re}, {im}}}"
        elif e.op == "cast" and not _storage(e.dtype) and _narrowing(e.args[0]):
            inner = e.args[0]
            rounded = f"kr::round_as<{inner.dtype.c_type}>({self.value(inner.args[0])})"
            text = cpp_cast(e.dtype.c_type, e.dtype.name, rounded)
        elif e.op == "cast":
            text = cpp_cast(e.dtype.c_type, e.dtype.name, self.value(e.args[0]))
        else:
            args = [self.value(a) for a in e.args]
            text = CPP_OPS[e.op].format(*args)
        if isinstance(e, L.Load) and e.buf in self.locals:
            self.memo[key] = text
            return text
        name = self.fresh()
        self.lines.append(f"const {e.dtype.c_type} {name} = {text};")
        self.memo[key] = name
        return name

    def store(self, dest: str, e: L.Expr) -> str:
        """The statement storing the value of `e` into `dest` (e's statements printed)."""
        if _narrowing(e):
            return f"{dest}.bits = kr::to_bits<{e.dtype.c_type}>({self.value(e.args[0])});"
        if isinstance(e, L.Op) and e.op == "complex":  # the parts stored apart: no struct
            if e.dtype.name == "complex32":  # float16 parts: their bits
                re, im = (f"kr::to_bits<kr::half>({self.value(a.args[0])})" if _narrowing(a)
                          else f"({self.value(a)}).bits" for a in e.args)
                return f"{dest}.re = {re}; {dest}.im = {im};"
            re, im = (self.value(a) for a in e.args)
            return f"{dest}.re = {re}; {dest}.im = {im};"
        return f"{dest} = {self.value(e)};"

    def _load(self, e: L.Load) -> str:
        if e.buf in self.locals and not e.indirect:
            return self.locals[e.buf]
        for ind in e.indirect:
            v = self.value(ind.value)
            var = ind.var.name
            b = to_c(ind.bound)
            # an index the loops do not change is tested once, before them (its row of the
            # table is then read contiguously, not gathered)
            out = self.hoisted if self.inner and not self._varies(ind.value) else self.lines
            out.append(f"int64_t {var} = {v};")
            if ind.wrap:
                out.append(f"if ({var} < 0) {var} += {b};")
            # branch-free, so a simd loop with a gather still vectorises: the member ORs the
            # out-of-range tests into kiln_bad and flags the status once (_checked)
            out.append(f"const bool bad_{var} = static_cast<uint64_t>({var}) >= "
                       f"static_cast<uint64_t>({b});")
            out.append(f"{BAD} |= bad_{var};")
            out.append(f"{var} = bad_{var} ? 0 : {var};")
        if e.buf in self.rows:
            return f"row_{e.buf}[{to_c(sympy.expand(e.index - self.rows[e.buf]))}]"
        return f"buf_{e.buf}[{to_c(e.index)}]"


#: a member's count of out-of-range indices read through data (ExprPrinter._load)
BAD = "kiln_bad"


def _checked(block: list[str]) -> list[str]:
    """A member's block ("{", ..., "}") whose gathers test their indices (ExprPrinter._load):
    `kiln_bad` declared first, OR-reduced by its simd loops, the status flagged at the end;
    other blocks unchanged."""
    if not any(f"{BAD} |=" in s for s in block):
        return block
    body = [s + f" reduction(|:{BAD})" if s.lstrip().startswith("#pragma omp simd") else s
            for s in block[1:-1]]
    return ["{", f"  int {BAD} = 0;", *body, f"  if ({BAD}) kr::flag(kiln_status);", "}"]


def _loop(var: str, size, pragma: str | None = None) -> list[str]:
    head = [pragma] if pragma else []
    return head + [f"for (int64_t {var} = 0; {var} < {to_c(size)}; ++{var}) {{"]


def _hoist_over(loop_vars, sizes) -> frozenset:
    """The loop variables whose loops an ExprPrinter may hoist invariant statements out of:
    all of them when every loop runs at least once (static sizes >= 1; a load hoisted out of a
    loop that runs zero times could read past a buffer), else none."""
    if all(sympy.sympify(n).is_Integer and int(n) >= 1 for n in sizes):
        return frozenset(loop_vars)
    return frozenset()


def _member(m: L.Compute, k: int, locals_: dict[str, str], rows: dict | None = None
            ) -> list[str]:
    """Statements of one member inside the outer loops (outer vars i0..i{k-1} are bound)."""
    return _checked(_member_block(m, k, locals_, rows))


def _member_block(m: L.Compute, k: int, locals_: dict[str, str], rows: dict | None = None
                  ) -> list[str]:
    rows = rows or {}
    lines = [f"// {m.name} <- {', '.join(m.source)}"]
    iv = ivars(len(m.shape))
    full_index = linear_index(iv, contiguous_strides(m.shape))
    dest = (f"row_{m.name}[{to_c(sympy.expand(full_index - rows[m.name]))}]" if m.name in rows
            else f"buf_{m.name}[{to_c(full_index)}]")
    inner = list(range(k, len(m.shape)))
    T = m.dtype.c_type
    opened = 0
    body_indent = []
    if m.reduce is None:
        p = ExprPrinter(locals_, rows, inner=_hoist_over(iv[k:], m.shape[k:]))
        stored = p.store(dest, m.body)
        lines += p.hoisted
        for j, d in enumerate(inner):
            pragma = "#pragma omp simd" if j == len(inner) - 1 else None
            lines += _loop(f"i{d}", m.shape[d], pragma)
            opened += 1
        body_indent = p.lines + [stored]
        lines += ["  " + s for s in body_indent]
        lines += ["}"] * opened
        return ["{"] + ["  " + s for s in lines] + ["}"]
    for d in inner:
        if m.shape[d] == 1:
            lines.append(f"const int64_t i{d} = 0;")
        else:
            lines += _loop(f"i{d}", m.shape[d])
            opened += 1
    kind = m.reduce.kind
    acc, nan = f"acc_{m.name}", f"nan_{m.name}"
    rv = rvars(len(m.reduce.sizes))
    if kind in ("argmax", "argmin"):
        src_t = m.body.dtype.c_type
        cmp = ">" if kind == "argmax" else "<"
        lines += [f"{src_t} best = kr::{'lowest' if kind == 'argmax' else 'highest'}<{src_t}>();",
                  "int64_t besti = 0; bool first = true;"]
        p = ExprPrinter(locals_, rows, inner=_hoist_over(rv, m.reduce.sizes))
        x = p.value(m.body)
        lines += p.hoisted
        for j, r in enumerate(rv):
            lines += _loop(r.name, m.reduce.sizes[j])
        flat = to_c(linear_index(rv, contiguous_strides(m.reduce.sizes)))
        lines += ["  " + s for s in p.lines]
        lines += [f"  if (first || ({x} {cmp} best) || ({x} != {x} && best == best)) "
                  f"{{ best = {x}; besti = {flat}; first = false; }}"]
        lines += ["}"] * len(rv)
        lines.append(f"{locals_.get(m.name, dest)} = besti;")  # a local when fused away
    else:
        ident, combine, clause = REDUCTIONS[kind]
        # a float sum over several loops adds each run of the innermost one into a float
        # partial, and the partials into a double (rounding grows with the longest run, not
        # with all the elements, as one running float32 sum of a whole tensor would)
        cascade = kind == "sum" and len(rv) > 1 and T in ("float", "double")
        inner_acc = f"part_{m.name}" if cascade else acc
        acc_t = "double" if cascade else ACC_TYPES.get(kind, T)
        lines.append(f"{acc_t} {acc} = {ident.format(T=T)};")
        uses_nan = "{nan}" in combine
        if uses_nan:
            lines.append(f"int {nan} = 0;")
        p = ExprPrinter(locals_, rows, inner=_hoist_over(rv, m.reduce.sizes))
        x = p.value(m.body)
        lines += p.hoisted
        for j, r in enumerate(rv):
            pragma = None
            if j == len(rv) - 1:
                if cascade:
                    lines.append(f"  {T} {inner_acc} = 0;")
                if clause:
                    pragma = f"#pragma omp simd reduction({clause}:{inner_acc})"
                    if uses_nan:
                        pragma += f" reduction(|:{nan})"
            lines += _loop(r.name, m.reduce.sizes[j], pragma)
        lines += ["  " + s for s in p.lines]
        lines.append("  " + combine.format(acc=inner_acc, x=x, nan=nan))
        if rv:  # (a reduction over no dims, e.g. of a 0-d tensor, opens no loop)
            lines.append("}")
        if cascade:
            lines.append(f"  {acc} += {inner_acc};")
        lines += ["}"] * (len(rv) - 1)
        if uses_nan:
            lines.append(f"if ({nan}) {acc} = std::numeric_limits<{T}>::quiet_NaN();")
        if m.name in locals_:
            lines.append(f"{locals_[m.name]} = {acc};")
        else:
            lines.append(f"{dest} = {acc};")
    lines += ["}"] * opened
    return ["{"] + ["  " + s for s in lines] + ["}"]


# Elements of work below which a kernel runs on the calling thread: waking the pool's team
# (kiln_pool.h) costs a few microseconds, more than a small loop takes.
PARALLEL_MIN_WORK = 16384


def kernel_work(kernel: Kernel) -> sympy.Expr:
    """Elements one run of the kernel touches (outer x the largest member's inner space)."""
    best = sympy.Integer(1)
    for m in kernel.members:
        size = sympy.Mul(*m.shape) * sympy.Mul(*(m.reduce.sizes if m.reduce else ()))
        best = size if best == 1 else sympy.Max(best, size)
    return sympy.simplify(best) if not best.is_Integer else best


def _chunk_loop(kernel: Kernel, body: list[str], outer_vars: list[str]) -> list[str]:
    """Body of `<kernel>_chunk(kr_lo, kr_hi, ...)`: outer iterations [kr_lo, kr_hi) of the
    row-major outer space, the innermost outer loop kept as a plain (vectorisable) loop."""
    k = len(outer_vars)
    sizes = [f"n_{v}" for v in outer_vars]
    out = [f"  const int64_t {n} = {to_c(kernel.outer[d])};" for d, n in enumerate(sizes)]
    last, n_last = outer_vars[-1], sizes[-1]
    if k == 1:
        out.append(f"  for (int64_t {last} = kr_lo; {last} < kr_hi; ++{last}) {{")
        out += ["    " + s for s in body]
        return out + ["  }"]
    # the chunk's first outer index, then runs of the innermost outer loop, carrying
    out += [f"  int64_t kr_q = kr_lo / {n_last};", f"  int64_t {last} = kr_lo % {n_last};"]
    for d in reversed(range(1, k - 1)):
        out += [f"  int64_t {outer_vars[d]} = kr_q % {sizes[d]};", f"  kr_q /= {sizes[d]};"]
    out.append(f"  int64_t {outer_vars[0]} = kr_q;")
    out.append("  for (int64_t kr_f = kr_lo; kr_f < kr_hi;) {")
    out.append(f"    const int64_t kr_end = {n_last} - {last} < kr_hi - kr_f ? {n_last} : "
               f"{last} + (kr_hi - kr_f);")
    out.append(f"    kr_f += kr_end - {last};")
    out.append(f"    for (; {last} < kr_end; ++{last}) {{")
    out += ["      " + s for s in body]
    out += ["    }", f"    {last} = 0;"]
    carry = ""
    for d in reversed(range(1, k - 1)):
        carry += f"if (++{outer_vars[d]} == {sizes[d]}) {{ {outer_vars[d]} = 0; "
    carry += f"++{outer_vars[0]};" + " }" * (k - 2)
    return out + [f"    {carry}", "  }"]


def _team(kernel: Kernel, num_threads: int) -> str:
    """The team size expression of the kernel's parallel_for: the run's budget (capped by
    Options.num_threads), 1 below PARALLEL_MIN_WORK elements of work (the former OpenMP `if`
    clause)."""
    work = kernel_work(kernel)
    if work.is_Integer and int(work) < PARALLEL_MIN_WORK:
        return "1"  # too little work to pay for waking threads
    team = f"kr::team_cap({num_threads})" if num_threads else "kr::max_threads()"
    if work.is_Integer:
        return team
    return f"{to_c(work)} >= {PARALLEL_MIN_WORK} ? {team} : 1"


def print_kernel(kernel: Kernel, buffers: dict[str, L.Buffer], num_threads: int = 0,
                 aliased: Collection[str] | None = None) -> tuple[str, list, bool]:
    """C++ source of one kernel, its parameter list and whether it takes a status pointer."""
    if aliased is None:
        aliased = alias_pairs(kernel, buffers)
    locals_ = {name: f"v_{name}" for name in kernel.locals}
    k = len(kernel.outer)
    body: list[str] = []
    for name in sorted(kernel.locals):
        dt = next(m.dtype for m in kernel.members if m.name == name)
        body.append(f"{dt.c_type} v_{name};")
    rows = {}
    outer_base = linear_index(ivars(k), contiguous_strides(kernel.outer))
    for m in kernel.members:
        if m.name in kernel.row_locals:
            inner = sympy.Mul(*m.shape[k:])
            rows[m.name] = sympy.expand(outer_base * inner)
            body.append(f"alignas(64) {m.dtype.c_type} row_{m.name}[{to_c(inner)}];"
                        "  // this outer iteration's slice only")
    for m in kernel.members:
        body += _member(m, k, locals_, rows)
    params = kernel_params(kernel, buffers)
    sig = []
    for kind, name in params:
        if kind == "size":
            sig.append(f"int64_t {name}")
        else:
            const = "const " if kind == "in" else ""
            restrict = "" if name in aliased else " __restrict__"
            sig.append(f"{const}{buffers[name].dtype.c_type}*{restrict} buf_{name}")
    status = indexes_through_data(kernel)
    if status:
        sig.append("int32_t* __restrict__ kiln_status")
    head = [f"// {kernel.name}: {', '.join(m.name for m in kernel.members)}",
            f"//   from graph nodes: {', '.join(kernel.source)}"]
    entry = f'extern "C" KILN_KERNEL void {kernel.name}({", ".join(sig)}) {{'
    outer_vars = [f"i{d}" for d in range(k)]
    if k:
        # the outer space as one flat range over kiln's thread pool (kiln_pool.h, static
        # schedule); each chunk runs in its own function, whose parameters keep __restrict__
        sizes = [f"({to_c(n)})" for n in kernel.outer]
        args = ", ".join(name if kind == "size" else f"buf_{name}" for kind, name in params)
        args += ", kiln_status" if status else ""
        lines = [*head, f"static __attribute__((noinline)) void {kernel.name}_chunk("
                 f"int64_t kr_lo, int64_t kr_hi, {', '.join(sig)}) {{",
                 *_chunk_loop(kernel, body, outer_vars), "}", entry,
                 f"  kr::parallel_for({' * '.join(sizes)}, {_team(kernel, num_threads)}, "
                 "[&](int64_t kr_lo, int64_t kr_hi) {",
                 f"    {kernel.name}_chunk(kr_lo, kr_hi, {args});", "  });"]
    else:
        lines = [*head, entry, *("  " + s for s in body)]
    lines.append("}")
    return "\n".join(lines), params, status
