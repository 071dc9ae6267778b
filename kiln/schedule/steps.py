"""Steps the GEMM backends add to a schedule: a GEMM computed by a generated kernel together
with the pointwise member it absorbs as its epilogue, and (a GEMV, M = 1) the row-wise producer
of its A row it recomputes as its prologue (`kiln/gemm/fuse.py`, `kiln/gemm/prologue.py` build
them)."""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from kiln.ir import loop as L
from kiln.ir.sym import free_size_symbols
from kiln.schedule import Kernel
from kiln.schedule.analysis import kernel_params


@dataclass(frozen=True)
class Prologue:
    """The producer of a GEMV's A row [1, K], recomputed by every program of the GEMV instead
    of stored: `row`, a pointwise Compute of K elements (row-major = A's k), and
    `reductions`, the whole-row reductions (one element each) `row` reads, computed first in
    registers. Every other buffer they read exists before the GEMV (gemm/prologue.py)."""

    row: L.Compute
    reductions: tuple[L.Compute, ...] = ()

    def loads(self) -> list[L.Load]:
        own = {r.name for r in self.reductions}
        return [ld for m in (*self.reductions, self.row) for ld in L.loads(m.body)
                if ld.buf not in own]

    @property
    def source(self) -> tuple[str, ...]:
        out: list[str] = []
        for m in (*self.reductions, self.row):
            out += [s for s in m.source if s not in out]
        return tuple(out)


@dataclass(frozen=True)
class GemmKernel:
    """A GEMM computed by the Triton template; `epilogue` (a pointwise Compute over the GEMM's
    shape reading the GEMM's result at its own element) is applied to each tile before the
    store; `config`: the template config (a kiln.gemm.configs.TritonConfig)."""

    gemm: L.Gemm
    epilogue: L.Compute | None
    config: object
    #: (a GEMV config) the A row's producer, recomputed in the kernel; A is then not read
    prologue: Prologue | None = None

    @property
    def name(self) -> str:
        return f"gemm_{self.gemm.name}"

    @property
    def kind(self) -> str:
        """The manifest's kind: "triton_gemv" for the M = 1 template, else "triton_gemm"."""
        return "triton_gemv" if getattr(self.config, "gemv", False) else "triton_gemm"

    @property
    def out(self) -> str:
        return self.epilogue.name if self.epilogue is not None else self.gemm.name

    @property
    def status(self) -> bool:
        """The epilogue indexes through data: the kernel reports an index out of range."""
        return (self.epilogue is not None and any(ld.indirect
                                                  for ld in L.loads(self.epilogue.body))) or \
            (self.prologue is not None and any(ld.indirect for ld in self.prologue.loads()))

    @property
    def source(self) -> tuple[str, ...]:
        src = list(self.prologue.source) if self.prologue is not None else []
        src += [s for s in self.gemm.source if s not in src]
        if self.epilogue is not None:
            src += [s for s in self.epilogue.source if s not in src]
        return tuple(src)

    def reads(self) -> list[str]:
        if self.prologue is not None:  # A recomputed from what its producer reads
            out = [self.gemm.b.buf]
            for ld in self.prologue.loads():
                if ld.buf not in out:
                    out.append(ld.buf)
        else:
            out = [self.gemm.a.buf] + ([self.gemm.b.buf] if self.gemm.b.buf != self.gemm.a.buf
                                       else [])
        out += [b for b in self.gemm.extra_reads() if b not in out]  # a mixed GEMM's scale
        if self.epilogue is not None:
            for ld in L.loads(self.epilogue.body):
                if ld.buf != self.gemm.name and ld.buf not in out:
                    out.append(ld.buf)
        return out

    def params(self) -> list[tuple[str, str]]:
        """(kind, name): the buffer written, the buffers read, the size symbols."""
        g = self.gemm
        exprs = [g.m, g.n, g.k, *g.batch, g.a.offset, g.a.rows, g.a.cols, *g.a.batch_strides,
                 g.b.offset, g.b.rows, g.b.cols, *g.b.batch_strides]
        if g.mixed is not None and g.mixed.scale is not None:
            sc = g.mixed.scale
            exprs += [sc.offset, sc.rows, sc.cols, *sc.batch_strides]
        if self.epilogue is not None:
            exprs += [ld.index for ld in L.loads(self.epilogue.body)] + list(self.epilogue.shape)
        if self.prologue is not None:
            exprs += [ld.index for ld in self.prologue.loads()] + list(self.prologue.row.shape)
        syms: set = set()
        for e in exprs:
            syms |= free_size_symbols(sympy.sympify(e))
        return [("out", self.out)] + [("in", b) for b in self.reads()] + \
            [("size", s.name) for s in sorted(syms, key=lambda s: s.name)]


