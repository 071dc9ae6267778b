"""Program IR -> model.cpp: the C++ wrapper that implements `kiln_model_abi` (see
kiln/runtime/include/kiln_model_abi.h). Each Program IR line prints as a few C++ statements,
each call preceded by a comment naming its graph nodes. Kernels are defined in separate files
and declared here."""

from __future__ import annotations

from kiln.ir import loop as L
from kiln.ir import program as P
from kiln.ir.sym import free_size_symbols, to_c
from kiln.memory.assign import intervals

DL_CODE = {"float": 2, "int": 0, "uint": 1, "bool": 6}


def _dl(dt) -> tuple[int, int]:
    return dt.dl_code, dt.itemsize * 8


def _cstr(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def c_attr(v) -> str:
    """A static attribute of a library call as a C++ argument."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return f"int64_t({v})"
    if isinstance(v, float):
        if v != v:
            return "std::numeric_limits<double>::quiet_NaN()"
        if v in (float("inf"), float("-inf")):
            return ("-" if v < 0 else "") + "std::numeric_limits<double>::infinity()"
        return repr(v)
    if isinstance(v, tuple):
        return "{" + ", ".join(c_attr(x) for x in v) + "}"
    raise TypeError(f"library call attribute {v!r}")


def lib_call_lines(x: L.Extern, ptr: str = "buf_{}") -> list[str]:
    """The C++ block calling `kl::<routine>` (kiln_lib.h) for one Extern: each operand's sizes
    and strides as a local array, outputs, attributes, operands (kiln_lib.h's convention)."""
    lines = [f"{{  // lib.{x.routine} -> {', '.join(x.outs)}  <- {', '.join(x.source)}"]
    args = []
    for k, a in enumerate(x.args):
        dims = [to_c(d) for d in (*a.shape, *a.strides)] or ["0"]
        lines.append(f"  const int64_t d{k}[] = {{{', '.join(dims)}}};  // {a.buf}: sizes, "
                     "strides")
        args.append(f"kl::view({ptr.format(a.buf)} + {to_c(a.offset)}, {len(a.shape)}, d{k})")
    outs = [ptr.format(o) for o in x.outs]
    attrs = [f"/*{k}=*/{c_attr(v)}" for k, v in x.attrs]
    call = ", ".join([_cstr(", ".join(x.source) or x.name)] + outs + attrs + args)
    lines.append(f"  if (kl::{x.routine}(e, {call})) goto fail;")
    lines.append("}")
    return lines


def declare_kernel(name: str, params, status: bool, dtypes) -> str:
    sig = []
    for kind, n in params:
        if kind == "size":
            sig.append("int64_t")
        else:
            sig.append(("const " if kind == "in" else "") + f"{dtypes[n].c_type}*")
    if status:
        sig.append("int32_t*")
    return f'extern "C" void {name}({", ".join(sig)});'


class SizeCheckPrinter:
    """Printers of the size lines (BindSize, CheckSize, CheckRange), shared by the CPU and CUDA
    wrappers; subclasses provide `emit`."""

    def _BindSize(self, x: P.BindSize) -> None:
        self.emit(f"const int64_t {x.symbol} = inputs[{x.input}]->shape[{x.dim}];")

    def _CheckSize(self, x: P.CheckSize) -> None:
        got = f"inputs[{x.input}]->shape[{x.dim}]"
        self.emit(f"if ({got} != {to_c(x.expr)}) return e.fail(\"input {x.input} ({x.name}): "
                  f"expected size {x.expr} for dim {x.dim}, got %lld\", (long long){got});")

    def _CheckRange(self, x: P.CheckRange) -> None:
        self.emit(f"if ({x.symbol} < {x.lo} || {x.symbol} > {x.hi}) return e.fail(\"input "
                  f"{x.input} ({x.name}): dim {x.dim} is %lld, expected a value in "
                  f"[{x.lo}, {x.hi}] (symbol {x.symbol})\", (long long){x.symbol});")


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


class _Printer(SizeCheckPrinter):
    def __init__(self, prog: P.Program) -> None:
        self.p = prog
        self.out: list[str] = []
        self.dynamic_bufs = [iv.name for iv in intervals(prog, {s.name: s.example
                                                                for s in prog.symbols})]

    def emit(self, s: str = "", ind: int = 1) -> None:
        self.out.append("  " * ind + s if s else "")

    def line(self, x: P.Line) -> None:
        getattr(self, "_" + type(x).__name__)(x)

    def _CheckInput(self, x: P.CheckInput) -> None:
        code, bits = _dl(x.dtype)
        n = _cstr(x.name)
        self.emit(f"if (kr::check_tensor(e, inputs[{x.index}], {x.index}, {n}, {code}, {bits}, "
                  f"{x.rank}) || kr::check_contiguous(e, inputs[{x.index}], {x.index}, {n}) ||")
        self.emit(f"    kr::check_data(e, inputs[{x.index}], {x.index}, {n}, {x.dtype.itemsize}))"
                  " return 1;")
        self.emit(f"const {x.dtype.c_type}* buf_{x.name} = "
                  f"kr::data_of<{x.dtype.c_type}>(inputs[{x.index}]);")

    def _AllocOutput(self, x: P.AllocOutput) -> None:
        code, bits = _dl(x.dtype)
        shape = ", ".join(to_c(d) for d in x.shape) or "0"
        self.emit(f"{{ const int64_t shape[] = {{{shape}}};")
        self.emit(f"  outs[{x.index}] = kr::new_output(e, {code}, {bits}, {len(x.shape)}, "
                  "shape); }")
        self.emit(f"if (!outs[{x.index}]) goto fail;")
        self.emit(f"{x.dtype.c_type}* buf_{x.buf} = static_cast<{x.dtype.c_type}*>("
                  f"outs[{x.index}]->dl_tensor.data);")

    def _Alloc(self, x: P.Alloc) -> None:
        if x.reuse is not None:  # in place: the same bytes as the dying temp (same dtype)
            self.emit(f"{x.dtype.c_type}* buf_{x.buf} = buf_{x.reuse};  // in place of "
                      f"{x.reuse}, {x.numel} elements")
            return
        if x.offset is not None:
            off = str(x.offset)
        else:
            off = f"self->offsets[{self.dynamic_bufs.index(x.buf)}]"
        self.emit(f"{x.dtype.c_type}* buf_{x.buf} = reinterpret_cast<{x.dtype.c_type}*>("
                  f"self->arena.base + {off});  // {x.numel} elements")

    def _Free(self, x: P.Free) -> None:
        self.emit(f"buf_{x.buf} = nullptr;  // {x.buf} dead: its bytes may be reused")

    def _CallKernel(self, x: P.CallKernel) -> None:
        self.emit(f"// {x.kernel}: {', '.join(x.members)}  <- {', '.join(x.source)}")
        args = [n if k == "size" else f"buf_{n}" for k, n in x.args]
        if x.status:
            args.append("&status")
        self.emit(f"{x.kernel}({', '.join(args)});")
        if x.status:
            self.emit(f"if (status) {{ e.fail(\"index out of range in {', '.join(x.source)}\"); "
                      "goto fail; }")

    def _CallGemm(self, x: P.CallGemm) -> None:
        g = x.gemm
        T = g.dtype.c_type
        b = list(g.batch) + [1] * (2 - len(g.batch))
        if len(g.batch) > 2:
            raise NotImplementedError("gemm with more than two batch dims")
        sa = list(g.a.batch_strides) + [0] * (2 - len(g.a.batch_strides))
        sb = list(g.b.batch_strides) + [0] * (2 - len(g.b.batch_strides))
        self.emit(f"// gemm {g.name} = {g.a.buf} @ {g.b.buf}  <- {', '.join(g.source)}")
        self.emit(f"if (kr::gemm<{T}>(e, {_cstr(g.name)}, {to_c(b[0])}, {to_c(b[1])}, "
                  f"{to_c(g.m)}, {to_c(g.n)}, {to_c(g.k)},")
        self.emit(f"    buf_{g.a.buf} + {to_c(g.a.offset)}, {to_c(sa[0])}, {to_c(sa[1])}, "
                  f"{to_c(g.a.rows)}, {to_c(g.a.cols)},")
        self.emit(f"    buf_{g.b.buf} + {to_c(g.b.offset)}, {to_c(sb[0])}, {to_c(sb[1])}, "
                  f"{to_c(g.b.rows)}, {to_c(g.b.cols)}, buf_{g.name})) goto fail;")

    def _CallLib(self, x: P.CallLib) -> None:
        for s in lib_call_lines(x.call):
            self.emit(s)

    def _CopyState(self, x: P.CopyState) -> None:
        self.emit(f"// state {x.dst} <- {x.src}: persists to the next run")
        self.emit(f"std::memcpy(buf_{x.dst}, buf_{x.src}, static_cast<size_t>({to_c(x.numel)}) "
                  f"* {x.dtype.itemsize});")

    def _Return(self, x: P.Return) -> None:
        self.emit(f"for (int64_t i = 0; i < {len(x.buffers)}; ++i) outputs[i] = outs[i];")
        self.emit("return 0;")


def runtime_plan_lines(prog: P.Program, alignment: int, reserve: str) -> list[tuple[int, str]]:
    """(indent, line) of the C++ that plans the arena for the run's sizes, once per distinct
    size tuple (`kiln_rt::plan_greedy`). `reserve(bytes)` is the statement that grows the
    instance's arena; it must return from `run` on failure. Shared by the CPU and CUDA
    wrappers."""
    ivs = intervals(prog, {s.name: s.example for s in prog.symbols})
    allocs = {x.buf: x for x in prog.lines if isinstance(x, P.Alloc)}
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


def _plan_block(pr: _Printer, prog: P.Program) -> None:
    reserve = ("if (!self->arena.reserve({bytes} > 64 ? {bytes} : 64)) "
               "return e.fail(\"out of memory reserving the arena\");")
    if prog.arena_bytes is not None:
        pr.emit(reserve.format(bytes=max(prog.arena_bytes, 64)))
        return
    for indent, line in runtime_plan_lines(prog, prog.alignment, reserve):
        pr.emit(line, indent)


def print_wrapper(prog: P.Program, kernel_decls: list[str]) -> str:
    pr = _Printer(prog)
    n_in, n_w = len(prog.inputs), len(prog.weights)
    outs = [x for x in prog.lines if isinstance(x, P.AllocOutput)]
    n_out = len(outs)
    n_dyn = max(len(pr.dynamic_bufs), 1)
    head = [
        "// Generated by kiln: the model wrapper. Implements kiln_model_abi (one run = the",
        "// lines of the Program IR below, in order).",
        "#include <cstring>",
        '#include "kiln_model_rt.h"',
        '#include "kiln_plan.h"',
        *(['#include "kiln_lib.h"'] if any(isinstance(x, P.CallLib) for x in prog.lines)
          else []),
        "",
        *kernel_decls,
        "",
        "namespace {",
        "const char* const kWeightNames[] = {" + ", ".join(
            _cstr(w.name) for w in prog.weights) + ("" if n_w else "nullptr") + "};",
        "const int64_t kWeightBytes[] = {" + ", ".join(
            str(w.nbytes) for w in prog.weights) + ("" if n_w else "0") + "};",
        "const char* const kWeightDtypes[] = {" + ", ".join(
            _cstr(w.dtype.safetensors) for w in prog.weights) + ("" if n_w else "nullptr") + "};",
        "",
        "struct Instance {",
        f"  const void* w[{max(n_w, 1)}];",
        f"  void* owned[{max(n_w, 1)}] = {{}};  // writable copies of state buffers",
        "  ~Instance() { for (void* p : owned) std::free(p); }",
        "  kr::Arena arena;",
        f"  int64_t key[{max(len(prog.symbols), 1)}];",
        "  bool planned = false;",
        "  int64_t arena_bytes = 0;",
        f"  int64_t offsets[{n_dyn}];",
        "};",
        "",
        "void* create(const void* const* weights, char* err, size_t errlen) {",
        "  Instance* self = new (std::nothrow) Instance();",
        "  if (!self) { kr::Err{err, errlen}.fail(\"out of memory creating an instance\"); "
        "return nullptr; }",
        f"  for (int i = 0; i < {n_w}; ++i) self->w[i] = weights[i];",
        *[line for k, w in enumerate(prog.weights) if w.mutable for line in (
            f"  self->owned[{k}] = std::aligned_alloc(64, {(w.nbytes + 63) // 64 * 64 or 64});",
            f"  if (!self->owned[{k}]) {{ delete self; kr::Err{{err, errlen}}.fail(\"out of "
            f"memory copying state {w.fqn}\"); return nullptr; }}",
            f"  std::memcpy(self->owned[{k}], weights[{k}], {w.nbytes});",
            f"  self->w[{k}] = self->owned[{k}];  // state {w.fqn}: updated by every run")],
        "  kr::blas_single_threaded();",
        "  return self;",
        "}",
        "",
        "void destroy(void* p) { delete static_cast<Instance*>(p); }",
        "",
        "int run(void* instance, const DLTensor* const* inputs, int64_t n_inputs,",
        "        DLManagedTensor** outputs, int64_t n_outputs, char* err, size_t errlen) {",
        *run_prologue(n_in, n_out),
        f"  DLManagedTensor* outs[{max(n_out, 1)}] = {{}};",
        "  int32_t status = 0;",
        "  (void)status;",
    ]
    for k, w in enumerate(prog.weights):
        if w.mutable:
            head.append(f"  {w.dtype.c_type}* buf_{w.name} = static_cast<{w.dtype.c_type}*>("
                        f"self->owned[{k}]);  // state {w.fqn}")
        else:
            head.append(f"  const {w.dtype.c_type}* buf_{w.name} = static_cast<const "
                        f"{w.dtype.c_type}*>(self->w[{k}]);  // {w.fqn}")
    body_start = len(pr.out)
    checks = [x for x in prog.lines if isinstance(x, (P.CheckInput, P.BindSize, P.CheckSize,
                                                      P.CheckRange))]
    rest = [x for x in prog.lines if x not in checks]
    for x in checks:
        pr.line(x)
    _plan_block(pr, prog)
    pr.emit("{")
    for x in rest:
        pr.line(x)
    pr.emit("}")
    pr.emit("fail:", 0)
    pr.emit(f"for (int64_t i = 0; i < {max(n_out, 1)}; ++i) kr::free_output(outs[i]);")
    pr.emit("return 1;")
    del body_start
    tail = [
        "}",
        "}  // namespace",
        "",
        'extern "C" KILN_KERNEL const kiln_model_abi* kiln_model_abi_v1(void) {',
        "  static const kiln_model_abi table = {KILN_MODEL_ABI_VERSION, "
        f"{n_in}, {n_out}, {n_w}, kWeightNames,",
        "                                       kWeightBytes, kWeightDtypes, create, run, "
        "destroy,",
        "                                       kDLCPU, nullptr, nullptr};",
        "  return &table;",
        "}",
        "",
    ]
    _ = L, free_size_symbols
    return "\n".join(head + pr.out + tail)
