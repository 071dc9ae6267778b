"""Translate torch's symbolic sizes (SymInt / torch sympy expressions) into kiln's sympy
expressions over renamed symbols `s0, s1, ...` (numbered in order of first appearance in the
user inputs)."""

from __future__ import annotations

import sympy
import torch

from kiln.errors import UnsupportedError
from kiln.ir import sym


class SymbolTable:
    def __init__(self) -> None:
        self.rename: dict[sympy.Symbol, sympy.Symbol] = {}
        self.unbacked: dict[str, sympy.Expr] = {}  # u0 -> upper bound over input symbols

    def add_unbacked(self, s: sympy.Symbol, bound: sympy.Expr | None) -> sympy.Symbol:
        """A data-dependent size (torch's unbacked symbol) and its upper bound; without one
        (`None`) the bound is the symbol itself: buffers sized by it are allocated at run time
        once it is known (sym.unbounded)."""
        if s not in self.rename:
            self.rename[s] = sym.unbacked_symbol(f"u{len(self.unbacked)}")
            self.unbacked[self.rename[s].name] = self.rename[s] if bound is None else bound
        return self.rename[s]

    def add(self, s: sympy.Symbol) -> sympy.Symbol:
        if s not in self.rename:
            self.rename[s] = sym.size_symbol(f"s{len(self.rename)}")
        return self.rename[s]

    def convert(self, e) -> sympy.Expr:
        if isinstance(e, torch.SymInt):
            e = e.node.expr
        if isinstance(e, int):
            return sympy.Integer(e)
        return self._expr(sympy.sympify(e))

    def _expr(self, e: sympy.Expr) -> sympy.Expr:
        if e.is_Integer:
            return e
        if e.is_Symbol:
            if e not in self.rename:
                raise UnsupportedError(f"size symbol {e} does not come from an input shape")
            return self.rename[e]
        args = [self._expr(a) for a in e.args]
        name = type(e).__name__
        if e.is_Add:
            return sympy.Add(*args)
        if e.is_Mul:
            return sympy.Mul(*args)
        if e.is_Pow:
            return sympy.Pow(*args)
        if name == "FloorDiv":
            return sym.FloorDiv(*args)
        if name in ("Mod", "PythonMod"):
            return sym.ModIdx(*args)
        if name in ("Max",):
            return sympy.Max(*args)
        if name in ("Min",):
            return sympy.Min(*args)
        if name == "CeilToInt":
            return sympy.ceiling(args[0])
        raise UnsupportedError(f"cannot translate size expression {e} ({name})")

    def shape(self, shape) -> tuple[sympy.Expr, ...]:
        return tuple(self.convert(d) for d in shape)