@dataclass(frozen=True)
class CutlassGemm:
    """A GEMM computed by a CUTLASS kernel with `epilogue` fused as an epilogue visitor tree
    (kiln/gemm/cutlass_evt.py; the same absorption rule as the Triton template's);
    `config`: the autotuning choice's config (a kiln.gemm.configs.CutlassConfig: the kernel's
    name and the tree's key)."""

    gemm: L.Gemm
    epilogue: L.Compute
    config: object

    @property
    def name(self) -> str:
        return self.gemm.name

    @property
    def out(self) -> str:
        return self.epilogue.name

    @property
    def source(self) -> tuple[str, ...]:
        return self.gemm.source + tuple(s for s in self.epilogue.source
                                        if s not in self.gemm.source)

    def reads(self) -> list[str]:
        out = [self.gemm.a.buf] + ([self.gemm.b.buf] if self.gemm.b.buf != self.gemm.a.buf
                                   else [])
        for ld in L.loads(self.epilogue.body):
            if ld.buf != self.gemm.name and ld.buf not in out:
                out.append(ld.buf)
        return out


@dataclass(frozen=True)
class PutKernel:
    """`put` calls (index_put without accumulation, mode set: a KV cache's update) launched as
    one program after `kernel` (a schedule Kernel whose outer is one row, or None): the
    program runs the kernel's members, then each put's scatter in order
    (kiln/schedule/puts.py builds it, targets/cuda/put.py prints it). A put whose output is
    not its state's own storage is copied (out = self) by its copy kernel, launched before.

    With `attention` (a decode step's attention call right after them, which reads the puts'
    outputs as its keys and values: targets/cuda/attention_decode.py `fuse_decode_puts`), the
    launch is that attention kernel instead: it computes the kernel's members where it reads
    them (the rotary queries, the mask, the new key row: none is stored), writes the new key
    and value rows into the caches itself and uses them in place of the rows it reads there;
    `config` is its launch (attention_decode.py `FusedLaunch`: with `separate_combine`, the key
    splits' combine kernel is launched after it)."""

    kernel: Kernel | None
    puts: tuple[L.Extern, ...]
    attention: L.Extern | None = None
    config: object = None

    @property
    def name(self) -> str:
        if self.attention is not None:
            return f"attn_{self.attention.name}"
        return f"puts_{self.puts[-1].name}"

    @property
    def launches(self) -> tuple[str, ...]:
        """The kernels launched, in order (the puts' copy kernels aside)."""
        if self.attention is not None and getattr(self.config, "separate_combine", False):
            return (self.name, f"{self.name}_combine")
        return (self.name,)

    @property
    def source(self) -> tuple[str, ...]:
        out = list(self.kernel.source) if self.kernel is not None else []
        for p in (*self.puts, *((self.attention,) if self.attention is not None else ())):
            out += [s for s in p.source if s not in out]
        return tuple(out)

    @property
    def members(self) -> tuple[str, ...]:
        """The buffers it computes: the kernel's members' (none stored with `attention`), then
        the puts' outputs (then the attention's)."""
        if self.attention is not None:
            return tuple(p.name for p in self.puts) + tuple(self.attention.outs)
        own = tuple(m.name for m in self.kernel.members) if self.kernel is not None else ()
        return own + tuple(p.name for p in self.puts)

    def _computed(self) -> set[str]:
        """What it computes, stored or not."""
        own = {m.name for m in self.kernel.members} if self.kernel is not None else set()
        return own | set(self.members)

    def reads(self) -> list[str]:
        """Buffers read: the kernel's inputs, then each put's self, values and indices (self
        by its copy kernel), then the attention's operands."""
        own = self._computed()
        out: list[str] = []
        if self.kernel is not None:
            out += [ld.buf for m in self.kernel.members for ld in L.loads(m.body)
                    if ld.buf not in own]
        out += [a.buf for p in self.puts for a in p.args if a.buf not in own]
        if self.attention is not None:
            out += [a.buf for a in self.attention.args if a.buf not in own]
        return list(dict.fromkeys(out))

    def writes(self) -> list[str]:
        if self.attention is not None:
            return list(self.members)
        private = (self.kernel.locals | self.kernel.row_locals) if self.kernel else frozenset()
        return [b for b in self.members if b not in private]

    def params(self, buffers) -> list[tuple[str, str]]:
        """(kind, name): the buffers written, the buffers read (a put's self only by its
        copy: not a parameter), the size symbols (the printer adds the status flag: the scatters
        check their indices)."""
        kp = kernel_params(self.kernel, buffers) if self.kernel is not None else []
        outs = [n for k, n in kp if k == "out"] + [p.name for p in self.puts]
        ins = [n for k, n in kp if k == "in"]
        syms = {n for k, n in kp if k == "size"}
        if self.attention is not None:  # nothing of the kernel's is stored
            own = self._computed()
            outs = list(self.members)
            ins = [n for n in ins if n not in own]
            for a in self.attention.args:
                if a.buf not in own and a.buf not in ins:
                    ins.append(a.buf)
                for e in (a.offset, *a.shape, *a.strides):
                    syms |= {s.name for s in free_size_symbols(sympy.sympify(e))}
        skip = self._computed() if self.attention is not None else set()
        for p in self.puts:
            for a in p.args[1:]:
                if a.buf not in outs and a.buf not in ins and a.buf not in skip:
                    ins.append(a.buf)
            for a in p.args:
                for e in (a.offset, *a.shape, *a.strides):
                    syms |= {s.name for s in free_size_symbols(sympy.sympify(e))}
            for e in buffers[p.name].shape:
                syms |= {s.name for s in free_size_symbols(sympy.sympify(e))}
        return [("out", b) for b in outs] + [("in", b) for b in ins] + \
            [("size", s) for s in sorted(syms)]
