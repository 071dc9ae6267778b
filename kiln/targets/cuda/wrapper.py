"""Program IR -> model_cuda.cpp: the C++ wrapper of a CUDA model. It implements the same
`kiln_model_abi` as the CPU wrapper (kiln/runtime/include/kiln_model_abi.h) for device tensors.

Input: a planned Program, the `TritonKernel`s (launch configs), their cubins per architecture
and the path of the cubin blob. Output: one C++ source (plus `cubin_blob`, which lays the cubins
out in one byte string). Each Program IR line prints as a few statements, each call preceded by
a comment naming its graph nodes.

Invariants: the cubins are one blob embedded with `.incbin` (one object, not one per kernel);
create_on_device picks the cubins of the device's architecture (exact match, else the newest of
the same major version that is not newer than the device), loads one module per kernel once,
uploads the weights once (one allocation, each weight 256-byte aligned) and owns one output
pool, one arena and one cuBLAS handle; a run validates the inputs (kDLCUDA on the instance's
device, 16-byte aligned), plans the arena (at run time for dynamic sizes, cached), launches
every kernel on the caller's stream (no launch for an empty grid; a user Triton kernel on its
own 3-D grid after copying the inputs it overwrites) and returns device outputs.
Nothing here needs libcuda at link time."""

from __future__ import annotations

import math

import sympy

from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir import program as P
from kiln.ir.dtypes import DTYPES
from kiln.ir.sym import data_dependent_symbols, to_c, unbounded
from kiln.targets import collectives
from kiln.targets.cxx_wrapper import SizeCheckPrinter, _cstr, condition, heap_buffers, \
    runtime_plan_lines
from kiln.memory.assign import intervals
from kiln.gemm.configs import BlasLtConfig
from kiln.gemm.cutlass_evt import Evt, from_epilogue
from kiln.gemm.cutlass_link import entry, workspace_entry
from kiln.ir.sym import UNBOUNDED_NOMINAL, evaluate
from kiln.targets.cuda.put import put_kernel_names
from kiln.targets.cuda.bag_mask import BAG_MASK_ROUTINES
from kiln.targets.cuda.put_reduce import is_reducing_put, put_reduce_kernel_names
from kiln.targets.cuda.scan import (NONZERO_ROUTINE, SCAN_ROUTINES, cput_kernel_name,
                                    is_complex_product, scan_kernel_names)
from kiln.targets.cuda.sort import SORT_ROUTINES, sort_kernel_names
from kiln.targets.cuda.wrapper_parts import print_cuda_model
from kiln.errors import UnsupportedError
from kiln.gemm.problem import layout


# the element type kc::gemm is instantiated with (16-bit floats as kiln_cuda_rt.h's storage
# types, which pick cublasGemmStridedBatchedEx with float accumulation)
_GEMM_T = {dtypes.float16: "kc::f16", dtypes.bfloat16: "kc::bf16"}
# cudaDataType of each dtype a cuBLASLt (low-precision) GEMM reads or writes
_LT_TYPE = {dtypes.float8_e4m3fn: "kc::kR8F_E4M3", dtypes.float8_e5m2: "kc::kR8F_E5M2",
            dtypes.int8: "kc::kR8I", dtypes.int32: "kc::kR32I", dtypes.float32: "kc::kR32F",
            dtypes.bfloat16: "kc::kR16BF", dtypes.float16: "kc::kR16F"}


# C++ types of a user kernel's scalar arguments, as Triton's launcher passes them
_USER_ARG = {"i1": "int8_t", "i32": "int32_t", "i64": "int64_t", "fp32": "float"}


def _float(x: float) -> str:
    if math.isnan(x):
        return "__builtin_nanf(\"\")"
    if math.isinf(x):
        return "__builtin_inff()" if x > 0 else "-__builtin_inff()"
    return f"{x!r}f"



def cubin_blob(cubins: dict, names: list[str], archs: tuple[int, ...]
               ) -> tuple[bytes, dict[tuple[str, int], tuple[int, int]]]:
    """All cubins in one byte string (each 64-byte aligned) and (offset, size) per entry;
    kernels compiled to the same cubin (triton_aot.canonical) share one copy."""
    out = bytearray()
    where: dict = {}
    seen: dict[bytes, tuple[int, int]] = {}
    for a in archs:
        for n in names:
            c = cubins[(n, a)].cubin
            if c not in seen:
                out += b"\0" * (-len(out) % 64)
                seen[c] = (len(out), len(c))
                out += c
            where[(n, a)] = seen[c]
    return bytes(out), where


