"""Checks one fuzz program: export, compile with kiln, load the package through the C ABI, run
on fresh inputs (and, for dynamic programs, at other sizes in the Dim's range), and compare with
torch eager and with the Loop IR interpreter (`kiln.ir.interp.run_loop`).

Outcome statuses: "ok"; "invalid" (torch.export refused the program: not kiln's business);
"error" (kiln raised UnsupportedError: counted, not a failure); "mismatch" (wrong values,
dtype or shape against eager or the interpreter); "crash" (any other exception from kiln,
including its interpreter). Float32 outputs are compared with a float64 eager reference,
float64 outputs with float64 eager, ints and bools exactly.

A spec with "device": "cuda" (`kiln fuzz --device cuda`) is compiled for CUDA, loaded on
cuda:0 and run on inputs copied there in the same layout; eager and the float64 reference
run on the CPU; the Loop IR interpreter is not run (the CPU run of a program checks it). A
spec with "export_layout" (one of `LAYOUTS`) is exported with inputs in that layout, so kiln
specialises to the strides the export records; it runs first on inputs in that layout, then
contiguous ones, then another layout."""

from __future__ import annotations

import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import sympy
import torch

import kiln
from kiln.errors import UnsupportedError
from kiln.fuzz.program import (B_EXAMPLE, B_MAX, B_MIN, LAYOUTS, FuzzModule, dynamic_shapes,
                               make_inputs, to_ref64, uses_float32)
from kiln.ir.interp import run_loop

FAILURES = ("mismatch", "crash")
OPTIONS = kiln.Options(plan_budget_s=0.02, jobs=1)
# CUDA: the first launch config of each kernel (timing candidates costs more than the check),
# no CUDA graph (each program runs three times)
CUDA_OPTIONS = kiln.Options(plan_budget_s=0.02, jobs=1, autotune=False, cuda_graphs=False)


@dataclass
class Outcome:
    status: str
    detail: str = ""

    @property
    def failed(self) -> bool:
        return self.status in FAILURES

    def signature(self) -> str:
        """Status plus the first line of the detail: what a minimised program must keep."""
        return f"{self.status}:{self.detail.splitlines()[0] if self.detail else ''}"


SENSITIVITY = 4  # see `compare`


