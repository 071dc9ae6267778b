"""Triton GEMM candidates profiled as packages run them: each config's kernel is the one the
CUDA target prints for the package (kiln/targets/cuda/gemm_template.py), with the GEMM's
absorbed epilogue (bias, activation, residual, casts, any pointwise member `fuse.py` would
absorb), batch dims and int8 operands, launched as the target's Python printer launches it.
The target prints them (kiln/targets/cuda/gemm_candidates.py: `build`, handed to
`select.choose_gemms` as `printer`); this module holds the record and the child's side.

Parent side (the target's `build`): the GEMM, its epilogue member, the Loop IR buffers the
kernels touch and the example sizes become a `Printed` record, pickled next to the CUTLASS
builds and read by the profiling child (`python -m kiln.gemm.gpu_child`). It holds one
Triton module with a kernel per config (`gemm_<name>__<i>`) and, when there is an epilogue,
the epilogue alone as a row kernel (`epilogue_<name>`): what runs when another backend
computes the GEMM.

Child side (`Bench`): random operands in every buffer (floats N(0, 1); int8 GEMM operands
over their whole range and a dequantisation scale U(0, 1/64), so 16-bit results stay finite;
other integer buffers zero, so indices read through data stay in range), the reference (the
product of float32 copies of the operands, rounded to the GEMM's dtype into its result buffer,
then the epilogue kernel) and, per candidate, a launch and a check against that reference.
The epilogue kernel's own time is what an unfused candidate (cuBLAS, a plain CUTLASS kernel)
adds to a run, so the parent adds it to their times: every candidate is compared on the same
work, GEMM plus epilogue."""

from __future__ import annotations

import hashlib
import pickle
import re
from dataclasses import dataclass
from pathlib import Path

from typing import Any

import torch

from kiln.ir import loop as L
from kiln.ir.sym import evaluate
import sympy

EPILOGUE = "__epilogue__"  # the profiling line naming the epilogue kernel's own time


@dataclass(frozen=True)
class Printed:
    gemm: L.Gemm
    epilogue: L.Compute | None
    buffers: dict[str, L.Buffer]  # every buffer the kernels read or write
    env: dict[str, int]  # the size symbols at the example sizes
    module: str  # the Triton source of all kernels below
    kernels: dict[str, Any]  # candidate name -> its kernel (the target's printed kernel)
    epilogue_kernel: Any | None
    #: the target's launcher (kiln/targets/cuda/gemm_candidates.py): `load(module)` imports
    #: the module, `launch(module, kernel, env, buffers, status, device)` runs one kernel.
    #: Pickled by reference, so the profiling child imports the target that printed them.
    launcher: Any


def epilogue_key(epi: L.Compute) -> str:
    """A key of the epilogue's computation, independent of the program's buffer names (the
    autotuning cache's problem key: a choice profiled with this epilogue)."""
    text = repr(epi.body)
    names: dict[str, str] = {}
    for m in re.finditer(r"buf='([^']*)'", text):
        names.setdefault(m.group(1), f"b{len(names)}")
    text = re.sub(r"buf='([^']*)'", lambda m: f"buf='{names[m.group(1)]}'", text)
    return "pw:" + hashlib.sha256(f"{epi.dtype.name}|{epi.shape}|{text}".encode()
                                  ).hexdigest()[:16]


def gemm_buffers(g: L.Gemm, env: dict[str, int]) -> dict[str, L.Buffer]:
    """Buffers just large enough for the GEMM's strided operands and its result, for a GEMM
    profiled without its program's buffers (no epilogue then)."""
    mx = g.mixed
    ops = [(g.a, g.m, g.k, mx is not None and mx.side == "a"),
           (g.b, g.k, g.n, mx is not None and mx.side == "b")]
    if mx is not None and mx.scale is not None:
        ops.append((mx.scale, g.m, g.n, False))
    out = {g.name: L.Buffer(g.name, g.dtype, tuple(g.shape), "temp")}
    for op, rows, cols, quant in ops:
        last = sum((evaluate(d, env) - 1) * evaluate(s, env) for d, s in
                   zip((*g.batch, rows, cols), (*op.batch_strides, op.rows, op.cols)))
        n = evaluate(op.offset, env) + last + 1
        dt = mx.qdtype if quant else g.dtype
        if op.buf not in out or evaluate(out[op.buf].numel, env) < n:
            out[op.buf] = L.Buffer(op.buf, dt, (sympy.Integer(n),), "input")
    return out