class _Printer(SizeCheckPrinter):
    def __init__(self, prog: P.Program, kernels: dict, cutlass: dict | None = None,
                 blaslt: dict | None = None, scratch: frozenset = frozenset()) -> None:
        self.p = prog
        self.kernels = kernels
        self.scratch = scratch  # kernels that take the instance's global scratch block
        self.cutlass = cutlass or {}
        self.blaslt = blaslt or {}  # GEMM name -> cuBLASLt heuristic index (BlasLtConfig)
        self.blaslt_gemms: list[str] = []  # those GEMMs, in order: each has an LtGemmPlan
        self.index = {name: i for i, name in enumerate(kernels)}
        self.sync_checks = False  # each run waits for its own index status (see Return)
        #: the source ops of the kernels that report indices out of range, for the message
        self.status_ops = ", ".join(sorted({s for k in kernels.values()
                                            if getattr(k, "status", False)
                                            for s in k.source_ops}))
        self.out: list[str] = []
        env = {s.name: s.example for s in prog.symbols}
        self.dynamic_bufs = [iv.name for iv in intervals(prog, env)]
        self.lt_gemms: list[str] = []  # cuBLASLt GEMMs, in order: each has an LtPlan
        self.heap_bufs = heap_buffers(prog)

    def lt_index(self, name: str) -> int:
        if name not in self.lt_gemms:
            self.lt_gemms.append(name)
        return self.lt_gemms.index(name)


    # ATen fallback calls: torch wraps kiln's device buffers and runs on kiln's stream
    aten_device = "if (!c.on_cuda(self->device_id, static_cast<void*>(stream))) goto fail;"

    def aten_ptr(self, buf: str, offset, dt: str) -> str:
        return f"reinterpret_cast<void*>(buf_{buf} + {DTYPES[dt].itemsize} * ({to_c(offset)}))"

    def _SetFlag(self, x: P.SetFlag) -> None:
        if x.buf is None:
            self.emit(f"const bool {x.flag} = {condition(x.expr, to_c, ('&&', '||', '!'))};")
            return
        # the 0-d bool predicate: a device->host copy on the stream, then wait for it
        self.emit(f"bool {x.flag} = false;")
        self.emit(f"{{ unsigned char v = 0;  // predicate {x.buf}")
        self.emit(f"  if (kc::check(e, kc::driver().cuMemcpyDtoHAsync(&v, buf_{x.buf}, 1, "
                  f"stream), {_cstr('reading ' + x.buf)}) ||")
        self.emit("      kc::check(e, kc::driver().cuStreamSynchronize(stream), "
                  f"{_cstr('reading ' + x.buf)})) goto fail;")
        self.emit(f"  {x.flag} = v != 0; }}")

    def _CopyBuf(self, x: P.CopyBuf) -> None:
        self.emit(f"if (kc::check(e, kc::driver().cuMemcpyDtoDAsync(buf_{x.dst}, buf_{x.src}, "
                  f"static_cast<size_t>({to_c(x.numel)}) * {x.dtype.itemsize}, stream), "
                  f"{_cstr('copy ' + x.dst)})) goto fail;")

    def line(self, x: P.Line) -> None:
        getattr(self, "_" + type(x).__name__)(x)

    def _CheckInput(self, x: P.CheckInput) -> None:
        n, i = _cstr(x.name), x.index
        if x.host:  # an int input: a 0-d int64 host tensor, read by BindSize only
            self.emit(f"if (kr::check_tensor(e, inputs[{i}], {i}, {n}, {x.dtype.dl_code}, "
                      f"{x.dtype.itemsize * 8}, 0) || kr::check_data(e, inputs[{i}], {i}, {n}, "
                      f"{x.dtype.itemsize})) return 1;")
            return
        self.emit(f"if (kc::check_tensor(e, inputs[{i}], {i}, {n}, {x.dtype.dl_code}, "
                  f"{x.dtype.itemsize * 8}, {x.rank}, self->device_id) ||")
        self.emit(f"    kr::check_contiguous(e, inputs[{i}], {i}, {n}) || "
                  f"kc::check_data(e, inputs[{i}], {i}, {n})) return 1;")
        self.emit(f"in_ptr[{i}] = kc::dptr(inputs[{i}]);")
        self.emit(f"in_bytes[{i}] = kc::nbytes(inputs[{i}]);")

    def alloc_output(self, x: P.AllocOutput) -> None:
        """The output tensor, allocated before the run (outside any CUDA graph); one with
        data-dependent sizes at their upper bounds (`_Return` sets its real shape)."""
        if x.capacity is not None:
            self.emit(f"// output {x.index} has data-dependent sizes {list(x.shape)}: allocated "
                      "for their upper bounds, its shape is set once they are known")
        shape = ", ".join(to_c(d) for d in (x.capacity or x.shape)) or "0"
        self.emit(f"{{ const int64_t shape[] = {{{shape}}};")
        self.emit(f"  outs[{x.index}] = kc::new_output(e, self->pool, self->ctx, stream, "
                  f"self->device_id, {x.dtype.dl_code}, {x.dtype.itemsize * 8}, "
                  f"{len(x.shape)}, shape); }}")
        self.emit(f"if (!outs[{x.index}]) goto fail;")
        self.emit(f"out_ptr[{x.index}] = kc::dptr(&outs[{x.index}]->dl_tensor);")
        self.emit(f"out_bytes[{x.index}] = kc::nbytes(&outs[{x.index}]->dl_tensor);")

    def _AllocOutput(self, x: P.AllocOutput, declared: bool = False) -> None:
        if not late_output(x):
            self.emit(f"CUdeviceptr buf_{x.buf} = out[{x.index}];  // output {x.index}")
            return
        # sized by a data-dependent size without an upper bound: allocated now, at its shape
        shape = ", ".join(to_c(d) for d in x.shape) or "0"
        self.emit(f"// output {x.index}: shape {list(x.shape)} known only now (no upper bound)")
        self.emit(f"{{ const int64_t shape[] = {{{shape}}};")
        self.emit(f"  outs[{x.index}] = kc::new_output(e, self->pool, self->ctx, stream, "
                  f"self->device_id, {x.dtype.dl_code}, {x.dtype.itemsize * 8}, "
                  f"{len(x.shape)}, shape); }}")
        self.emit(f"if (!outs[{x.index}]) goto fail;")
        self.emit(f"{'' if declared else 'CUdeviceptr '}buf_{x.buf} = "
                  f"kc::dptr(&outs[{x.index}]->dl_tensor);")

    def declare_late(self, x: P.Line) -> None:
        self.emit(f"CUdeviceptr buf_{x.buf} = 0;  // allocated once the call returns its sizes")

    def make_late(self, x: P.Line) -> None:
        if isinstance(x, P.AllocOutput):
            self._AllocOutput(x, declared=True)
        else:
            self._Alloc(x, declared=True)

    def _Alloc(self, x: P.Alloc, declared: bool = False) -> None:
        if x.heap:  # sized by a data-dependent size without a bound: outside the arena
            self.emit(f"{'' if declared else 'CUdeviceptr '}buf_{x.buf} = heap.alloc(e, "
                      f"{_cstr(x.buf)}, {to_c(x.nbytes)}, stream);  // {x.numel} "
                      f"{x.dtype.name}, allocated now: no upper bound")
            self.emit(f"if (!buf_{x.buf}) goto fail;")
            return
        if x.state is not None:  # the state's own storage: updated in place
            self.emit(f"CUdeviceptr buf_{x.buf} = buf_{x.state};  // state {x.state}, updated "
                      "in place")
            return
        if x.reuse is not None:
            self.emit(f"CUdeviceptr buf_{x.buf} = buf_{x.reuse};  // in place of {x.reuse}")
            return
        off = str(x.offset) if x.offset is not None else \
            f"self->offsets[{self.dynamic_bufs.index(x.buf)}]"
        self.emit(f"CUdeviceptr buf_{x.buf} = self->arena.base + {off};  // {x.numel} "
                  f"{x.dtype.name}")

    def _Free(self, x: P.Free) -> None:
        if x.buf in self.heap_bufs:
            self.emit(f"heap.release(buf_{x.buf}, stream); buf_{x.buf} = 0;  // {x.buf} dead")
            return
        self.emit(f"buf_{x.buf} = 0;  // {x.buf} dead: its bytes may be reused")

    def _CallKernel(self, x: P.CallKernel) -> None:
        self.emit(f"{{  // {x.kernel}: {', '.join(x.members)}  <- {', '.join(x.source)}")
        self._launch(x.kernel)

    def _launch(self, name: str) -> None:
        k = self.kernels[name]
        i = self.index[name]
        args = []
        for kind, n in k.params:
            args.append("&self->status" if kind == "status" else "&self->sms" if kind == "sms"
                        else f"(void*)&{n}" if kind == "size" else f"&buf_{n}")
        # Triton's global scratch (TMA descriptors made on the device), then profiling scratch
        args += ["&self->global_scratch" if name in self.scratch else "&scratch", "&scratch"]
        self.emit(f"  void* args[] = {{{', '.join(args)}}};")
        pdl = ", self->pdl" if k.pdl else ""  # (kernel.with_pdl: it waits for the one before)
        if k.tiles is not None:  # persistent: one program per SM, at most one per tile
            self.emit(f"  const int64_t tiles = {to_c(k.tiles)};")
            self.emit(f"  if (kc::launch(e, {_cstr(name)}, self->fn[{i}], tiles < self->sms "
                      f"? tiles : self->sms, 1, self->warps[{i}], self->shared[{i}], stream, "
                      f"args{pdl})) return 1;")
        else:
            self.emit(f"  if (kc::launch(e, {_cstr(name)}, self->fn[{i}], {to_c(k.rows)}, "
                      f"{k.config.xblock}, self->warps[{i}], self->shared[{i}], stream, "
                      f"args{pdl})) return 1;")
        self.emit("}")

    def _CallUser(self, x: P.CallUser) -> None:
        """A user Triton kernel: copies of the inputs it overwrites, then the launch."""
        u = self.kernels[x.call.name]
        i = self.index[x.call.name]
        grid = ", ".join(f"({to_c(g)})" for g in u.grid)
        self.emit(f"{{  // user Triton kernel {u.call.kernel} ({x.call.name}), config "
                  f"{u.config}  <- {', '.join(x.call.source)}")
        for out, init, n in zip(x.call.outs, x.call.inits, x.numels):
            if init is not None:
                self.emit(f"  if (kc::check(e, kc::driver().cuMemcpyDtoDAsync(buf_{out}, "
                          f"buf_{init}, static_cast<size_t>({to_c(n)}) * "
                          f"{self.p.buffer_dtypes[out].itemsize}, stream), "
                          f"{_cstr('copy ' + init + ' -> ' + out)})) return 1;")
        args = []
        for k, (p, v, ty) in enumerate(u.launch_args()):
            if isinstance(v, L.UserBuf):
                args.append(f"&buf_{v.buf}")
                continue
            ctype = _USER_ARG[ty]
            match v:
                case L.UserInt(value=e):
                    value = to_c(e)
                case L.UserFloat(value=x):
                    value = _float(x)
                case L.UserBool(value=b):
                    value = str(int(b))
                case _:
                    raise TypeError(v)
            self.emit(f"  {ctype} a{k} = static_cast<{ctype}>({value});  // {p}")
            args.append(f"&a{k}")
        args += ["&scratch", "&scratch"]
        self.emit(f"  void* args[] = {{{', '.join(args)}}};")
        self.emit(f"  if (kc::launch_grid(e, {_cstr(u.call.kernel)}, self->fn[{i}], {grid}, "
                  f"self->warps[{i}], self->shared[{i}], stream, args)) return 1;")
        self.emit("}")

    def _ReadSizeLine(self, x: P.ReadSizeLine) -> None:
        """`x.item()` as a size: the scalar read on the host (a device->host copy on the
        stream, then a wait), range-checked, and stored as the int64 scalar `node.name`."""
        n = x.node
        src = self.p.buffer_dtypes[n.src]
        if src.is_float:
            raise UnsupportedError(f"{n.src}.item() (for {', '.join(n.source)}) is used as a "
                                   f"size but holds {src.name} values")
        what = _cstr(f"reading {n.src}.item()")
        self.emit(f"// {n.symbol} = {n.src}.item(): a data-dependent size, read on the host  "
                  f"<- {', '.join(n.source)}")
        self.emit(f"{{ {src.c_type} v = 0;")
        self.emit(f"  if (kc::check(e, kc::driver().cuMemcpyDtoHAsync(&v, buf_{n.src}, "
                  f"{src.itemsize}, stream), {what}) ||")
        self.emit(f"      kc::check(e, kc::driver().cuStreamSynchronize(stream), {what})) "
                  "goto fail;")
        self.emit(f"  {n.symbol} = static_cast<int64_t>(v); }}")
        if unbounded(n.symbol, n.hi):
            self.emit(f"if ({n.symbol} < {n.lo}) {{ e.fail(\"{n.src}.item() is %lld, below "
                      f"{n.lo}, the least value the export assumed for size {n.symbol}\", "
                      f"(long long){n.symbol}); goto fail; }}")
        else:
            self.emit(f"if ({n.symbol} < {n.lo} || {n.symbol} > {to_c(n.hi)}) {{ e.fail("
                      f"\"{n.src}.item() is %lld, outside [{n.lo}, {n.hi}], the range the "
                      f"export assumed for size {n.symbol}\", (long long){n.symbol}); "
                      "goto fail; }")
        # the int64 scalar as a value for kernels: its two 32-bit words, set on the stream
        self.emit(f"if (kc::check(e, kc::driver().cuMemsetD32Async(buf_{n.name}, "
                  f"static_cast<unsigned>(static_cast<uint64_t>({n.symbol}) & 0xffffffffu), 1, "
                  f"stream), {_cstr('writing ' + n.name)}) ||")
        self.emit(f"    kc::check(e, kc::driver().cuMemsetD32Async(buf_{n.name} + 4, "
                  f"static_cast<unsigned>(static_cast<uint64_t>({n.symbol}) >> 32), 1, stream), "
                  f"{_cstr('writing ' + n.name)})) goto fail;")

    def _CallLib(self, x: P.CallLib) -> None:
        c = x.call
        if c.routine == "attention":  # the generated flash-attention kernel (triton_attention)
            ops = ", ".join(a.buf for a in c.args)
            self.emit(f"{{  // attn_{c.name}: {c.name} = attention({ops})  <- "
                      f"{', '.join(c.source)}")
            self._launch(f"attn_{c.name}")
            if f"attn_{c.name}_combine" in self.kernels:  # the decode path's key splits
                self.emit(f"{{  // attn_{c.name}_combine: the key splits of attn_{c.name} "
                          f"(in {c.outs[1]}) merged -> {c.name}")
                self._launch(f"attn_{c.name}_combine")
            return
        if c.routine == "conv2d_nhwc":  # the generated NHWC convolution (conv_template.py)
            ops = ", ".join(a.buf for a in c.args)
            self.emit(f"{{  // conv_{c.name}: {c.name} = conv2d_nhwc({ops})  <- "
                      f"{', '.join(c.source)}")
            self._launch(f"conv_{c.name}")
            return
        if c.routine in (*SCAN_ROUTINES, NONZERO_ROUTINE, *SORT_ROUTINES, *BAG_MASK_ROUTINES):
            # (scan.py, sort.py, bag_mask.py; a multi-block scan: three kernels, a merge
            # sort: its passes)
            names = (sort_kernel_names if c.routine in SORT_ROUTINES else scan_kernel_names)(
                c, self.kernels)
            for k in names:
                self.emit(f"{{  // {k}: {', '.join(c.outs)} = {c.routine}("
                          f"{', '.join(a.buf for a in c.args)})  <- {', '.join(c.source)}")
                self._launch(k)
            return
        if is_complex_product(c, self.p.buffer_dtypes[c.name]):  # (targets/cuda/scan.py)
            self.emit(f"{{  // {cput_kernel_name(c)}: {c.name} = complex scatter product("
                      f"{', '.join(a.buf for a in c.args)})  <- {', '.join(c.source)}")
            self._launch(cput_kernel_name(c))
            return
        if is_reducing_put(c, self.p.buffer_dtypes[c.name]):  # (targets/cuda/put_reduce.py)
            ops = ", ".join(a.buf for a in c.args)
            self.emit(f"// {', '.join(c.outs)} = index_put / scatter reduce({ops})  <- "
                      f"{', '.join(c.source)}")
            copy, *rest = put_reduce_kernel_names(c)
            self.emit(f"if (buf_{c.name} != buf_{c.args[0].buf}) {{  // not in place: out = self")
            self._launch(copy)
            for k in rest:
                self.emit("{")
                self._launch(k)
            return
        if c.routine == "put":  # index_put (targets/cuda/put.py): in place on a state
            copy, scatter = put_kernel_names(c)
            self.emit(f"// {c.name} = index_put({', '.join(a.buf for a in c.args)})  <- "
                      f"{', '.join(c.source)}")
            self.emit(f"if (buf_{c.name} != buf_{c.args[0].buf}) {{  // not in place: out = self")
            self._launch(copy)
            if c.attr("copy_only"):  # its scatter is in a fused launch (schedule/puts.py)
                return
            self.emit("{")
            self._launch(scatter)
            return
        if collectives.is_collective(x):  # NCCL on the communication stream (kiln_comm_nccl.h)
            k = collectives.collective_index(self.p)[c.name]
            for s in collectives.collective_lines(c, self.p.buffer_dtypes[c.name], "nccl",
                                                  index=k):
                self.emit(s)
            return
        if c.routine == collectives.WAIT:  # the compute stream waits for it here
            for s in collectives.wait_lines(c):
                self.emit(s)
            return
        raise UnsupportedError(f"library routine {x.call.routine} (for {', '.join(x.call.source)})"
                               " has no CUDA version yet; compile for the CPU")

    def _CallGemm(self, x: P.CallGemm) -> None:
        g = x.gemm
        if g.lowp is not None:
            return self._lt_gemm(g)
        if g.mixed is not None:  # passes/mixed_gemm.py runs only when Triton may take it
            raise UnsupportedError(f"mixed-dtype GEMM {g.name} ({', '.join(g.source)}) needs "
                                   "the Triton GEMM template (cuBLAS has no int8 x float GEMM)")
        if g.name in self.cutlass:
            self._cutlass(g, x.epilogue)
            return
        if len(g.batch) > 2:
            raise NotImplementedError("gemm with more than two batch dims")
        T = _GEMM_T.get(g.dtype, g.dtype.c_type)
        b = list(g.batch) + [1] * (2 - len(g.batch))
        sa = list(g.a.batch_strides) + [0] * (2 - len(g.a.batch_strides))
        sb = list(g.b.batch_strides) + [0] * (2 - len(g.b.batch_strides))
        sz = g.dtype.itemsize
        algo = self.blaslt.get(g.name)
        if algo is not None and g.dtype.name in ("float16", "bfloat16", "float32"):
            if g.name not in self.blaslt_gemms:
                self.blaslt_gemms.append(g.name)
            plan = self.blaslt_gemms.index(g.name)
            self.emit(f"// gemm {g.name} = {g.a.buf} @ {g.b.buf}: cuBLASLt heuristic algorithm "
                      f"{algo} (result 0 when it offers fewer)  <- {', '.join(g.source)}")
            self.emit(f"if (kc::lt_blas_gemm<{T}>(e, self->lt, self->blas, stream, "
                      f"{_cstr(g.name)}, {algo}, {to_c(b[0])}, {to_c(b[1])}, {to_c(g.m)}, "
                      f"{to_c(g.n)}, {to_c(g.k)},")
            tail = (f", buf_{g.name}, self->workspace, kc::kWorkspaceBytes, "
                    f"&self->blaslt_plan[{plan}])) return 1;")
        else:
            self.emit(f"// gemm {g.name} = {g.a.buf} @ {g.b.buf}  <- {', '.join(g.source)}")
            self.emit(f"if (kc::gemm<{T}>(e, self->blas, stream, {_cstr(g.name)}, "
                      f"{to_c(b[0])}, {to_c(b[1])}, {to_c(g.m)}, {to_c(g.n)}, {to_c(g.k)},")
            tail = f", buf_{g.name})) return 1;"
        self.emit(f"    buf_{g.a.buf} + {sz} * {to_c(g.a.offset)}, {to_c(sa[0])}, "
                  f"{to_c(sa[1])}, {to_c(g.a.rows)}, {to_c(g.a.cols)},")
        self.emit(f"    buf_{g.b.buf} + {sz} * {to_c(g.b.offset)}, {to_c(sb[0])}, "
                  f"{to_c(sb[1])}, {to_c(g.b.rows)}, {to_c(g.b.cols)}{tail}")

    def _lt_gemm(self, g) -> None:
        """A low-precision GEMM through cuBLASLt (operands already in its layout: a row-major,
        b column-major; see lowering/lowp.py)."""
        lp = g.lowp

        def ptr(ref, item: int) -> str:
            if ref is None:
                return "0"
            return f"buf_{ref[0]}" + (f" + {item} * {to_c(ref[1])}" if ref[1] != 0 else "")

        a = ptr((g.a.buf, g.a.offset), lp.a_dtype.itemsize)
        b = ptr((g.b.buf, g.b.offset), lp.b_dtype.itemsize)
        bias_t = _LT_TYPE[g.dtype] if lp.bias else 0
        self.emit(f"// {lp.kind} gemm {g.name} = {g.a.buf} @ {g.b.buf} (cuBLASLt, {lp.a_dtype} x "
                  f"{lp.b_dtype} -> {g.dtype})  <- {', '.join(g.source)}")
        self.emit(f"if (kc::lt_gemm(e, self->lt, stream, {_cstr(g.name)}, {to_c(g.m)}, "
                  f"{to_c(g.n)}, {to_c(g.k)},")
        self.emit(f"    {a}, {_LT_TYPE[lp.a_dtype]}, {to_c(g.a.rows)}, {b}, "
                  f"{_LT_TYPE[lp.b_dtype]}, {to_c(g.b.cols)},")
        self.emit(f"    buf_{g.name}, {_LT_TYPE[g.dtype]}, {ptr(lp.scale_a, 4)}, "
                  f"{ptr(lp.scale_b, 4)}, {'buf_' + lp.bias if lp.bias else '0'}, {bias_t}, "
                  f"self->workspace, kc::kWorkspaceBytes, &self->lt_plan[{self.lt_index(g.name)}]"
                  ")) return 1;")

    def _cutlass(self, g, epi=None) -> None:
        """The CUTLASS kernel linked for this GEMM (kiln/gemm/cutlass_link.py); with `epi`,
        the kernel fusing it as a visitor tree, which writes the epilogue's buffer."""
        sz = g.dtype.itemsize
        lda = g.a.rows if layout(g.a.rows, g.a.cols) == "n" else g.a.cols
        ldb = g.b.rows if layout(g.b.rows, g.b.cols) == "n" else g.b.cols
        nb = to_c(g.batch[0]) if g.batch else "1"
        sa = to_c(g.a.batch_strides[0]) if g.batch else "0"
        sb = to_c(g.b.batch_strides[0]) if g.batch else "0"
        m, n, k = to_c(g.m), to_c(g.n), to_c(g.k)
        kern = self.cutlass[g.name].config.name
        evt = _evt_of(g, epi)
        key = evt.key if evt is not None else ""
        out = epi.name if epi is not None else g.name
        self.emit(f"// gemm {g.name} = {g.a.buf} @ {g.b.buf}: CUTLASS {kern}  <- "
                  f"{', '.join(g.source)}")
        if evt is not None:
            self.emit(f"//   epilogue {epi.name} fused ({key})  <- {', '.join(epi.source)}")
        self.emit(f"if ({m} > 0 && {n} > 0 && {nb} > 0) {{")
        self.emit(f"  if ({workspace_entry(kern, key)}({m}, {n}, {k}, {nb}) > "
                  "self->cutlass_ws_bytes)")
        self.emit(f"    return e.fail(\"{g.name}: the CUTLASS kernel needs more workspace at these "
                  "sizes than was reserved for the Dim ranges' maxima\");")
        c_arg, ext_arg = "nullptr", ""
        if evt is not None:
            def ptr(o) -> str:
                return f"(const void*)(buf_{o.buf} + {DTYPES[o.dtype].itemsize} * {to_c(o.offset)})"
            if evt.src is not None:
                c_arg = ptr(evt.src)
            self.emit(f"  const void* ext_{g.name}[] = {{{', '.join(ptr(o) for o in evt.ext)}"
                      f"{'' if evt.ext else 'nullptr'}}};  // "
                      + ("; ".join(f"{o.role} {o.buf}" for o in evt.ext) or "none"))
            ext_arg = f"ext_{g.name}, "
        self.emit(f"  const int rc = {entry(kern, key)}({m}, {n}, {k}, {nb}, "
                  f"(const void*)(buf_{g.a.buf} + {sz} * {to_c(g.a.offset)}), {to_c(lda)}, {sa},")
        self.emit(f"      (const void*)(buf_{g.b.buf} + {sz} * {to_c(g.b.offset)}), {to_c(ldb)}, "
                  f"{sb}, {c_arg}, (void*)buf_{out}, {ext_arg}(void*)self->cutlass_ws, stream);")
        self.emit(f"  if (rc) return e.fail(\"{g.name}: CUTLASS kernel failed (%d: 1 cannot run "
                  "these sizes, 2 initialisation, 3 launch)\", rc);")
        self.emit("}")

    def _CopyState(self, x: P.CopyState) -> None:  # the instance owns its device weights
        self.emit(f"// state {x.dst} <- {x.src}: persists to the next run")
        self.emit(f"if (kc::check(e, kc::driver().cuMemcpyDtoDAsync(buf_{x.dst}, buf_{x.src}, "
                  f"static_cast<size_t>({to_c(x.numel)}) * {x.dtype.itemsize}, stream), "
                  f"{_cstr('state ' + x.dst)})) return 1;")

    def _Return(self, x: P.Return) -> None:
        if self.status_ops:
            self.emit("if (kc::check(e, kc::driver().cuMemcpyDtoHAsync("
                      "const_cast<int32_t*>(self->status_host), self->status, 4, stream), "
                      "\"reading the index status\") ||")
            wait = "true" if self.sync_checks else "wait_"
            self.emit(f"    kc::index_status(e, self->status, self->status_host, stream, {wait}, "
                      f"{_cstr(self.status_ops)})) goto fail;")
        for out in (y for y in self.p.lines if isinstance(y, P.AllocOutput) and y.capacity):
            for d, size in enumerate(out.shape):  # data-dependent dims: known now
                if size != out.capacity[d]:
                    self.emit(f"outs[{out.index}]->dl_tensor.shape[{d}] = {to_c(size)};")
        self.emit(f"for (int64_t i = 0; i < {len(x.buffers)}; ++i) outputs[i] = outs[i];")
        self.emit("return 0;")


