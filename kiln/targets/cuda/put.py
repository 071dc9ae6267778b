"""`put` Extern steps (index_put without accumulate, lowering/library.py `_put`: a KV cache's
`index_copy_`) -> Triton kernels for CUDA builds, so that the update runs in place on the
state (memory/inplace.py `state_updates`) inside the run's CUDA graph, never as an ATen call
(which copies the whole cache twice and keeps the run out of a graph).

Input: the Extern (operands self, values, index tensors, as strided `LibArg`s; attributes
mode (only "set", 0), dims (per dim of self: k >= 0 the k-th iteration dim, -(j+1) index
tensor j), wrap), the Loop IR buffers. Output: two `TritonKernel`s:
- `put_copy_<out>`: out = self, element by element (self strided, out contiguous); the wrapper
  launches it only when out is not self's own storage (an in-place state update skips it);
- `put_<out>`: for every element i of the iteration space (values' shape, row-major), the
  destination out[..., index_j[i], ..., i_k, ...] (negative indices count from the end with
  wrap) takes values[i]. An index outside its dim stores nothing and sets the run's index
  status (`kiln_status`), which the wrapper turns into an "index out of range" error, as the
  CPU routine raises. Duplicate destinations keep one of the values (torch leaves which one
  unspecified on CUDA too).

Sizes and strides are printed as expressions of the size symbols (kernel parameters); one
program stores XBLOCK elements."""

from __future__ import annotations

import sympy

from kiln.ir import loop as L
from kiln.ir.sym import contiguous_strides, product
from kiln.targets.cuda.kernel import Config, TritonKernel, print_triton_kernel
from kiln.targets.cuda.ops import SIG_PTR, canon, pow2, size_names, to_tl, unravel

XBLOCK = 256
NUM_WARPS = 4

#: the run's index status buffer (`kiln_status`, int32 words; the wrapper allocates and zeroes
#: it at load) holds the status in word 0 and, from word STATUS_COUNTER_BASE, this many
#: arrival counters that kernels reset themselves (the decode attention's last split merges
#: the others' partial states: targets/cuda/attention_decode.py `FusedLaunch`)
STATUS_COUNTER_BASE = 4
STATUS_COUNTERS = 4096


def put_kernel_names(call: L.Extern) -> tuple[str, str]:
    """(the copy kernel, the scatter kernel) of `call`."""
    return f"put_copy_{call.name}", f"put_{call.name}"


def _offset(arg: L.LibArg, coords: list[str], i: str = "i") -> str:
    parts = [] if canon(arg.offset) == 0 else [to_tl(canon(arg.offset))]
    for c, st in zip(coords, arg.strides):
        st = canon(st)
        if st != 0 and c != "0":
            parts.append(c if st == 1 else f"{c} * {to_tl(st)}")
    if not any(c != "0" and canon(st) != 0 for c, st in zip(coords, arg.strides)):
        parts.append(f"{i} * 0")  # one element for every lane: still a block of pointers
    return " + ".join(parts)


def _kernel(name: str, call: L.Extern, buffers, bufs: list[str], exprs, status: bool,
            body: list[str], rows) -> TritonKernel:
    syms = size_names(exprs)
    params = (("out", call.name), *(("in", b) for b in bufs[1:]), *(("size", s) for s in syms))
    if status:
        params += (("status", "kiln_status"),)
    sig = {f"buf_{b}": SIG_PTR[buffers[b].dtype] for b in bufs}
    sig.update({s: "i64" for s in syms})
    if status:
        sig["kiln_status"] = "*i32"
    sig["XBLOCK"] = sig["RBLOCK"] = "constexpr"
    head = [
        "@triton.jit",
        f"def {name}({', '.join(a for a in sig if a not in ('XBLOCK', 'RBLOCK'))}, "
        "XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):",
        f"    # {name}: {call.name} = index_put(self, values, indices) (routine put)",
        f"    #   from graph nodes: {', '.join(call.source)}",
        "    pid = tl.program_id(1).to(tl.int64) * tl.num_programs(0) + tl.program_id(0)",
        "    i = pid * XBLOCK + tl.arange(0, XBLOCK)",
        f"    ok = i < {to_tl(canon(rows))}",
    ]
    src = "\n".join(head + body) + "\n"
    return TritonKernel(name, src, params, sig, Config(XBLOCK, 1, NUM_WARPS), canon(rows),
                        call.source)