def nudged(args: tuple, seed: int) -> tuple:
    """`args` with every float element moved by a random relative 2**-16 (the reference's
    sensitivity to rounding: a float32 sum of n values is off by up to n * 2**-24 relative,
    so two summation orders of 256 values may differ by that much)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(a * (1 + (torch.rand(a.shape, generator=g, dtype=torch.float64) * 2 - 1)
                      .to(a.dtype) * 2.0**-16) if isinstance(a, torch.Tensor) and
                 a.is_floating_point() else a for a in args)


def _tol(dtype: torch.dtype, f32: bool, ref: torch.Tensor) -> tuple[float, float]:
    scale = float(ref.double().abs().max()) if ref.numel() else 1.0
    if dtype == torch.float64 and not f32:
        return 1e-9, 1e-9 * max(1.0, scale)
    return 2e-4, 2e-4 * max(1.0, scale)


def compare(got, want, ref, f32: bool, what: str, sens=None) -> str | None:
    """None when `got` matches; else a one-line description and the worst element. `sens`
    (per float output, see `nudged`): how far float64 eager moves when the float inputs move
    by 2**-16; an element is also accepted within SENSITIVITY times that (an ill-conditioned
    output: cos of a sum of 500 float32 values near 2500 moves by 1e-3 with the summation
    order alone, eager's own float32 result as much)."""
    for k, (g, w, r) in enumerate(zip(got, want, ref)):
        g = torch.as_tensor(g)
        where = f"{what}: output {k}"
        if g.dtype != w.dtype:
            return f"{where}: dtype {g.dtype} != {w.dtype}"
        if tuple(g.shape) != tuple(w.shape):
            return f"{where}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        if r.numel() != w.numel():
            return f"{where}: the reference has {r.numel()} elements, eager {w.numel()}"
        # the reference in eager's shape (the Loop IR keeps a 0-dim output as [1]; torch 2.11's
        # isclose cannot broadcast [] against [1])
        r = torch.as_tensor(r).reshape(w.shape)
        if w.is_complex():  # as pairs of reals, with the tolerance of their type
            rtol, atol = _tol(torch.float64 if w.dtype == torch.complex128 else torch.float32,
                              f32, torch.view_as_real(r.resolve_conj()))
            gd = torch.view_as_real(g.resolve_conj()).double()
            rd = torch.view_as_real(r.resolve_conj()).double()
            bad = ~torch.isclose(gd, rd, rtol=rtol, atol=atol, equal_nan=True)
        elif w.is_floating_point():
            rtol, atol = _tol(w.dtype, f32, r)
            gd, rd = g.double(), r.double()
            bad = ~torch.isclose(gd, rd, rtol=rtol, atol=atol, equal_nan=True)
            if sens is not None and bool(bad.any()):
                moved = torch.as_tensor(sens[k]).double().reshape(w.shape)
                bad &= ~((gd - rd).abs() <= SENSITIVITY * moved)
        else:
            gd, rd = g, r
            bad = g != r
        if bool(bad.any()):
            idx = tuple(bad.nonzero()[0].tolist())
            return (f"{where} ({w.dtype}): {int(bad.sum())} of {bad.numel()} elements differ, "
                    f"e.g. at {list(idx)} got {gd[idx].item()!r} want {rd[idx].item()!r}")
    return None


def _interp(compiled, args: tuple) -> list[np.ndarray]:

    built = compiled.built
    feeds = {i.name: a.numpy() for i, a in zip(built.graph.user_inputs, args)}
    feeds.update({k: v.detach().numpy() for k, v in built.weights.items()})
    env = {}
    for inp, a in zip(built.graph.user_inputs, args):
        for d, e in zip(a.shape, inp.type.shape):
            if getattr(e, "is_Symbol", False):
                # sympy Integers, not ints: interp.py's index() returns a bare int for an index
                # that is exactly a size symbol (reported; tests/fuzz_regressions/
                # test_interp_size_symbol_index.py)
                env[e.name] = sympy.Integer(int(d))
    return run_loop(built.loop, feeds, env)


def relaid(args: tuple, layout: str = "transposed") -> tuple:
    """The same values with other strides. "transposed": rank >= 2 transposed in memory (the
    last two dims), rank 1 every other element of a buffer twice as long; "step": every other
    element along dim 0 of a buffer twice as long; "offset": a view 3 elements into a larger
    buffer (a storage offset; 16-byte aligned or not); "channels_last": rank 4 in NHWC memory
    order, others transposed."""
    out = []
    for a in args:
        if a.dim() == 0:
            pass
        elif layout == "channels_last" and a.dim() == 4:
            a = a.contiguous(memory_format=torch.channels_last)
        elif layout in ("transposed", "channels_last") and a.dim() >= 2:
            a = a.transpose(-1, -2).contiguous().transpose(-1, -2)
        elif layout == "offset":
            big = torch.zeros(a.numel() + 3, dtype=a.dtype)
            big[3:] = a.reshape(-1)
            a = big[3:].view(a.shape)
        else:  # "step", and rank 1 when transposed
            big = torch.zeros((2 * a.shape[0],) + tuple(a.shape[1:]), dtype=a.dtype)
            big[::2] = a
            a = big[::2]
        out.append(a)
    return tuple(out)


def to_device(a, device: str):
    """`a` on `device` with the same sizes, strides and storage offset (a step-2 slice stays
    one: its whole storage is copied)."""
    if not isinstance(a, torch.Tensor) or device == "cpu":
        return a
    st = a.untyped_storage()
    base = torch.empty(0, dtype=a.dtype).set_(st, 0, (st.nbytes() // a.element_size(),), (1,))
    return base.to(device).as_strided(a.shape, a.stride(), a.storage_offset())


def _storage(t) -> int | None:
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) and t.numel() else None


def shared_storage(got, want, inputs, what: str, got_inputs=None) -> str | None:
    """None unless kiln returns outputs sharing storage (with each other or an input) where
    eager's do not: a write through one would change the other (eager may share where kiln
    keeps copies: kiln/frontend/aliasing.py lists those cases). `got_inputs`: the inputs kiln
    was given, when not `inputs` (copies on the GPU)."""
    gs = [_storage(g) for g in got] + [_storage(x) for x in (got_inputs or inputs)]
    ws = [_storage(w) for w in want] + [_storage(x) for x in inputs]
    for i in range(len(got)):
        for j in range(i + 1, len(gs)):
            if gs[i] is not None and gs[i] == gs[j] and ws[i] != ws[j]:
                return f"{what}: output {i} shares storage with " + (
                    f"output {j}" if j < len(got) else f"input {j - len(got)}") + \
                    ", eager's does not"
    return None


def lost_alias(got, want, inputs, what: str, got_inputs=None,
               exported_compact: bool = True) -> str | None:
    """None unless eager returns an output sharing storage with another output or with an
    input and kiln's does not, in the cases kiln keeps (kiln/frontend/aliasing.py): one of the
    two owns the storage (an input, or an output that is no view and that eager lays out
    compactly: kiln's views assume a compact base), and the inputs are compact, as they were
    at export (kiln copies others in, so views of them are copies; and in another layout than
    the export's, the graph cannot tell `v` from eager's `v.contiguous()`, a copy there)."""
    if not exported_compact or \
            not all(x.is_contiguous() for x in inputs if isinstance(x, torch.Tensor)):
        return None
    gs = [_storage(g) for g in got] + [_storage(x) for x in (got_inputs or inputs)]
    ws = [_storage(w) for w in want] + [_storage(x) for x in inputs]
    owns = [isinstance(w, torch.Tensor) and w._base is None and w.is_contiguous()
            for w in want] + [True] * len(inputs)
    for i in range(len(got)):
        for j in range(i + 1, len(gs)):
            if ws[i] is not None and ws[i] == ws[j] and gs[i] != gs[j] and (owns[i] or owns[j]):
                return f"{what}: output {i} shares storage with " + (
                    f"output {j}" if j < len(got) else f"input {j - len(got)}") + \
                    " in eager, kiln's does not"
    return None


def run_sizes(spec: dict) -> list[int]:
    if not spec.get("dynamic"):
        return [B_EXAMPLE, B_EXAMPLE, B_EXAMPLE]
    return [B_MIN, B_MAX, (spec["seed"] % (B_MAX - B_MIN + 1)) + B_MIN]


def check(spec: dict, workdir: str | Path | None = None, interp: bool = True,
          run: bool = True) -> Outcome:
    """Run the whole differential check of one program spec (`run=False`: export, compile
    and save only, e.g. a CUDA package on a machine without a GPU)."""
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="kiln-fuzz-") as d:
            return check(spec, d, interp, run)
    module, ref = FuzzModule(spec), FuzzModule(spec, ref64=True)
    device = spec.get("device", "cpu")
    layout = spec.get("export_layout")
    args = make_inputs(spec, spec["seed"])
    if layout:
        args = relaid(args, layout)
    exported_compact = all(a.is_contiguous() for a in args if isinstance(a, torch.Tensor))
    try:
        with torch.no_grad():
            ep = torch.export.export(module, args, dynamic_shapes=dynamic_shapes(spec))
    except Exception as e:  # torch refuses: the program is not a valid test case
        return Outcome("invalid", f"torch.export: {type(e).__name__}: {str(e)[:200]}")
    stage = "compile"
    try:
        compiled = kiln.compile(ep, device=device,
                                options=CUDA_OPTIONS if device != "cpu" else OPTIONS)
        stage = "load"
        path = Path(workdir) / f"fuzz_{spec['seed'] & 0xFFFFFFFF}.kiln"
        if not run:
            compiled.save(path)
            return Outcome("ok")
        runner = kiln.load(compiled.save(path), device="cuda:0" if device != "cpu" else "cpu")
        f32 = uses_float32(spec)
        for k, b in enumerate(run_sizes(spec)):
            stage = f"run (B={b})"
            fresh = make_inputs(spec, spec["seed"] * 7919 + k + 1, b)
            if layout and k != 1:  # the export's layout first, then contiguous, then another
                fresh = relaid(fresh, layout if k == 0 else
                               LAYOUTS[(LAYOUTS.index(layout) + 1) % len(LAYOUTS)])
            elif k >= 1 and not layout:  # the same values in other layouts: kiln copies them in
                fresh = relaid(fresh, "transposed" if k == 1 else
                               LAYOUTS[spec["seed"] % len(LAYOUTS)])
            with torch.no_grad():
                want = module(*fresh)
                want64 = ref(*to_ref64(fresh))
                sens = [(a - b).abs() if a.is_floating_point() else None
                        for a, b in zip(want64, ref(*nudged(to_ref64(fresh), k)))]
            given = tuple(to_device(a, device) for a in fresh)
            out = runner(*given)
            got = [g.cpu() if isinstance(g, torch.Tensor) else g for g in out]
            where = f"eager, B={b}" + (f", {device}" if device != "cpu" else "")
            bad = compare(got, want, [r if w.is_floating_point() else w
                                      for w, r in zip(want, want64)], f32, where, sens) \
                or shared_storage(out, want, fresh, where, given) \
                or lost_alias(out, want, fresh, where, given, exported_compact)
            if bad:
                return Outcome("mismatch", bad)
            if interp and device == "cpu":  # (the CPU run of a program checks kiln's IR)
                stage = f"interpreter (B={b})"
                ref_i = [torch.from_numpy(np.ascontiguousarray(x)) for x in _interp(compiled,
                                                                                   fresh)]
                bad = compare(got, want, ref_i, f32, f"interpreter, B={b}", sens)
                if bad:
                    return Outcome("mismatch", bad)
        runner.close()
    except UnsupportedError as e:
        return Outcome("error", f"{stage}: {e}")
    except Exception as e:
        tb = traceback.format_exc(limit=-3)
        return Outcome("crash", f"{stage}: {type(e).__name__}: {str(e)[:300]}\n{tb}")
    return Outcome("ok")