def late_output(x: P.AllocOutput) -> bool:
    """Whether an output is sized by a data-dependent size without an upper bound: allocated
    during the run, once its shape is known (not before the run, at its bounds)."""
    return bool(data_dependent_symbols(sympy.Mul(*(x.capacity or x.shape))))


def not_capturable(prog: P.Program) -> str | None:
    """Why a run cannot replay as one CUDA graph (None when it can): a branch or loop reads
    its predicate on the host (a stream sync), an ATen call runs torch's allocator and
    dispatcher, and a data-dependent size (`.item()` read on the host, or bound by an ATen
    call) changes the launches after it within the run, and without an upper bound also the
    buffers it sizes (allocated mid-run)."""
    if any(isinstance(x, (P.If, P.While)) for x in P.walk(prog.lines)):
        return "torch.cond / while_loop: the predicate is read on the host"
    if any(isinstance(x, P.CallAten) for x in P.walk(prog.lines)):
        return "ATen fallback calls: torch's dispatcher and allocator run inside the run"
    if prog.unbacked or any(isinstance(x, P.ReadSizeLine) for x in P.walk(prog.lines)):
        names = ", ".join(n for n, _ in prog.unbacked)
        heap = " (some without an upper bound: their buffers are allocated mid-run)" if any(
            unbounded(n, b) for n, b in prog.unbacked) else ""
        return f"data-dependent sizes {names} are read on the host mid-run{heap}"
    return None