def destination(call: L.Extern, buffers, p: str = "", indent: str = "    "
                ) -> tuple[list[str], str, list[str], list, sympy.Expr]:
    """(the lines loading `{p}v` = values[i] and computing `{p}bad` (an index outside its dim),
    the destination's offset in out (contiguous), the buffers they name (out first), the size
    expressions they print, the element count) of one `put` call, for the flat index `{p}i`
    (masked by `{p}ok`, both defined by the caller)."""
    self_, values, *index = call.args
    out = buffers[call.name]
    dims = tuple(call.attr("dims"))
    wrap = bool(call.attr("wrap"))
    iters = values.shape
    m = product(iters)
    bufs = [call.name]
    for a in (values, *index):
        if a.buf not in bufs:
            bufs.append(a.buf)
    i, ok, bad = f"{p}i", f"{p}ok", f"{p}bad"
    it = unravel(i, iters)
    body = [f"{p}v = tl.load(buf_{values.buf} + {_offset(values, it, i)}, mask={ok})",
            f"{bad} = {i} < 0  # an index outside its dim"]
    dest = []
    ostrides = contiguous_strides(out.shape)
    exprs = [m, *out.shape, values.offset, *iters, *values.strides]
    for d, k in enumerate(dims):
        size = canon(out.shape[d])
        if k >= 0:
            c = it[k]
        else:
            a = index[-k - 1]
            exprs += [a.offset, *a.strides]
            c = f"{p}c{d}"
            body.append(f"{c} = tl.load(buf_{a.buf} + {_offset(a, it, i)}, mask={ok}, "
                        "other=0).to(tl.int64)")
            if wrap:
                body.append(f"{c} = tl.where({c} < 0, {c} + {to_tl(size)}, {c})")
            body.append(f"{bad} = {bad} | ({c} < 0) | ({c} >= {to_tl(size)})")
        st = canon(ostrides[d])
        if c != "0" and size != 1 or k < 0:
            dest.append(c if st == 1 else f"{c} * {to_tl(st)}")
    return [indent + x for x in body], " + ".join(dest) or "0", bufs, exprs, m


def scatter_lines(call: L.Extern, buffers, p: str = "", indent: str = "    "
                  ) -> tuple[list[str], list[str], list, sympy.Expr]:
    """(the scatter's lines, the buffers it names (out first), the size expressions it
    prints, its element count) of one `put` call: out[dest(i)] = values[i] for the flat
    index `{p}i` (masked by `{p}ok`, both defined by the caller); variables prefixed `p`."""
    body, dest, bufs, exprs, m = destination(call, buffers, p, indent)
    ok, bad = f"{p}ok", f"{p}bad"
    body += [
        f"{indent}tl.store(buf_{call.name} + {dest}, {p}v, mask={ok} & ~{bad})",
        f"{indent}tl.store(kiln_status + {p}i.to(tl.int32) * 0, 1, mask={ok} & {bad})",
    ]
    return body, bufs, exprs, m


def print_put_copy(call: L.Extern, buffers) -> TritonKernel:
    """`put_copy_<out>`: out = self (self strided, out contiguous of self's shape)."""
    self_ = call.args[0]
    n = product(self_.shape)
    cbufs = [call.name] + ([self_.buf] if self_.buf != call.name else [])
    coords = unravel("i", self_.shape)
    return _kernel(put_kernel_names(call)[0], call, buffers, cbufs,
                   [n, self_.offset, *self_.shape, *self_.strides], False, [
        f"    x = tl.load(buf_{self_.buf} + {_offset(self_, coords)}, mask=ok)",
        f"    tl.store(buf_{call.name} + i, x, mask=ok)",
    ], n)


def print_put_kernels(call: L.Extern, buffers) -> tuple[TritonKernel, TritonKernel]:
    """The copy and scatter kernels of one `put` call (mode "set")."""
    if call.attr("mode") != 0 or not call.attr("include_self", True):
        raise ValueError(f"put {call.name}: the CUDA kernel only sets (mode 0), got "
                         f"mode {call.attr('mode')}")
    copy = print_put_copy(call, buffers)

    # out[dest(i)] = values[i] over the iteration space
    body, bufs, exprs, m = scatter_lines(call, buffers)
    scatter = _kernel(put_kernel_names(call)[1], call, buffers, bufs, exprs, True, body, m)
    return copy, scatter


def print_fused_puts(step, buffers, hints, config: Config | None = None) -> TritonKernel:
    """One program for a `PutKernel` (schedule/puts.py): its kernel's members (printed by
    the row-kernel printer), a barrier, then each put's scatter over its (static, small)
    iteration space in one block. Not in place, a put's copy kernel runs before."""
    params = list(step.params(buffers)) + [("status", "kiln_status")]
    tail: list[str] = []
    for j, call in enumerate(step.puts):
        if call.attr("mode") != 0 or not call.attr("include_self", True):
            raise ValueError(f"put {call.name}: the CUDA kernel only sets (mode 0)")
        p = f"p{j}_"
        m = int(canon(product(call.args[1].shape)))
        tail += [f"    # {call.name} = index_put({', '.join(a.buf for a in call.args)})  <- "
                 f"{', '.join(call.source)}",
                 f"    {p}i = tl.arange(0, {pow2(max(m, 16))})",
                 f"    {p}ok = {p}i < {m}"]
        tail += scatter_lines(call, buffers, p)[0]
    if step.kernel is not None:
        return print_triton_kernel(step.kernel, buffers, hints, config, name=step.name,
                                   params=params, tail=tuple(tail), source=step.source)
    sig = {}
    for kind, n in params:
        sig[n if kind in ("size", "status") else f"buf_{n}"] = \
            "i64" if kind == "size" else "*i32" if kind == "status" else SIG_PTR[buffers[n].dtype]
    sig["XBLOCK"] = sig["RBLOCK"] = "constexpr"
    head = ["@triton.jit",
            f"def {step.name}({', '.join(a for a in sig if a not in ('XBLOCK', 'RBLOCK'))}, "
            "XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):",
            f"    # {step.name}: {', '.join(step.members)}",
            f"    #   from graph nodes: {', '.join(step.source)}"]
    src = "\n".join(head + tail) + "\n"
    return TritonKernel(step.name, src, tuple(params), sig, Config(1, 1, NUM_WARPS), 1,
                        step.source)
