"""Runs a CUDA build's Program IR from Python, launching its Triton kernels through Triton
(debugging; the artifact is model_cuda.cpp). On a machine without a GPU the kernels run in
Triton's interpreter (numpy; TRITON_INTERPRET=1), so generated Triton is checked against eager
on CPU in CI.

Input: the planned Program, the `TritonKernel`s by name, the Triton module text, the weights
(name -> tensor) and the flat user inputs. Output: the flat outputs. Invariants: buffers are
fresh tensors (no arena: this checks kernels, not the plan), GEMMs run as torch.matmul on
strided views of the same operands cuBLAS would see (a CUTLASS GEMM with a fused epilogue
then applies the visitor tree's torch twin), ATen fallback calls run through torch.ops on
strided views of the buffers, a kernel's status flag raises an IndexError naming its graph
nodes. Data-dependent sizes are bound as in the C++ wrapper (an ATen result's dim, or
`.item()` read on the host and range-checked, a ValueError naming the symbol otherwise);
outputs with such dims are allocated at their bounds and cut to the real shape at the end.
Control flow (torch.cond / while_loop) is not run here (UnsupportedError)."""

from __future__ import annotations

import contextvars
import importlib.util
import math
import re
import tempfile
from pathlib import Path

import torch

from kiln.gemm.printed import strided_operand
from kiln.ir import loop as L
from kiln.ir import program as P
from kiln.ir.sym import evaluate, unbounded
from kiln.gemm.cutlass_evt import evaluate_torch, from_epilogue
from kiln.ir.interp import call_aten
from kiln.errors import UnsupportedError
from kiln.targets.cuda.put import STATUS_COUNTER_BASE, STATUS_COUNTERS, put_kernel_names
from kiln.targets.cuda.bag_mask import BAG_MASK_ROUTINES
from kiln.targets.cuda.put_reduce import is_reducing_put, put_reduce_kernel_names
from kiln.targets.cuda.scan import (NONZERO_ROUTINE, SCAN_ROUTINES, cput_kernel_name,
                                    is_complex_product, scan_kernel_names)
from kiln.targets.cuda.sort import SORT_ROUTINES, sort_kernel_names
from kiln.ir import dtypes
import numpy as np

_ROW_ROUTINES = (*SCAN_ROUTINES, NONZERO_ROUTINE, *SORT_ROUTINES)  # scan.py, sort.py


