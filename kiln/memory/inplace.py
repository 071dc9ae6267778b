"""In-place reuse: which kernel outputs may take over the storage of a dying input.

Input: one `Kernel` (kiln/schedule) and the Loop IR buffers; for `choose_reuse`, the whole
schedule with each buffer's first-writer and last-reader step. Output: pairs (out, src) meaning
"`out` may live in `src`'s bytes" (`kernel_candidates`: legal as far as this kernel can tell;
`choose_reuse`: out -> src for the pairs the program uses). Pure functions, no IR is changed.

Legality of (out, src) in a kernel K with outer loop nest of k dims (o = the outer index):
  (1) both are temps (never a graph input, weight or output), of equal dtype and symbolically
      equal element count, so one allocation fits both for every size; `src` is read by K, not
      written by it; `out` is stored by its member M (not a register local).
  (2) every load of `src` inside M is direct (no indirect index) and reads element E(i), where
      E(i) is the flat index M stores `out` at (i-vars of size-1 dims are 0; c*FloorDiv(a, c) +
      ModIdx(a, c) counts as a, see `canon`). A pointwise M evaluates its whole body (all
      loads) before the single store of that iteration; a
      reduction M reads x[E(i)] in every r-iteration and stores once, after the r loop. Either
      way element E(i) of `src` is read only before `out[E(i)]` overwrites it, and no other
      element of `src` is touched by M.
  (3) no member after M reads `src` (they would see `out`'s values).
  (4) every load of `src` by a member before M is direct and stays inside the outer slice of
      the same outer index: index = o_flat * inner + rest with inner = prod(M.shape[k:]) and
      rest affine in the member's other loop variables with non-negative coefficients and
      0 <= rest <= inner - 1 (checked at the variables' extremes). Outer iterations may run on
      different threads, but each only writes `out` inside its own slice (M's shape starts with
      the outer dims), and within one outer iteration members run in order, so those reads
      happen before M overwrites that slice, and no thread reads another thread's slice.
  (5) program level (`choose_reuse`): K is the last reader of `src` (so no view, GEMM operand or
      later kernel reads it: views are index maps, every read of a buffer is a load or a GEMM
      operand in some step) and K is the first writer of `out`. Each src is taken at most once;
      chains (a -> b -> c) share one storage, each link dying where the next is born.
Under (1)-(5) the two pointers alias only as described, so codegen drops `__restrict__` on
exactly those two parameters and keeps it everywhere else.

State updates in place (`state_updates`: a KV cache's `index_copy_` / `index_put_`): a
program that mutates state S computes S's new value into a temp O, which is copied into S after
the last step (Program IR CopyState): a copy of the whole state per run, on top of the one the
scatter makes (out = self, then the updates). O may be S's own storage, with neither copy, when
  (a) O is the new value of S (the mutation (S, O)), a temp of S's dtype and element count;
  (b) O's one writer, step i, is the library routine `put` (index_put / scatter / index_copy,
      mode set or sum, one output) whose `self` operand is the whole of S, contiguous from
      offset 0, and whose other operands (values, indices) do not read S;
  (c) no step after i reads S (they would see the new value; reads of O see it anyway).
Or (d): O's writer, step i, is a kernel member (pointwise, stored) and no member of that kernel
reads S, nor does any step at or after i (a static cache's position counter, `cumulative_length
+ 1` computed from the inputs): the kernel stores the new value straight into S, with no copy.
`put` writes out[p] = self[p] for every p before its updates; with out == self (contiguous)
that copy is the identity and the routine skips it (kiln_lib.h), leaving only the updates.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import sympy

from kiln.ir import loop as L
from kiln.ir.sym import (FloorDiv, ModIdx, contiguous_strides, ivars, linear_index, product,
                         rvars)
from kiln.ir import program as P


def canon(e: sympy.Expr) -> sympy.Expr:
    """`e` expanded, with FloorDiv(a, c) rewritten as (a - ModIdx(a, c)) / c (exact for the
    non-negative operands of index arithmetic), so c*FloorDiv(a, c) + ModIdx(a, c) becomes a."""
    e = sympy.sympify(e)
    if e.has(FloorDiv):
        e = e.replace(lambda x: isinstance(x, FloorDiv),
                      lambda x: (x.args[0] - ModIdx(*x.args)) / x.args[1])
    return sympy.expand(e)


def _zero_unit_dims(m: L.Compute) -> dict:
    """i-vars of size-1 dims are always 0 (reductions even bind them to the constant 0)."""
    iv = ivars(len(m.shape))
    return {iv[d]: 0 for d, n in enumerate(m.shape) if sympy.sympify(n) == 1}


def store_index(m: L.Compute) -> sympy.Expr:
    """The flat element index member `m` stores its result at (codegen's `out_index`)."""
    iv = ivars(len(m.shape))
    return sympy.expand(linear_index(iv, contiguous_strides(m.shape)).subs(_zero_unit_dims(m)))


def _in_slice(ld: L.Load, m: L.Compute, k: int, inner: sympy.Expr) -> bool:
    """Condition (4): `ld` (a load by member `m`) reads only the current outer slice."""
    if ld.indirect:
        return False
    iv = ivars(len(m.shape))
    base = linear_index(iv[:k], contiguous_strides(m.shape[:k])) * inner
    rest = canon((ld.index - base).subs(_zero_unit_dims(m)))
    if rest.has(FloorDiv, ModIdx):
        return False
    ranges = {iv[d]: m.shape[d] for d in range(k, len(m.shape))}
    if m.reduce is not None:
        ranges.update(zip(rvars(len(m.reduce.sizes)), m.reduce.sizes))
    if rest.free_symbols & set(iv[:k]):
        return False
    top = rest
    for v, size in ranges.items():
        c = rest.coeff(v, 1)
        if c.free_symbols & (set(ranges) | set(iv)) or c.is_nonnegative is not True:
            return False
        top = top - c * v + c * (size - 1)
    const = rest.subs({v: 0 for v in ranges})
    if const.free_symbols & (set(ranges) | set(iv)) or sympy.expand(
            rest - const - sum(rest.coeff(v, 1) * v for v in ranges)) != 0:
        return False  # not affine in the loop variables
    slack = sympy.expand(inner - 1 - top)
    return const.is_nonnegative is True and (slack == 0 or slack.is_nonnegative is True)


def _src_ok(kernel, pos: int, src: str) -> bool:
    """Conditions (2)-(4) for `src` and the member at index `pos` of the kernel."""
    m = kernel.members[pos]
    k = len(kernel.outer)
    want = store_index(m)
    inner = product(m.shape[k:])
    for j, other in enumerate(kernel.members):
        for ld in L.loads(other.body):
            if ld.buf != src:
                continue
            if j > pos:
                return False
            if j == pos:
                if ld.indirect or canon(ld.index.subs(_zero_unit_dims(m)) - want) != 0:
                    return False
            elif not _in_slice(ld, other, k, inner):
                return False
    return True


def kernel_candidates(kernel, buffers: Mapping[str, L.Buffer]) -> list[tuple[str, str]]:
    """Every (out, src) pair of this kernel that satisfies conditions (1)-(4)."""
    written = {m.name for m in kernel.members}
    read: list[str] = []
    for m in kernel.members:
        for ld in L.loads(m.body):
            if ld.buf not in written and ld.buf not in read:
                read.append(ld.buf)
    out: list[tuple[str, str]] = []
    for pos, m in enumerate(kernel.members):
        if m.name in kernel.locals or buffers[m.name].kind != "temp":
            continue
        for src in read:
            b = buffers[src]
            if (b.kind == "temp" and b.dtype == m.dtype
                    and sympy.expand(b.numel - buffers[m.name].numel) == 0
                    and _src_ok(kernel, pos, src)):
                out.append((m.name, src))
    return out


def choose_reuse(steps: Sequence, buffers: Mapping[str, L.Buffer], first: Mapping[str, int],
                 last: Mapping[str, int]) -> dict[str, str]:
    """out -> src for every in-place reuse the program makes (condition (5) on top of (1)-(4)).

    Greedy in step order; within a kernel, outputs in member order, each taking its first
    legal dying source. Deterministic."""
    chosen: dict[str, str] = {}
    taken: set[str] = set()
    for i, step in enumerate(steps):
        if isinstance(step, (*L.CALLS, *L.CONTROL)):  # only kernels store in place
            continue
        for out, src in kernel_candidates(step, buffers):
            if (out in chosen or src in taken or first.get(out) != i or last.get(src) != i):
                continue
            chosen[out] = src
            taken.add(src)
    return chosen


def alias_pairs(kernel, buffers: Mapping[str, L.Buffer]) -> set[str]:
    """Parameters that may alias another one of this kernel (for dropping `__restrict__`).

    Without program context this is every name in `kernel_candidates`: a superset of the
    pairs the program really shares (dropping `__restrict__` is always safe)."""
    return {name for pair in kernel_candidates(kernel, buffers) for name in pair}


def program_aliases(prog) -> dict[str, frozenset[str]]:
    """kernel name -> the parameters that really share bytes in Program IR `prog` (the exact
    `aliased` argument of codegen's `print_kernel`)."""

    reuse = {x.buf: x.reuse for x in P.walk(prog.lines) if isinstance(x, P.Alloc) and x.reuse}
    out: dict[str, frozenset[str]] = {}
    for x in P.walk(prog.lines):
        if isinstance(x, P.CallKernel):
            names = {n for kind, n in x.args if kind == "out" and n in reuse}
            out[x.kernel] = frozenset(names | {reuse[n] for n in names})
    return out


def _whole(arg: L.LibArg, buf: L.Buffer) -> bool:
    """`arg` is the whole of `buf`, contiguous from offset 0 (unit dims' strides ignored)."""
    if arg.buf != buf.name or sympy.sympify(arg.offset) != 0 or \
            len(arg.shape) != len(buf.shape):
        return False
    for size, want, (st, cst) in zip(arg.shape, buf.shape,
                                      zip(arg.strides, contiguous_strides(buf.shape))):
        if sympy.expand(sympy.sympify(size) - want) != 0:
            return False
        if sympy.sympify(size) != 1 and sympy.expand(sympy.sympify(st) - cst) != 0:
            return False
    return True


def _computed_apart(step, new: str, state: str) -> bool:
    """`step` is a kernel whose member `new` stores the whole new value (a pointwise member, not
    a register local) and no member of which reads `state`."""
    members = getattr(step, "members", None)
    if members is None or new in getattr(step, "locals", ()) or new in getattr(
            step, "row_locals", ()):
        return False
    m = next((m for m in members if m.name == new), None)
    if m is None or m.reduce is not None:
        return False
    return all(ld.buf != state for x in members for ld in L.loads(x.body))


def state_updates(steps: Sequence, buffers: Mapping[str, L.Buffer],
                  mutations: Sequence[tuple[str, str]], first: Mapping[str, int],
                  last: Mapping[str, int]) -> dict[str, str]:
    """new-value temp -> state, for every mutation (S, O) that may update S in place
    (conditions (a)-(c) of the module docstring). `first` / `last`: each buffer's first writer
    and last reader step (reads of states included)."""
    out: dict[str, str] = {}
    for state, new in mutations:
        s, o = buffers.get(state), buffers.get(new)
        i = first.get(new)
        if s is None or o is None or o.kind != "temp" or i is None or new in out:
            continue
        step = steps[i]
        if getattr(step, "puts", None):  # puts fused into one launch (schedule/steps.py)
            step = next((p for p in step.puts if p.outs == (new,)), step)
        if s.dtype != o.dtype or sympy.expand(s.numel - o.numel) != 0:
            continue
        if _computed_apart(step, new, state) and last.get(state, -1) < i:
            out[new] = state  # (d): a kernel member computes it without reading the state
            continue
        if not (isinstance(step, L.Extern) and step.routine == "put" and step.outs == (new,)
                and step.args and _whole(step.args[0], s)):
            continue
        if any(a.buf == state for a in step.args[1:]) or last.get(state, i) > i:
            continue
        out[new] = state
    return out
