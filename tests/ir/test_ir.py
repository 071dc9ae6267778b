"""IR levels: printers, verifiers (each rejects a broken program with a message naming the
line), and the index simplifier (property test against direct evaluation)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import sympy
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kiln
from kiln.frontend.export import import_program
from kiln.ir import dtypes
from kiln.ir import loop as L
from kiln.ir import program as P
from kiln.ir.graph import GraphError, print_graph, verify_graph
from kiln.ir.loop_text import LoopError, print_loop, verify_loop
from kiln.ir.simplify import simplify_index
from kiln.ir.sym import FloorDiv, ModIdx, ivars, size_symbol, to_c
from kiln.lowering import lower


class Small(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(torch.relu(x * 2).sum(-1), 0)


@pytest.fixture(scope="module")
def graph():
    ep = torch.export.export(Small(), (torch.randn(3, 5),))
    return import_program(ep).graph


def test_graph_printer_and_verifier(graph):
    text = print_graph(graph)
    assert "user %x: float32[3, 5]" in text and "reduce(" in text
    verify_graph(graph)
    broken = replace(graph, nodes=tuple(reversed(graph.nodes)))
    with pytest.raises(GraphError, match="before it is defined"):
        verify_graph(broken)


def test_loop_printer_and_verifier(graph):
    prog = lower(graph)
    assert "reduce sum" in print_loop(prog)
    verify_loop(prog)
    bad = replace(prog, nodes=tuple(reversed(prog.nodes)))
    with pytest.raises(LoopError, match="before it is written"):
        verify_loop(bad)


def test_program_verifier_catches_use_after_free(tmp_path):
    c = kiln.compile(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(),
                                         torch.nn.Linear(4, 4)), (torch.randn(2, 4),))
    prog = c.built.program
    P.verify_program(prog, planned=True)
    assert "alloc" in P.print_program(prog) and "gemm" in P.print_program(prog)
    lines = list(prog.lines)
    k = next(i for i, x in enumerate(lines) if isinstance(x, P.Free))
    lines.insert(1, lines.pop(k))
    with pytest.raises(P.ProgramError):
        P.verify_program(replace(prog, lines=tuple(lines)), planned=True)


def _eval(e, env):
    e = sympy.sympify(e).xreplace({k: sympy.Integer(v) for k, v in env.items()})
    return int(sympy.sympify(e).replace(
        FloorDiv, lambda a, b: sympy.Integer(int(a) // int(b))).replace(
        ModIdx, lambda a, b: sympy.Integer(int(a) % int(b))))


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 5), st.integers(1, 4), st.integers(1, 6),
       st.integers(0, 3))
def test_simplifier_preserves_values(a, b, c, s, which):
    i0, i1, i2 = ivars(3)
    s0 = size_symbol("s0")
    ranges = {i0: a * s0, i1: b, i2: c}
    flat = i0 * b * c + i1 * c + i2
    exprs = [FloorDiv(flat, b * c), ModIdx(FloorDiv(flat, c), b), ModIdx(flat, c),
             FloorDiv(flat, c * b * a * s0)]
    e = exprs[which]
    simple = simplify_index(e, ranges)
    for x0 in range(a * s):
        for x1 in range(b):
            for x2 in range(c):
                env = {i0: x0, i1: x1, i2: x2, s0: s}
                assert _eval(e, env) == _eval(simple, env), (e, simple, env)


def test_simplifier_removes_reshape_div_mod():
    i0, i1, i2 = ivars(3)
    s1 = size_symbol("s1")
    ranges = {i0: 8, i1: s1, i2: 64}
    assert simplify_index(FloorDiv(64 * i1 + i2 + 64 * i0 * s1, 64 * s1), ranges) == i0
    assert simplify_index(ModIdx(64 * i1 + i2, 64), ranges) == i2
    assert to_c(64 * i1 + i2) == "((64 * i1) + i2)"


def test_to_c_max_min_by_value_in_kernels():
    """Kernels print Max / Min as kr::imax / kr::imin (by value: std::max's references keep
    GCC from vectorising an `omp simd` loop); other C++ keeps std::max / std::min."""
    i0, i1 = ivars(2)
    e = 384 * sympy.Max(0, sympy.Min(1499, i0 - 1)) + i1
    assert to_c(e, kernel=True) == "(i1 + (384 * kr::imax(0, kr::imin(1499, (-1 + i0)))))"
    assert to_c(e) == "(i1 + (384 * std::max<int64_t>(0, std::min<int64_t>(1499, (-1 + i0)))))"


def test_loop_load_collects_indirect():
    inner = L.Load("idx", sympy.Integer(0), dtypes.int64)
    x = sympy.Symbol("x1", integer=True)
    outer = L.Load("w", x, dtypes.float32, (L.Indirect(x, inner, sympy.Integer(10)),))
    assert {ld.buf for ld in L.loads(outer)} == {"w", "idx"}
