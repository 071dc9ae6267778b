"""Prepacking (CPU): the constant B operand of a GEMM whose chosen kernel is kiln's packed
GEMM (`kr::gemm_cpp_packed`, runtime/model/kiln_gemm.h) stored in the kernel's panel layout
(kiln/ir/packing.py), so no call packs it again.

B is read from the weight as the GEMM's operand describes it (offset, row and column
strides), so a Linear weight W [N, K] (B = W.t(), read column by column) and a frozen W.t()
pack alike. The package records the packing per weight (manifest `weights[].packed`, the
record `packing_record` makes): `update_weights` applies it to new weights given in their
original layout (runtime/weights.py). A pure pass over the planned Program and the schedule:
returns new Program lines and weight specs, steps and weight table. Its caller gives only
GEMMs at the top level of the schedule whose weight has no other reader (kiln/gemm/cpu.py,
`packable`)."""

from __future__ import annotations

from dataclasses import replace

from kiln.ir import loop as L
from kiln.ir import program as P
from kiln.ir.packing import pack_panels


def packing_record(g: L.Gemm, nr: int, stored_shape: tuple[int, ...]) -> dict:
    """How the weight GEMM `g` reads as B (stored as `stored_shape`) is packed."""
    return {"nr": nr, "k": int(g.k), "n": int(g.n), "offset": int(g.b.offset),
            "rows": int(g.b.rows), "cols": int(g.b.cols), "shape": list(stored_shape)}


def pack_weights(program: P.Program, steps, weights: dict, pack: dict[str, int]):
    """(program, steps, weights) with the B weight of every top-level GEMM in `pack` (GEMM
    name -> panel width NR) stored packed; those GEMMs get `packed_b = NR`."""
    gemms = {s.name: s for s in steps if isinstance(s, L.Gemm) and s.name in pack}
    if not gemms:
        return program, steps, weights
    new_weights = dict(weights)
    specs = {w.name: w for w in program.weights}
    for name, g in gemms.items():
        spec = specs[g.b.buf]
        assert spec.packed is None, f"weight {g.b.buf} packed twice"
        rec = packing_record(g, pack[name], spec.shape)
        t = pack_panels(weights[g.b.buf], rec)
        new_weights[g.b.buf] = t
        specs[g.b.buf] = replace(spec, shape=tuple(t.shape),
                                 nbytes=t.numel() * t.element_size(), packed=rec)
    packed = {name: replace(g, packed_b=pack[name]) for name, g in gemms.items()}

    def fix(x):
        if isinstance(x, P.CallGemm) and x.gemm.name in packed:
            return replace(x, gemm=packed[x.gemm.name])
        return x

    new_program = replace(program, lines=P.map_lines(program.lines, fix),
                          weights=tuple(specs[w.name] for w in program.weights))
    new_steps = tuple(packed.get(s.name, s) if isinstance(s, L.Gemm) else s for s in steps)
    return new_program, new_steps, new_weights