def capturable(prog: P.Program) -> bool:
    """Whether a run can replay as one CUDA graph (see `not_capturable`)."""
    return not_capturable(prog) is None


def _plan_block(pr: _Printer, prog: P.Program) -> None:
    reserve = "if (self->arena.reserve(e, {bytes} > 256 ? {bytes} : 256)) return 1;"
    if prog.arena_bytes is not None:
        pr.emit(reserve.format(bytes=max(prog.arena_bytes, 256)))
        return
    for indent, line in runtime_plan_lines(prog, max(prog.alignment, 16), reserve):
        pr.emit(line, indent)


def _evt_of(g, epi):
    """The visitor tree of a fused CUTLASS call (None for a plain one)."""
    if epi is None:
        return None
    evt = from_epilogue(g, epi)
    assert isinstance(evt, Evt), evt  # gemm/fuse.py fused it because it maps
    return evt


def _cutlass_parts(prog: P.Program, cutlass: dict) -> tuple[list[str], list[str]]:
    """Declarations of the linked CUTLASS entries, and the instance's workspace allocation
    (the largest any of them needs at the maxima of the Dim ranges)."""
    decls, init = [], []
    hi = {s.name: s.max for s in prog.symbols}
    for name, bound in prog.unbacked:  # data-dependent sizes at their bounds (a nominal
        # size where there is none: the run checks the workspace it needs)
        hi[name] = UNBOUNDED_NOMINAL if unbounded(name, bound) else evaluate(bound, hi)
    calls = {x.gemm.name: x for x in P.walk(prog.lines) if isinstance(x, P.CallGemm)}
    gemms = {n: x.gemm for n, x in calls.items()}
    keys = {n: (lambda e: e.key if e is not None else "")(_evt_of(x.gemm, x.epilogue))
            for n, x in calls.items() if n in cutlass}
    kernels = sorted({(cutlass[n].config.name, keys[n]) for n in keys})
    for kern, key in kernels:
        decls.append(f'extern "C" size_t {workspace_entry(kern, key)}(int64_t, int64_t, int64_t, '
                     "int64_t);")
        decls.append(f'extern "C" int {entry(kern, key)}(int64_t, int64_t, int64_t, int64_t, '
                     "const void*, int64_t, int64_t, const void*, int64_t, int64_t, const void*, "
                     f"void*, {'const void* const*, ' if key else ''}void*, CUstream);")
    for name in sorted(keys):
        g = gemms[name]
        sizes = [min(evaluate(e, hi), 2**31 - 1) for e in (g.m, g.n, g.k)] + \
            [min(evaluate(g.batch[0], hi), 2**31 - 1) if g.batch else 1]  # CUTLASS's int
        ws = workspace_entry(cutlass[name].config.name, keys[name])
        init.append(f"  {{ const size_t w = {ws}"
                    f"({', '.join(map(str, sizes))});  // {name} at the ranges' maxima")
        init.append("    if (w > self->cutlass_ws_bytes) self->cutlass_ws_bytes = w; }")
    if init:
        init += ["  if (self->cutlass_ws_bytes && kc::check(e, d.cuMemAlloc(&self->cutlass_ws, "
                 "self->cutlass_ws_bytes), \"allocating the CUTLASS workspace\")) return 1;"]
    return decls, init


