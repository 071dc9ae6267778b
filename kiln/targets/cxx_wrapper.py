"""C++ wrapper pieces both targets print (model.cpp on the CPU, model_cuda.cpp on CUDA): the
size lines and control-flow blocks of the Program IR, ATen fallback calls, the run prologue and
the run-time arena plan. Each target's wrapper subclasses `SizeCheckPrinter` for its own lines."""

from __future__ import annotations

import sympy

from kiln.ir import loop as L
from kiln.ir import program as P
from kiln.ir.sym import to_c, unbounded
from kiln.memory.assign import intervals


def _dl(dt) -> tuple[int, int]:
    return dt.dl_code, dt.bits


def _cstr(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def condition(e, fmt, ops: tuple[str, str, str]) -> str:
    """A size condition (sympy relational / boolean) printed with `fmt` for the sizes and
    `ops` = (and, or, not) spellings."""

    if e is sympy.true or e is True:
        return "true" if ops[0] == "&&" else "True"
    if e is sympy.false or e is False:
        return "false" if ops[0] == "&&" else "False"
    if isinstance(e, sympy.And):
        return "(" + f" {ops[0]} ".join(condition(a, fmt, ops) for a in e.args) + ")"
    if isinstance(e, sympy.Or):
        return "(" + f" {ops[1]} ".join(condition(a, fmt, ops) for a in e.args) + ")"
    if isinstance(e, sympy.Not):
        return f"({ops[2]} {condition(e.args[0], fmt, ops)})"
    return f"({fmt(e.lhs)} {e.rel_op} {fmt(e.rhs)})"


def run_prologue(n_in: int, n_out: int) -> list[str]:
    """The argument checks that open every generated `run` function."""
    return [
        "  kr::Err e{err, errlen};",
        "  Instance* self = static_cast<Instance*>(instance);",
        "  if (!self) return e.fail(\"run: instance is NULL\");",
        f"  if (n_inputs != {n_in}) return e.fail(\"expected {n_in} inputs, got %lld\", "
        "(long long)n_inputs);",
        f"  if (n_outputs != {n_out}) return e.fail(\"expected {n_out} outputs, got %lld\", "
        "(long long)n_outputs);",
        f"  if (!inputs && {n_in}) return e.fail(\"inputs array is NULL\");",
        "  if (!outputs) return e.fail(\"outputs array is NULL\");",
    ]


def runtime_plan_lines(prog: P.Program, alignment: int, reserve: str) -> list[tuple[int, str]]:
    """(indent, line) of the C++ that plans the arena for the run's sizes, once per distinct
    size tuple (`kiln_rt::plan_greedy`). `reserve(bytes)` is the statement that grows the
    instance's arena; it must return from `run` on failure. Shared by the CPU and CUDA
    wrappers."""
    ivs = intervals(prog, {s.name: s.example for s in prog.symbols})
    allocs = {x.buf: x for x in P.walk(prog.lines) if isinstance(x, P.Alloc)}
    out = [(1, "// dynamic sizes: plan the arena for these sizes (cached until they change)"),
           (1, f"const int64_t key[] = {{{', '.join(s.name for s in prog.symbols)}}};"),
           (1, "if (!self->planned || std::memcmp(key, self->key, sizeof key) != 0) {")]
    if ivs:
        sizes = ", ".join(to_c(allocs[iv.name].nbytes) for iv in ivs)
        out += [(2, f"const int64_t sizes[] = {{{sizes}}};"),
                (2, f"static const int32_t starts[] = {{{', '.join(str(i.start) for i in ivs)}}};"),
                (2, f"static const int32_t ends[] = {{{', '.join(str(i.end) for i in ivs)}}};"),
                (2, f"self->arena_bytes = kiln_rt::plan_greedy({len(ivs)}, sizes, starts, ends, "
                    f"{alignment}, self->offsets);")]
    else:
        out.append((2, "self->arena_bytes = 0;"))
    out += [(2, reserve.format(bytes="self->arena_bytes")),
            (2, "std::memcpy(self->key, key, sizeof key);"),
            (2, "self->planned = true;"),
            (1, "}")]
    return out


class SizeCheckPrinter:
    """Printers shared by the CPU and CUDA wrappers: the size lines (BindSize, CheckSize,
    CheckRange) and the control-flow blocks (If, While, BreakUnless); subclasses provide
    `out`, `line` and the device-specific lines."""

    depth = 0  # nesting of control-flow blocks

    def emit(self, s: str = "", ind: int = 1) -> None:
        self.out.append("  " * (ind + self.depth) + s if s else "")

    def block(self, lines) -> None:
        self.depth += 1
        for x in lines:
            self.line(x)
        self.depth -= 1

    def _If(self, x: P.If) -> None:
        self.emit(f"if ({x.flag}) {{  // torch.cond {', '.join(x.source)}: true branch")
        self.block(x.then)
        self.emit("} else {")
        self.block(x.orelse)
        self.emit("}")

    def _While(self, x: P.While) -> None:
        self.emit(f"while (true) {{  // while_loop {', '.join(x.source)}")
        self.block(x.body)
        self.emit("}")

    def _BreakUnless(self, x: P.BreakUnless) -> None:
        self.emit(f"if (!{x.flag}) break;")


    def _BindSize(self, x: P.BindSize) -> None:
        if x.dim is None:  # an int input: a 0-d int64 host tensor (checked by CheckInput)
            self.emit(f"const int64_t {x.symbol} = *kr::data_of<int64_t>(inputs[{x.input}]);")
            return
        if x.scale != 1 or x.offset:  # a derived dim: checked exactly by a CheckSize line
            self.emit(f"const int64_t {x.symbol} = (inputs[{x.input}]->shape[{x.dim}] - "
                      f"{x.offset}) / {x.scale};")
            return
        self.emit(f"const int64_t {x.symbol} = inputs[{x.input}]->shape[{x.dim}];")

    def _CheckSize(self, x: P.CheckSize) -> None:
        got = f"inputs[{x.input}]->shape[{x.dim}]"
        self.emit(f"if ({got} != {to_c(x.expr)}) return e.fail(\"input {x.input} ({x.name}): "
                  f"expected size {x.expr} for dim {x.dim}, got %lld\", (long long){got});")

    def _CheckRelation(self, x: P.CheckRelation) -> None:
        op, fails = ("==", "!=") if x.equal else ("!=", "==")
        lhs, rhs = to_c(x.lhs), to_c(x.rhs)
        self.emit(f"if ({lhs} {fails} {rhs}) return e.fail(\"input sizes: {x.what} needs "
                  f"{x.lhs} {op} {x.rhs}, got %lld {fails} %lld ({x.symbols})\", "
                  f"(long long)({lhs}), (long long)({rhs}));")

    def _CheckRange(self, x: P.CheckRange) -> None:
        what = "the value" if x.dim is None else f"dim {x.dim}"
        self.emit(f"if ({x.symbol} < {x.lo} || {x.symbol} > {x.hi}) return e.fail(\"input "
                  f"{x.input} ({x.name}): {what} is %lld, expected a value in "
                  f"[{x.lo}, {x.hi}] (symbol {x.symbol})\", (long long){x.symbol});")

    def declare_late(self, x: P.Line) -> None:
        """Declares the pointer of a buffer an ATen call sizes (P.CallAten.allocs)."""
        raise NotImplementedError("run-time allocation of ATen results on this target")

    def make_late(self, x: P.Line) -> None:
        """Allocates it, once the call's data-dependent sizes are bound."""
        raise NotImplementedError("run-time allocation of ATen results on this target")

    # -- ATen fallback calls (kiln_aten.h); `aten_ptr` / `aten_device` differ per device ----
    aten_device = ""  # a line that moves the call to the run's device, if not the CPU

    def aten_ptr(self, buf: str, offset, dt: str) -> str:
        return f"buf_{buf} + {to_c(offset)}"

    def _aten_arg(self, a: L.AtenArg) -> list[str]:
        match a:
            case L.AtenTensor(buf=buf, dtype=dt, shape=shape, strides=strides, offset=offset):
                sizes = ", ".join(to_c(d) for d in shape) or "0"
                st = ", ".join(to_c(d) for d in strides) or "0"
                return [f"{{ const int64_t sz[] = {{{sizes}}}, st[] = {{{st}}};",
                        f"  if (!c.tensor({self.aten_ptr(buf, offset, dt.name)}, {len(shape)}, "
                        f"sz, st, {dt.scalar_type})) goto fail; }}"]
            case L.AtenTensors(items=items):
                return [ln for x in items for ln in self._aten_arg(x)] + [
                    f"if (!c.list({len(items)})) goto fail;"]
            case L.AtenOptional(value=value):
                return self._aten_arg(value) + ["c.optional();"]
            case L.AtenNone():
                return ["c.none();"]
            case L.AtenInt(value=v):
                return [f"c.i64({to_c(v)});"]
            case L.AtenFloat(value=v):
                v = float(v)
                text = repr(v) if v == v and abs(v) != float("inf") else (
                    "NAN" if v != v else ("-" if v < 0 else "") + "INFINITY")
                return [f"c.f64({text});"]
            case L.AtenBool(value=v):
                return [f"c.boolean({'true' if v else 'false'});"]
            case L.AtenInts(values=vs):
                return [f"c.i64({to_c(v)});" for v in vs] + [f"if (!c.list({len(vs)})) goto fail;"]
            case L.AtenDtype(dtype=dt):
                return [f"c.i64({dt.scalar_type});"]
            case L.AtenStr(value=v):
                return [f"if (!c.str({_cstr(v)})) goto fail;"]
        raise TypeError(a)

    def _CallAten(self, x: P.CallAten) -> None:
        c = x.call
        ov = c.overload or "default"
        res = c.results()
        taken = ", ".join(f"result {r.result} -> {r.name}" if c.n_results > 1 else r.name
                          for r in res)
        self.emit(f"// aten fallback {c.op}.{ov} ({taken})  <- {', '.join(c.source)}")
        for a in x.allocs:  # results sized by what the call returns: allocated below
            self.declare_late(a)
        self.emit(f"{{ kr_aten::Call c(e, {_cstr(c.op)}, {_cstr(c.overload)});")
        if self.aten_device:
            self.emit(f"  {self.aten_device}")
        for a in c.args:
            for ln in self._aten_arg(a):
                self.emit("  " + ln)
        self.emit(f"  if (!c.run({c.n_results})) goto fail;")
        bounds = dict(self.p.unbacked)
        for r in res:
            for d, name, _ in r.binds:  # data-dependent sizes: known now, checked
                self.emit(f"  {name} = c.result_size({r.result}, {d});")
                if unbounded(name, bounds[name]):
                    continue
                self.emit(f"  if ({name} < 0 || {name} > {to_c(bounds[name])}) {{ e.fail("
                          f"\"ATen fallback {c.op}: data-dependent size {name} = %lld exceeds "
                          f"its bound {bounds[name]}\", (long long){name}); goto fail; }}")
        self.depth += 1
        for a in x.allocs:
            self.make_late(a)
        self.depth -= 1
        for k, r in enumerate(res):
            shape = ", ".join(to_c(d) for d in r.shape) or "0"
            self.emit(f"  {{ const int64_t out_sz[] = {{{shape}}};")
            self.emit(f"    if (!c.copy_out({r.result}, {self.aten_ptr(r.name, 0, r.dtype.name)}"
                      f", {len(r.shape)}, out_sz, {r.dtype.scalar_type})) goto fail; }}"
                      + (" }" if k == len(res) - 1 else ""))


def heap_buffers(prog: P.Program) -> set[str]:
    """Buffers allocated at run time outside the arena (P.Alloc.heap), both targets: by the
    program, or inside an ATen call once it returned (P.CallAten.allocs)."""
    out = set()
    for x in P.walk(prog.lines):
        for a in ((x,) if isinstance(x, P.Alloc) else
                  x.allocs if isinstance(x, P.CallAten) else ()):
            if isinstance(a, P.Alloc) and a.heap:
                out.add(a.buf)
    return out
