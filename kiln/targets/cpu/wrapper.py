"""Program IR -> model.cpp: the C++ wrapper that implements `kiln_model_abi` (see
kiln/runtime/include/kiln_model_abi.h). Each Program IR line prints as a few C++ statements,
each call preceded by a comment naming its graph nodes. Kernels are defined in separate files
and declared here."""

from __future__ import annotations

import sympy

from kiln.targets.cpu import dnnl, dnnl_gemm
from kiln.targets.cpu.conv import ONEDNN, call_comment
from kiln.targets.cpu.quant import call_comment as qgemm_comment
from kiln.targets.cpu.gemm import epilogue_args, epilogue_function, function_name
from kiln.ir import loop as L
from kiln.ir import program as P
from kiln.ir.sym import free_size_symbols, to_c, unbounded
from kiln.memory.assign import intervals
from kiln.options import GemmBackend
from kiln.schedule.analysis import aten_fallback_ops
from kiln.targets import collectives, state_abi
from kiln.targets.cpu import wrapper_prof
from kiln.targets.cxx_wrapper import SizeCheckPrinter, _cstr, _dl, condition, heap_buffers, \
    run_prologue, runtime_plan_lines







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
    and strides as a local array, outputs, attributes, operands (kiln_lib.h's convention).
    A convolution given to oneDNN calls the Instance's kl::dnnl::Conv (targets/cpu/dnnl.py)."""
    comment = call_comment(x) or qgemm_comment(x)
    lines = [comment] if comment else []
    if x.attr("backend") == ONEDNN:
        return lines + dnnl.call_lines(x, _cstr(", ".join(x.source) or x.name))
    lines.append(f"{{  // lib.{x.routine} -> {', '.join(x.outs)}  <- {', '.join(x.source)}")
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






def written_buffers(x: P.Line) -> list[str]:
    """Buffers a step line writes."""
    if isinstance(x, P.CallKernel):
        return [n for k, n in x.args if k == "out"]
    if isinstance(x, P.CallGemm):
        return [x.gemm.name]
    if isinstance(x, P.CallAten):
        return [r.name for r in x.call.results()]
    return []


class _Printer(SizeCheckPrinter):
    def __init__(self, prog: P.Program, gemm_choices: dict | None = None,
                 check_finite: bool = False) -> None:
        self.p = prog
        self.gemm_choices = gemm_choices or {}
        self.out: list[str] = []
        self.check_finite = check_finite
        # buffer -> (dtype, element count as run) for the finite-value checks
        self.sizes = {x.buf: (x.dtype, sympy.Mul(*x.shape)) for x in prog.lines
                      if isinstance(x, P.AllocOutput)}
        self.sizes.update({x.buf: (x.dtype, x.numel) for x in P.walk(prog.lines)
                           if isinstance(x, P.Alloc)})
        self.dynamic_bufs = [iv.name for iv in intervals(prog, {s.name: s.example
                                                                for s in prog.symbols})]
        self.heap_bufs = heap_buffers(prog)
        # step name -> its index in the profile (wrapper_prof.py)
        self.prof_steps = wrapper_prof.steps(prog, self.gemm_choices)
        self.prof_index = {s[0]: i for i, s in enumerate(self.prof_steps)}


    def _SetFlag(self, x: P.SetFlag) -> None:
        if x.buf is not None:  # the 0-d predicate, read on the host
            self.emit(f"const bool {x.flag} = buf_{x.buf}[0] != 0;")
        else:
            self.emit(f"const bool {x.flag} = {condition(x.expr, to_c, ('&&', '||', '!'))};")

    def _CopyBuf(self, x: P.CopyBuf) -> None:
        self.emit(f"std::memcpy(buf_{x.dst}, buf_{x.src}, static_cast<size_t>({to_c(x.numel)}) "
                  f"* {x.dtype.itemsize});  // {x.dst} <- {x.src}")

    def line(self, x: P.Line) -> None:
        step = wrapper_prof.step_of(x, self.gemm_choices)
        if step is not None:  # profiling hooks: a branch when off (wrapper_prof.py)
            self.emit(wrapper_prof.BEGIN)
        getattr(self, "_" + type(x).__name__)(x)
        if step is not None:
            self.emit(wrapper_prof.end(self.prof_index[step[0]]))
        if self.check_finite:  # Options(check_finite=True): stop at the first inf / nan
            for b in written_buffers(x):
                dt, numel = self.sizes.get(b, (None, 0))
                if dt is not None and dt.is_float:
                    node = getattr(x, "gemm", None) or getattr(x, "call", None) or x
                    src = ", ".join(node.source)
                    self.emit(f"if (kr::check_finite(e, buf_{b}, {to_c(numel)}, "
                              f"{_cstr(b)}, {_cstr(src)})) goto fail;")

    def _CheckInput(self, x: P.CheckInput) -> None:
        code, bits = _dl(x.dtype)
        n = _cstr(x.name)
        self.emit(f"if (kr::check_tensor(e, inputs[{x.index}], {x.index}, {n}, {code}, {bits}, "
                  f"{x.rank}) || kr::check_contiguous(e, inputs[{x.index}], {x.index}, {n}) ||")
        self.emit(f"    kr::check_data(e, inputs[{x.index}], {x.index}, {n}, {x.dtype.itemsize}))"
                  " return 1;")
        self.emit(f"const {x.dtype.c_type}* buf_{x.name} = "
                  f"kr::data_of<{x.dtype.c_type}>(inputs[{x.index}]);")

    def _AllocOutput(self, x: P.AllocOutput, declared: bool = False) -> None:
        code, bits = _dl(x.dtype)
        if x.capacity is not None:
            self.emit(f"// output {x.index} has data-dependent sizes {list(x.shape)}: allocated "
                      "for their upper bounds, its shape is set once they are known")
        shape = ", ".join(to_c(d) for d in (x.capacity or x.shape)) or "0"
        self.emit(f"{{ const int64_t shape[] = {{{shape}}};")
        self.emit(f"  outs[{x.index}] = kr::new_output(e, {code}, {bits}, {len(x.shape)}, "
                  "shape); }")
        self.emit(f"if (!outs[{x.index}]) goto fail;")
        self.emit(f"{'' if declared else x.dtype.c_type + '* '}buf_{x.buf} = "
                  f"static_cast<{x.dtype.c_type}*>(outs[{x.index}]->dl_tensor.data);")

    def declare_late(self, x: P.Line) -> None:
        self.emit(f"{x.dtype.c_type}* buf_{x.buf} = nullptr;  // allocated once the call "
                  "returns its sizes")

    def make_late(self, x: P.Line) -> None:
        if isinstance(x, P.AllocOutput):
            self._AllocOutput(x, declared=True)
        else:
            self._Alloc(x, declared=True)

    def _Alloc(self, x: P.Alloc, declared: bool = False) -> None:
        if x.state is not None:  # the state's own storage: updated in place
            self.emit(f"{x.dtype.c_type}* buf_{x.buf} = buf_{x.state};  // state {x.state}, "
                      f"updated in place ({x.numel} elements)")
            return
        if x.heap:  # sized by a data-dependent size without a bound: outside the arena
            T = x.dtype.c_type
            self.emit(f"{'' if declared else T + '* '}buf_{x.buf} = static_cast<{T}*>(heap.alloc("
                      f"e, {_cstr(x.buf)}, {to_c(x.nbytes)}));  // {x.numel} elements, "
                      "allocated now: no upper bound")
            self.emit(f"if (!buf_{x.buf}) goto fail;")
            return
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
        if x.buf in self.heap_bufs:
            self.emit(f"heap.release(buf_{x.buf}); buf_{x.buf} = nullptr;  // {x.buf} dead")
            return
        self.emit(f"buf_{x.buf} = nullptr;  // {x.buf} dead: its bytes may be reused")

    def _CallKernel(self, x: P.CallKernel) -> None:
        self.emit(f"// {x.kernel}: {', '.join(x.members)}  <- {', '.join(x.source)}")
        args = [n if k == "size" else f"buf_{n}" for k, n in x.args]
        if x.status:
            args.append("&status")
        self.emit(f"{x.kernel}({', '.join(args)});")
        if x.status:
            self.emit(f"if (status) {{ e.fail(\"%s\", {_cstr(x.index_error)}); goto fail; }}")

    def _CallGemm(self, x: P.CallGemm) -> None:
        g = x.gemm
        T = g.dtype.c_type
        b = list(g.batch) + [1] * (2 - len(g.batch))
        if len(g.batch) > 2:
            raise NotImplementedError("gemm with more than two batch dims")
        sa = list(g.a.batch_strides) + [0] * (2 - len(g.a.batch_strides))
        sb = list(g.b.batch_strides) + [0] * (2 - len(g.b.batch_strides))
        choice = self.gemm_choices.get(g.name)
        backend = choice.backend if choice is not None else GemmBackend.BLAS
        self.emit(f"// gemm {g.name} = {g.a.buf} @ {g.b.buf}  <- {', '.join(g.source)}  "
                  f"[{backend.value}{', ' + choice.how if choice is not None else ''}]")
        if backend is GemmBackend.ONEDNN:  # oneDNN's matmul, epilogue as post-ops
            for s in dnnl_gemm.call_lines(g, choice.config, _cstr(", ".join(g.source) or g.name)):
                self.emit(s)
            return
        if g.epilogue is not None and backend is GemmBackend.CPP:
            self.emit(f"// epilogue fused into the GEMM: {g.epilogue.name} <- "
                      f"{', '.join(g.epilogue.source)}")
        call = (f"{function_name(g.name)}(" if backend is GemmBackend.CPP else
                f"kr::gemm<{T}>(e, {_cstr(g.name)}, ")
        self.emit(f"if ({call}{to_c(b[0])}, {to_c(b[1])}, "
                  f"{to_c(g.m)}, {to_c(g.n)}, {to_c(g.k)},")
        self.emit(f"    buf_{g.a.buf} + {to_c(g.a.offset)}, {to_c(sa[0])}, {to_c(sa[1])}, "
                  f"{to_c(g.a.rows)}, {to_c(g.a.cols)},")
        # a fused epilogue (kiln/gemm/fuse_cpu.py): its inputs follow C ("cpp"), or it runs
        # over the result after the BLAS call
        epi = [f"buf_{n}" if k == "in" else n for k, n, _ in epilogue_args(g)]
        fused = "".join(f", {a}" for a in epi) if backend is GemmBackend.CPP else ""
        if g.packed_b:  # the weight holds B's panels (passes/pack_cpu.py)
            self.emit(f"    buf_{g.b.buf} /* prepacked, {g.packed_b}-column panels */, "
                      f"buf_{g.name}{fused})) goto fail;")
        else:
            self.emit(f"    buf_{g.b.buf} + {to_c(g.b.offset)}, {to_c(sb[0])}, {to_c(sb[1])}, "
                      f"{to_c(g.b.rows)}, {to_c(g.b.cols)}, buf_{g.name}{fused})) goto fail;")
        if g.epilogue is not None and backend is not GemmBackend.CPP:
            self.emit(f"{epilogue_function(g.name)}({', '.join([f'buf_{g.name}', *epi])});  "
                      f"// epilogue {g.epilogue.name} <- {', '.join(g.epilogue.source)}")

    def _ReadSizeLine(self, x: P.ReadSizeLine) -> None:
        n = x.node
        self.emit(f"// {n.symbol} = {n.src}.item(): a data-dependent size  <- "
                  f"{', '.join(n.source)}")
        self.emit(f"{n.symbol} = static_cast<int64_t>(buf_{n.src}[0]);")
        if unbounded(n.symbol, n.hi):
            self.emit(f"if ({n.symbol} < {n.lo}) {{ e.fail(\"{n.src}.item() is %lld, below "
                      f"{n.lo}, the least value the export assumed for size {n.symbol}\", "
                      f"(long long){n.symbol}); goto fail; }}")
        else:
            self.emit(f"if ({n.symbol} < {n.lo} || {n.symbol} > {to_c(n.hi)}) {{ e.fail("
                      f"\"{n.src}.item() is %lld, outside [{n.lo}, {n.hi}], the range the "
                      f"export assumed for size {n.symbol}\", (long long){n.symbol}); "
                      "goto fail; }")
        self.emit(f"buf_{n.name}[0] = {n.symbol};")

    def _CallLib(self, x: P.CallLib) -> None:
        if collectives.is_collective(x):  # MPI (kiln_comm_mpi.h)
            for s in collectives.collective_lines(x.call, self.p.buffer_dtypes[x.call.name],
                                                   "mpi"):
                self.emit(s)
            return
        for s in lib_call_lines(x.call):
            self.emit(s)

    def _CopyState(self, x: P.CopyState) -> None:
        self.emit(f"// state {x.dst} <- {x.src}: persists to the next run")
        self.emit(f"std::memcpy(buf_{x.dst}, buf_{x.src}, static_cast<size_t>({to_c(x.numel)}) "
                  f"* {x.dtype.itemsize});")

    def _Return(self, x: P.Return) -> None:
        for out in (y for y in self.p.lines if isinstance(y, P.AllocOutput) and y.capacity):
            for d, size in enumerate(out.shape):
                if size != out.capacity[d]:
                    self.emit(f"outs[{out.index}]->dl_tensor.shape[{d}] = {to_c(size)};")
        self.emit(f"for (int64_t i = 0; i < {len(x.buffers)}; ++i) outputs[i] = outs[i];")
        self.emit("return 0;")






def _plan_block(pr: _Printer, prog: P.Program) -> None:
    reserve = ("if (!self->arena.reserve({bytes} > 64 ? {bytes} : 64)) "
               "return e.fail(\"out of memory reserving the arena\");")
    if prog.arena_bytes is not None:
        pr.emit(reserve.format(bytes=max(prog.arena_bytes, 64)))
        return
    for indent, line in runtime_plan_lines(prog, prog.alignment, reserve):
        pr.emit(line, indent)


def print_wrapper(prog: P.Program, kernel_decls: list[str],
                  gemm_choices: dict | None = None, check_finite: bool = False) -> str:
    """`gemm_choices`: GEMM name -> gemm Choice (kiln/gemm); missing ones use BLAS.
    `check_finite`: see Options.check_finite."""
    pr = _Printer(prog, gemm_choices, check_finite)
    n_in, n_w = len(prog.inputs), len(prog.weights)
    outs = [x for x in prog.lines if isinstance(x, P.AllocOutput)]
    n_out = len(outs)
    n_dyn = max(len(pr.dynamic_bufs), 1)
    aten_ops = aten_fallback_ops(prog)
    comm = bool(collectives.collective_steps(prog))
    head = [
        "// Generated by kiln: the model wrapper. Implements kiln_model_abi (one run = the",
        "// lines of the Program IR below, in order).",
        "#include <cmath>",
        "#include <cstring>",
        '#include "kiln_model_rt.h"',
        '#include "kiln_plan.h"',
        *(['#include "kiln_aten.h"  // ATen fallback: ' + ", ".join(aten_ops)] if aten_ops else []),
        *(['#include "kiln_lib.h"'] if any(isinstance(x, P.CallLib) for x in P.walk(prog.lines))
          else []),
        *(['#include "kiln_comm_mpi.h"  // collectives through MPI'] if comm else []),
        *(dnnl.include_lines() if dnnl.dnnl_steps(prog.lines) or
          dnnl_gemm.dnnl_gemms(prog.lines, pr.gemm_choices) else []),
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
        f"  bool borrowed[{max(n_w, 1)}] = {{}};  // owned[k] is another instance's (share_state)",
        f"  ~Instance() {{ for (int i = 0; i < {max(n_w, 1)}; ++i) if (!borrowed[i]) "
        "std::free(owned[i]); }",
        "  kr::Arena arena;",
        f"  int64_t key[{max(len(prog.symbols), 1)}];",
        "  bool planned = false;",
        "  int64_t arena_bytes = 0;",
        f"  int64_t offsets[{n_dyn}];",
        *(["  kc::Comm comm;  // MPI: kiln_model_comm_v1 attaches it"] if comm else []),
        "  kr::Pool pool;  // this instance's threads (kiln_pool.h), joined when it is destroyed",
        wrapper_prof.INSTANCE_FIELD,
        *dnnl.instance_fields(prog.lines),
        *dnnl_gemm.instance_fields(prog.lines, pr.gemm_choices),
        "};",
        "",
        "void* create(const void* const* weights, char* err, size_t errlen) {",
        *([f"  {{ kr::Err e{{err, errlen}}; if (kr_aten::require(e, {_cstr(', '.join(aten_ops))}))"
           " return nullptr; }"] if aten_ops else []),
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
        *dnnl.create_lines(prog.lines, {w.name: k for k, w in enumerate(prog.weights)}),
        *dnnl_gemm.create_lines(prog.lines, pr.gemm_choices,
                                {w.name: k for k, w in enumerate(prog.weights)}),
        "  return self;",
        "}",
        "",
        "void destroy(void* p) { delete static_cast<Instance*>(p); }",
        "",
        *state_abi.state_functions(prog, state_abi.CPU),
        "int run(void* instance, const DLTensor* const* inputs, int64_t n_inputs,",
        "        DLManagedTensor** outputs, int64_t n_outputs, char* err, size_t errlen) {",
        *run_prologue(n_in, n_out),
        "  kr::RunScope pool_scope(&self->pool);  // kernels of this run use the instance's pool",
        f"  DLManagedTensor* outs[{max(n_out, 1)}] = {{}};",
        "  int32_t status = 0;",
        "  (void)status;",
        *wrapper_prof.RUN_LOCALS,
        *(["  kr::HeapBuffers heap;  // buffers sized by unbounded data-dependent sizes"]
          if pr.heap_bufs else []),
    ]
    for k, w in enumerate(prog.weights):
        if w.mutable:
            head.append(f"  {w.dtype.c_type}* buf_{w.name} = static_cast<{w.dtype.c_type}*>("
                        f"self->owned[{k}]);  // state {w.fqn}")
        else:
            head.append(f"  const {w.dtype.c_type}* buf_{w.name} = static_cast<const "
                        f"{w.dtype.c_type}*>(self->w[{k}]);  // {w.fqn}")
    body_start = len(pr.out)
    checks = [x for x in prog.lines if isinstance(x, P.CHECKS)]
    rest = [x for x in prog.lines if x not in checks]
    for x in checks:
        pr.line(x)
    _plan_block(pr, prog)
    for name, bound in prog.unbacked:
        pr.emit(f"int64_t {name} = 0;  // data-dependent size, " + (
            "no upper bound" if unbounded(name, bound) else f"at most {bound}"))
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
        "KILN_POOL_ENTRY_POINTS  // kiln_pool_{get_max,set_num}_threads: libkiln's run budget",
        "",
        'extern "C" KILN_KERNEL const kiln_model_abi* kiln_model_abi_v1(void) {',
        "  static const kiln_model_abi table = {KILN_MODEL_ABI_VERSION, "
        f"{n_in}, {n_out}, {n_w}, kWeightNames,",
        "                                       kWeightBytes, kWeightDtypes, create, run, "
        "destroy,",
        "                                       kDLCPU, nullptr, nullptr,",
        f"                                       {state_abi.TABLE_FIELDS}}};",
        "  return &table;",
        "}",
        "",
    ]
    tail += wrapper_prof.table_lines(pr.prof_steps)
    if comm:
        tail += collectives.comm_table_lines(prog, "mpi", [
            f"return kc::attach(e, self->comm, rank, world_size, {collectives.group_size(prog)}, "
            "comm_id, comm_id_len);"])
    _ = L, free_size_symbols
    return "\n".join(head + pr.out + tail)