def print_cuda_wrapper(prog: P.Program, kernels: dict, cubins: dict, archs: tuple[int, ...],
                       blob_path: str, where: dict, graphs: bool = True,
                       cutlass: dict | None = None, blaslt: dict | None = None,
                       sync_checks: bool = False) -> str:
    """`kernels`: name -> TritonKernel with `source_ops` set (see pipeline); `where`: the
    (offset, size) of each (kernel, arch) cubin inside the blob at `blob_path`; `graphs`: run
    through CUDA graphs (kc::run_graph) rather than launching every kernel each run;
    `cutlass`: GEMM name -> its CUTLASS Choice; `blaslt`: GEMM name -> the cuBLASLt heuristic
    index of its "blas" Choice (`blaslt_choices`); other GEMMs call cuBLAS (kc::gemm).

    The run: input checks and size binding, the arena plan, the outputs allocated, then
    `body` (a lambda: every kernel, GEMM and state copy, on the stream and input/output
    pointers it is given, so that it can be captured into a graph), then the index status
    (`kc::index_status`: read at the start of the next run unless `sync_checks`)."""
    graphs = graphs and capturable(prog)
    scratch = frozenset(n for (n, _), c in cubins.items() if getattr(c, "scratch", 0))
    pr = _Printer(prog, kernels, cutlass, blaslt, scratch)
    pr.sync_checks = sync_checks
    if pr.status_ops:  # an earlier run's index status (see kc::index_status)
        pr.emit("if (kc::index_status(e, self->status, self->status_host, stream, false, "
                f"{_cstr(pr.status_ops)})) return 1;")
    checks = [x for x in prog.lines if isinstance(x, P.CHECKS)]
    n_in = len(prog.inputs)
    outs = [x for x in prog.lines if isinstance(x, P.AllocOutput)]
    if prog.unbacked or any(isinstance(x, (P.ReadSizeLine, P.If, P.While))
                            for x in P.walk(prog.lines)):  # host reads mid-run
        pr.emit(f"if (kc::refuse_capture(e, stream, {_cstr(not_capturable(prog))})) return 1;")
    pr.emit(f"CUdeviceptr in_ptr[{max(n_in, 1)}] = {{}};")
    pr.emit(f"size_t in_bytes[{max(n_in, 1)}] = {{}};")
    for x in checks:
        pr.line(x)
    _plan_block(pr, prog)
    pr.emit("{")
    pr.emit(f"CUdeviceptr out_ptr[{max(len(outs), 1)}] = {{}};")
    pr.emit(f"size_t out_bytes[{max(len(outs), 1)}] = {{}};")
    for name, bound in prog.unbacked:  # bound mid-run (by `body`), read by `Return`
        pr.emit(f"int64_t {name} = 0;  // data-dependent size, " + (
            "no upper bound" if unbounded(name, bound) else f"at most {bound}"))
    if pr.heap_bufs:
        pr.emit("kc::DeviceHeap heap(self->pool, stream);  // buffers sized by unbounded "
                "data-dependent sizes")
    for x in outs:
        if not late_output(x):
            pr.alloc_output(x)
    pr.emit("auto body = [&](CUstream stream, const CUdeviceptr* in, const CUdeviceptr* out) "
            "-> int {")
    body_start = len(pr.out)
    pr.emit("(void)in; (void)out;")
    pr.emit("if (kc::blas_bind(e, self->blas, stream, self->workspace, kc::kWorkspaceBytes)) "
            "return 1;")
    for x in prog.lines:
        if isinstance(x, P.CheckInput) and not x.host:
            pr.emit(f"CUdeviceptr buf_{x.name} = in[{x.index}];  // input {x.index}")
    ret = None
    for x in prog.lines:
        if isinstance(x, P.Return):
            ret = x
        elif x not in checks:
            pr.line(x)
    pr.emit("return 0;")
    # inside the lambda a failure returns (the caller jumps to `fail`)
    pr.out[body_start:] = ["  " + ln.replace("goto fail;", "return 1;") if ln else ln
                           for ln in pr.out[body_start:]]
    pr.emit("};")
    if graphs:
        key = ", ".join(s.name for s in prog.symbols) or "0"
        pr.emit(f"const int64_t graph_key[] = {{{key}}};")
        launches = sum(isinstance(x, (P.CallKernel, P.CallGemm, P.CallLib, P.CallUser,
                                      P.CopyState))
                       for x in prog.lines)
        pr.emit(f"if (kc::run_graph(e, self->graphs, graph_key, {max(len(prog.symbols), 1)}, "
                f"self->arena.epoch, {launches}, {n_in}, in_ptr, in_bytes, {len(outs)}, "
                "out_ptr, out_bytes, stream, body)) goto fail;")
    else:
        pr.emit("if (body(stream, in_ptr, out_ptr)) goto fail;")
    if ret is not None:
        pr.line(ret)
    pr.emit("}")
    gemms = any(isinstance(x, P.CallGemm) and x.gemm.name not in (cutlass or {})
                for x in P.walk(prog.lines))
    decls, init = _cutlass_parts(prog, cutlass or {})
    return print_cuda_model(prog, kernels, cubins, archs, blob_path, where, pr.out,
                            len(pr.dynamic_bufs), gemms, len(pr.lt_gemms), decls, init,
                            len(pr.blaslt_gemms))


def blaslt_choices(gemms: dict) -> dict[str, int]:
    """GEMM name -> cuBLASLt heuristic index, for the "blas" choices that name one
    (`BlasLtConfig`, profiled by max_autotune; `BlasConfig` choices call cuBLAS)."""
    return {n: c.config.algo for n, c in (gemms or {}).items()
            if isinstance(c.config, BlasLtConfig)}