def import_triton_module(text: str):
    """Imports the generated module. Triton decides at import time whether kernels run in its
    interpreter: without a GPU, start the process with TRITON_INTERPRET=1 (tests do so in a
    subprocess, since the AOT compiler needs the normal mode)."""
    # deferred: Triton is optional (GPU builds only)
    import triton
    if triton.knobs.runtime.interpret:  # the interpreter's scalars are arrays: loop on ints
        text = re.sub(r"range\(0, (.*), RBLOCK\):", r"range(0, _kl_int(\1), RBLOCK):", text)
        text = re.sub(r"range\(0, ((?:(?!RBLOCK|BLOCK_K).)*)\):", r"range(0, _kl_int(\1)):", text)
        text = re.sub(r"range\((\w+), (\w+), RBLOCK\):",
                      r"range(_kl_int(\1), _kl_int(\2), RBLOCK):", text)
        # the GEMM template's persistent tile loop and its loop over K
        text = text.replace("range(tl.program_id(0), tiles, NUM_SMS)",
                            "range(_kl_int(tl.program_id(0)), _kl_int(tiles), _kl_int(NUM_SMS))")
        text = text.replace("range(0, K, BLOCK_K)", "range(0, _kl_int(K), BLOCK_K)")
        text += ("\n\ndef _kl_int(t):\n    h = getattr(t, 'handle', None)\n"
                 "    return int(h.data.reshape(-1)[0]) if h is not None else int(t)\n")
    d = Path(tempfile.mkdtemp(prefix="kiln_triton_"))
    path = d / "kiln_triton_kernels.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"kiln_triton_{d.name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if triton.knobs.runtime.interpret:
        mod.libdevice = _InterpreterLibdevice()
    return mod


class _InterpreterLibdevice:
    """numpy stand-ins for the libdevice functions kernels call (Triton's interpreter has
    none); each takes and returns interpreter tensors of one dtype."""

    _NP = {"tanh": "tanh", "tan": "tan", "atan": "arctan", "asin": "arcsin", "acos": "arccos",
           "sinh": "sinh", "cosh": "cosh", "asinh": "arcsinh", "acosh": "arccosh",
           "atanh": "arctanh", "nearbyint": "rint", "trunc": "trunc", "log1p": "log1p",
           "expm1": "expm1", "pow": "power", "fmod": "fmod", "atan2": "arctan2",
           "copysign": "copysign"}

    def __getattr__(self, name):
        # deferred: Triton is optional (GPU builds only)
        import triton.language as tl
        # deferred: Triton is optional (GPU builds only)
        from triton.runtime.interpreter import TensorHandle
        f = getattr(np, self._NP[name]) if name in self._NP else None
        if f is None:
            if name != "erfc":
                raise AttributeError(name)
            f = np.vectorize(math.erfc)

        def call(*xs):
            x0 = xs[0]
            shape = np.broadcast_shapes(*[x.handle.data.shape for x in xs])
            data = f(*[x.handle.data for x in xs]).astype(x0.handle.data.dtype)
            data = np.broadcast_to(data, shape).copy()
            ty = tl.block_type(x0.dtype, list(shape)) if shape else x0.dtype
            return tl.core.tensor(TensorHandle(data, x0.dtype.scalar), ty)
        return call


def _fused_epilogue(x: P.CallGemm, acc: torch.Tensor, bufs, env) -> torch.Tensor:
    """The fused epilogue of a CUTLASS call, by the visitor tree's torch twin
    (kiln/gemm/cutlass_evt.py: evaluate_torch) on the float32 product `acc`."""
    evt = from_epilogue(x.gemm, x.epilogue)
    m, n = acc.shape[-2], acc.shape[-1]
    size = {"src": acc.numel(), "col": n, "row": m, "scalar": 1}
    ops = [bufs[o.buf].reshape(-1)[evaluate(o.offset, env):][:size[o.role]]
           for o in evt.operands]
    return evaluate_torch(evt.to_json(), acc.reshape(-1, m, n), ops, m, n)


def _sm_count(device: str) -> int:
    if str(device).startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return 4  # Triton's interpreter: a few programs, so the persistent loop runs


def _with_scratch_allocator(launch, device) -> None:
    # deferred: Triton is optional (GPU builds only)
    import triton
    triton.set_allocator(lambda size, align, stream: torch.empty(
        size, dtype=torch.int8, device=device))
    launch()


_FNUZ = (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


_PARTS = {torch.complex32: torch.int16, torch.complex64: torch.int32,
          torch.complex128: torch.int64}


def _bytes_if_fnuz(t: torch.Tensor) -> torch.Tensor:
    """fnuz float8 buffers go to kernels as bytes (their Triton types are AMD's; kiln's
    kernels convert them: targets/cuda/ops.py); complex ones as their parts' bits."""
    if t.dtype in _PARTS:
        return t.view(_PARTS[t.dtype])
    return t.view(torch.uint8) if t.dtype in _FNUZ else t


def launch_kernel(module, k, env, bufs, status, device) -> None:
    """Launch TritonKernel `k`: over its rows, or (the GEMM template) persistently over
    min(tiles, #SMs) programs; nothing for an empty grid."""
    rows = evaluate(k.tiles if k.tiles is not None else k.rows, env)
    if rows <= 0:  # (a multi-block scan of empty rows: rows x (0 - 1) chunks to fix)
        return
    sms = _sm_count(device) if k.tiles is not None else 0
    args = []
    for kind, n in k.params:
        args.append(env[n] if kind == "size" else status if kind == "status"
                    else sms if kind == "sms" else _bytes_if_fnuz(bufs[n].reshape(-1)))
    if k.tiles is not None:
        def launch():
            getattr(module, k.name)[(min(rows, sms),)](
                *args, **dict(k.constexprs), num_warps=k.config.num_warps,
                **({"num_stages": k.num_stages} if k.num_stages else {}))
        # the template's TMA configs make descriptors in global scratch, which Triton's
        # launcher takes from the allocator set in the current context: set one in a copy
        # of the context, so nothing outlives the launch
        contextvars.copy_context().run(_with_scratch_allocator, launch, device)
        return
    grid = (-(-rows // k.config.xblock),)
    extra = {"num_stages": k.config.num_stages} if k.config.num_stages else {}
    getattr(module, k.name)[grid](*args, XBLOCK=k.config.xblock, RBLOCK=k.config.rblock,
                                  num_warps=k.config.num_warps, **extra)


def _run_user(u, x: P.CallUser, bufs: dict, env: dict) -> None:
    """A user Triton kernel (`toolchain.user_triton.UserLaunch`) through Triton's launcher:
    the copies of overwritten inputs, then the kernel with the chosen config."""
    for out, init, n in zip(x.call.outs, x.call.inits, x.numels):
        if init is not None:
            k = evaluate(n, env)
            bufs[out].reshape(-1)[:k].copy_(bufs[init].reshape(-1)[:k])
    grid = tuple(evaluate(g, env) for g in u.grid)
    if min(grid) <= 0:
        return
    kw = {}
    for p, v in x.call.args:
        match v:
            case L.UserBuf(buf=buf):
                kw[p] = bufs[buf].reshape(-1)
            case L.UserInt(value=e):
                kw[p] = evaluate(e, env)
            case L.UserNone():
                kw[p] = None
            case L.UserConfigured():
                kw[p] = u.constexprs[p]
            case L.UserFloat(value=c) | L.UserBool(value=c) | L.UserConstexpr(value=c):
                kw[p] = c
            case _:
                raise TypeError(v)
    u.call.spec.fn[grid](**kw, num_warps=u.num_warps, num_stages=u.num_stages)


def _run_aten(c, bufs: dict, env: dict, bounds: dict, allocs=(), device="cpu") -> None:
    """An ATen fallback call (`loop.AtenCall`, run by ir/interp.py's `call_aten` on strided
    views of the buffers): every result it writes copied into its buffer, its data-dependent
    sizes bound and checked against their bounds; `allocs` (P.CallAten.allocs): the buffers
    sized by sizes it binds with no upper bound, allocated once they are bound."""

    def tensor(a: L.AtenTensor):
        t = bufs[a.buf]
        return torch.as_strided(t, [evaluate(d, env) for d in a.shape],
                                [evaluate(d, env) for d in a.strides],
                                t.storage_offset() + evaluate(a.offset, env))
    results = list(call_aten(c, tensor, env))
    for r, got in results:
        for d, sym, _ in r.binds:
            env[sym] = int(got.shape[d])
            hi = evaluate(bounds[sym], env)
            if not 0 <= env[sym] <= hi:
                raise ValueError(f"ATen fallback {c.op}: data-dependent size {sym} = {env[sym]} "
                                 f"exceeds its bound {bounds[sym]} = {hi}")
    for a in allocs:
        _alloc(a, bufs, env, device)
    for r, got in results:
        shape = [evaluate(d, env) for d in r.shape]
        n = math.prod(shape)
        bufs[r.name].reshape(-1)[:n].view(shape).copy_(got)


def _alloc(x, bufs: dict, env: dict, device) -> None:
    """An output (data-dependent dims at their bounds) or a temporary, as a fresh tensor."""
    if isinstance(x, P.AllocOutput):
        shape = [evaluate(d, env) for d in (x.capacity or x.shape)]
        bufs[x.buf] = torch.empty(shape, dtype=x.dtype.torch, device=device)
    else:
        n = evaluate(x.numel, env)
        bufs[x.buf] = torch.empty(max(n, 1), dtype=x.dtype.torch, device=device)


def _read_size(n, bufs: dict, env: dict) -> None:
    """`x.item()` as a size (`loop.ReadSize`): read, range-checked, stored as int64."""
    v = int(bufs[n.src].reshape(-1)[0])
    hi = v if unbounded(n.symbol, n.hi) else evaluate(n.hi, env)
    if not n.lo <= v <= hi:
        raise ValueError(f"{n.src}.item() is {v}, outside [{n.lo}, {n.hi}], the range the "
                         f"export assumed for size {n.symbol}")
    env[n.symbol] = v
    bufs[n.name].reshape(-1)[0] = v


def run_program(prog: P.Program, kernels: dict, module, weights: dict, inputs: list,
                device: str = "cpu") -> list[torch.Tensor]:
    env: dict[str, int] = {}
    bufs: dict[str, torch.Tensor] = {w: t.reshape(-1).to(device).clone()
                                     for w, t in weights.items()}
    # word 0: the index status; then the kernels' arrival counters (put.py STATUS_COUNTERS)
    status = torch.zeros(STATUS_COUNTER_BASE + STATUS_COUNTERS, dtype=torch.int32,
                         device=device)[:1]
    for x in prog.lines:
        if isinstance(x, P.CheckInput) and x.host:  # an int input: only its value is used
            continue
        if isinstance(x, P.CheckInput):
            bufs[x.name] = inputs[x.index].contiguous().reshape(-1)
        elif isinstance(x, P.BindSize) and x.dim is None:
            env[x.symbol] = int(inputs[x.input])
        elif isinstance(x, P.BindSize):
            env[x.symbol] = (int(inputs[x.input].shape[x.dim]) - x.offset) // x.scale
        elif isinstance(x, P.Alloc) and x.state is not None:  # updated in place
            bufs[x.buf] = bufs[x.state]
        elif isinstance(x, (P.AllocOutput, P.Alloc)):
            _alloc(x, bufs, env, device)
        elif isinstance(x, P.Free):
            bufs.pop(x.buf, None)
        elif isinstance(x, P.CallKernel):
            launch_kernel(module, kernels[x.kernel], env, bufs, status, device)
            if int(status.item()):
                raise IndexError(x.index_error)
        elif isinstance(x, P.CallLib) and x.call.routine == "attention":
            launch_kernel(module, kernels[f"attn_{x.call.name}"], env, bufs, status, device)
            if f"attn_{x.call.name}_combine" in kernels:  # the decode path's key splits merged
                launch_kernel(module, kernels[f"attn_{x.call.name}_combine"], env, bufs, status,
                              device)
        elif isinstance(x, P.CallLib) and x.call.routine == "conv2d_nhwc":
            launch_kernel(module, kernels[f"conv_{x.call.name}"], env, bufs, status, device)
        elif isinstance(x, P.CallLib) and x.call.routine in BAG_MASK_ROUTINES:  # (bag_mask.py)
            launch_kernel(module, kernels[f"{x.call.routine}_{x.call.name}"], env, bufs, status,
                          device)
            if int(status.item()):
                why = (": the mask selects more elements than source has"
                       if x.call.routine == "masked_scatter" else "")
                raise IndexError(f"index out of range in {', '.join(x.call.source)}{why}")
        elif isinstance(x, P.CallLib) and x.call.routine in _ROW_ROUTINES:
            names = sort_kernel_names if x.call.routine in SORT_ROUTINES else scan_kernel_names
            for k in names(x.call, kernels):
                launch_kernel(module, kernels[k], env, bufs, status, device)
            if int(status.item()):
                raise IndexError(f"nonzero: the count did not match in {', '.join(x.call.source)}")
        elif isinstance(x, P.CallLib) and is_complex_product(
                x.call, dtypes.from_torch(bufs[x.call.name].dtype)):
            launch_kernel(module, kernels[cput_kernel_name(x.call)], env, bufs, status, device)
            if int(status.item()):
                raise IndexError(f"index out of range in {', '.join(x.call.source)}")
        elif isinstance(x, P.CallLib) and is_reducing_put(
                x.call, dtypes.from_torch(bufs[x.call.name].dtype)):  # (put_reduce.py)
            copy, *rest = put_reduce_kernel_names(x.call)
            if bufs[x.call.name] is not bufs[x.call.args[0].buf]:
                launch_kernel(module, kernels[copy], env, bufs, status, device)
            for k in rest:
                launch_kernel(module, kernels[k], env, bufs, status, device)
            if int(status.item()):
                raise IndexError(f"index out of range in {', '.join(x.call.source)}")
        elif isinstance(x, P.CallLib) and x.call.routine == "put":
            copy, scatter = put_kernel_names(x.call)
            if bufs[x.call.name] is not bufs[x.call.args[0].buf]:
                launch_kernel(module, kernels[copy], env, bufs, status, device)
            if x.call.attr("copy_only"):  # its scatter is in a fused launch
                continue
            launch_kernel(module, kernels[scatter], env, bufs, status, device)
            if int(status.item()):
                raise IndexError(f"index out of range in {', '.join(x.call.source)}")
        elif isinstance(x, P.CallUser):
            _run_user(kernels[x.call.name], x, bufs, env)
        elif isinstance(x, P.CallAten):
            _run_aten(x.call, bufs, env, dict(prog.unbacked), x.allocs, device)
        elif isinstance(x, P.ReadSizeLine):
            _read_size(x.node, bufs, env)
        elif isinstance(x, (P.If, P.While)):
            raise UnsupportedError("the Triton runner does not run torch.cond / while_loop "
                                   f"({', '.join(x.source)}); the C++ wrapper does")
        elif isinstance(x, P.CallLib):
            raise UnsupportedError(f"library routine {x.call.routine} (for "
                                   f"{', '.join(x.call.source)}) has no CUDA version yet")
        elif isinstance(x, P.CallGemm):
            g = x.gemm
            a = strided_operand(bufs[g.a.buf].reshape(-1), g.a, g.batch, g.m, g.k, env)
            b = strided_operand(bufs[g.b.buf].reshape(-1), g.b, g.batch, g.k, g.n, env)
            if x.epilogue is not None:  # a CUTLASS kernel with a fused visitor tree
                out = bufs[x.epilogue.name].reshape(-1)
                res = _fused_epilogue(x, torch.matmul(a.float(), b.float()), bufs, env)
            else:
                out = bufs[g.name].reshape(-1)
                res = torch.matmul(a, b)
            out[:a.shape[:-1].numel() * b.shape[-1]].copy_(res.reshape(-1))
        elif isinstance(x, P.CopyState):
            bufs[x.dst].reshape(-1).copy_(bufs[x.src].reshape(-1)[:bufs[x.dst].numel()])
        elif isinstance(x, P.Return):
            cut = {y.buf: [evaluate(d, env) for d in y.shape] for y in prog.lines
                   if isinstance(y, P.AllocOutput) and y.capacity}
            return [bufs[b].reshape(-1)[:math.prod(cut[b])].view(cut[b]) if b in cut
                    else bufs[b] for b in x.buffers]
    raise ValueError("program has no Return")