def strided_operand(buf: torch.Tensor, op: L.Operand, batch, rows, cols, env) -> torch.Tensor:
    """The GEMM operand `op` (batch dims, rows x cols) as a strided view of its flat buffer."""
    ev = lambda e: evaluate(e, env)  # noqa: E731
    sizes = [ev(b) for b in batch] + [ev(rows), ev(cols)]
    strides = [ev(s) for s in op.batch_strides] + [ev(op.rows), ev(op.cols)]
    return torch.as_strided(buf, sizes, strides, ev(op.offset))


def write(p: Printed, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(p))
    return path


def read(path: str | Path) -> Printed:
    return pickle.loads(Path(path).read_bytes())


class Bench:
    """The child's state for one `Printed`: buffers, reference and launchers."""

    def __init__(self, p: Printed, device: str = "cuda", seed: int = 0) -> None:
        self.p, self.device = p, device
        self.module = p.launcher.load(p.module)
        g, env = p.gemm, p.env
        gen = torch.Generator(device=device).manual_seed(seed)
        mx = g.mixed
        quant = {getattr(g, mx.side).buf: mx.qdtype.name} if mx is not None else {}
        scale = mx.scale.buf if mx is not None and mx.scale is not None else None
        self.bufs: dict[str, torch.Tensor] = {}
        for name, b in p.buffers.items():
            n, dt = max(evaluate(b.numel, env), 1), getattr(torch, b.dtype.name)
            if name in quant:
                info = torch.iinfo(dt)
                t = torch.randint(info.min, info.max + 1, (n,), generator=gen, device=device,
                                  dtype=dt)
            elif name == scale:
                t = (torch.rand(n, generator=gen, device=device) / 64).to(dt)
            elif dt.is_floating_point:
                t = torch.randn(n, generator=gen, device=device).to(dt)
            elif dt == torch.bool:
                t = torch.randint(0, 2, (n,), generator=gen, device=device).bool()
            else:
                t = torch.zeros(n, device=device, dtype=dt)
            self.bufs[name] = t
        self.status = torch.zeros(1, dtype=torch.int32, device=device)
        a = strided_operand(self.bufs[g.a.buf], g.a, g.batch, g.m, g.k, env).float()
        b = strided_operand(self.bufs[g.b.buf], g.b, g.batch, g.k, g.n, env).float()
        want = torch.matmul(a, b)
        if scale is not None:
            want = want * strided_operand(self.bufs[scale], mx.scale, g.batch, g.m, g.n,
                                          env).float()
        self.k = evaluate(g.k, env)
        out = self.bufs[g.name]
        out[:want.numel()].copy_(want.reshape(-1))
        if p.epilogue_kernel is not None:
            self.epilogue()
            self.out = self.bufs[p.epilogue.name]
            self.ref = self.out[:evaluate(p.buffers[p.epilogue.name].numel, env)
                                ].float().clone()
        else:
            self.out = out
            self.ref = want.reshape(-1).clone()

    def _launch(self, k) -> None:
        self.p.launcher.launch(self.module, k, self.p.env, self.bufs, self.status, self.device)

    def epilogue(self) -> None:
        """The epilogue alone, as its own kernel (what an unfused GEMM is followed by)."""
        self._launch(self.p.epilogue_kernel)

    def runner(self, name: str):
        k = self.p.kernels[name]
        return lambda: self._launch(k)

    def tolerance(self) -> float:
        """The largest error allowed: that of a 16-bit (float32: IEEE) product of depth K,
        grown with the magnitude of the result."""
        fin = self.ref[torch.isfinite(self.ref)]
        big = float(fin.abs().max()) if fin.numel() else 1.0
        base = 1e-4 if self.p.gemm.dtype.name == "float32" else 2e-2
        return base * max(1.0, self.k ** 0.5) * max(1.0, big ** 0.5)

    def error(self) -> float:
        """The largest difference between the candidate's output and the reference; where
        the reference is not finite the output must be the same value."""
        got = self.out[:self.ref.numel()].float()
        fin = torch.isfinite(self.ref)
        same = (got == self.ref) | (torch.isnan(got) & torch.isnan(self.ref))
        if bool((~fin & ~same).any()):
            return float("inf")
        err = (got - self.ref).abs()[fin]
        return float(err.max()) if err.numel() else 0.0

    def check(self, name: str) -> float:
        """Runs candidate `name` once on a cleared output; its error."""
        self.out.zero_()
        self.runner(name)()
        if self.device != "cpu":
                torch.cuda.synchronize()
        if int(self.status.item()):
            raise IndexError(f"{name}: index out of range")
        return self.error()
