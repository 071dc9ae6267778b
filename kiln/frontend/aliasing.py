"""Which program outputs share storage with another output or with a user input in eager.

Input: the exported program (its FX graph: views are the ops whose schema says the result
aliases `self`, e.g. `slice.Tensor(Tensor(a) self, ...) -> Tensor(a)`), the model's user input
names in input order, the symbol table. Output: one record per user output, None where the
output owns its storage, else
``{"of": "input" | "output", "index": k, "sizes": [...], "strides": [...], "offset": e}``:
output j is ``base.as_strided(sizes, strides, base.storage_offset() + offset)`` of input k or
output k, in elements, for a compact (row-major) base. Sizes, strides and offset are ints or
polynomials over the input size symbols written as text ("3*s0"); the runner evaluates them.

Rule: follow output j's views back to the first value that is not a view (the root). When the
root is a user input, or the value of another output (the first such; for an output listed
twice, an earlier position), j aliases it. When eager lays the root out compactly, the view's
strides and storage offset in the export's metadata hold for kiln's compact buffers too; when
it lays it out otherwise (a pointwise op on a transposed input, an input exported with other
strides), the view chain is replayed on a compact base of the root's shape (`_replay`), since
kiln's base is compact. An output that is the input or the earlier output itself (no view
between: `return x`, `return y, y`) is marked ``"same": true``, in any layout: the runner
returns that very object, and a new view object of the base for any other record (as eager's
`x[:]`). An input exported compact that is an output itself is also marked ``"contiguous":
true``: `x.contiguous()` is a no-op on the export's example, so the graph of `return
x.contiguous()` is that of `return x`; the runner returns the input itself only when it is
contiguous at run time (eager's `contiguous()` returns `self` then) and kiln's compact copy
otherwise (eager's copy; for `return x` that is a copy where eager shares, the direction
kiln allows: views of an input given in another layout are copies too). Conversely, an output
that is eager's `v.contiguous()` of an input or a view of one (a copy in the graph: v was not
contiguous at export) is recorded as v marked ``"contiguous": true``: the runner returns v
when it is contiguous at run time (`_contiguous_record`). A root no output returns is stood in
for by the first output that views all of it
compactly (a matmul's result: a view of its bmm). Other cases keep separate storage (the values
are the same): outputs that share a root no output returns nor views whole, view chains the
compact layout cannot make, and sizes that are not polynomials over the input symbols.

The graph is eager's at the export's strides only: `contiguous()` of a value compact there
leaves no trace, and a reshape that viewed may copy other strides. So a record whose output is
compact at export is marked ``"contiguous": true`` (of an input: a view only where it is
contiguous at run time); a chain that a base whose dims cannot be merged would not view (a
reshape merging dims) ``"compact_only": true`` (of an input: views of a compact input only);
and a record of an output that rests on eager's layout (either output compact at export, or
such a reshape) carries ``"when_strides"``: the user inputs' strides at export; the runner
keeps the sharing only for inputs with those strides (else eager's layout may be another,
where it copies). Kiln then never shares where eager does not; it may share less for inputs
in another layout than the export's."""

from __future__ import annotations

import operator

import sympy
import torch

from kiln.errors import UnsupportedError
from kiln.frontend.symbols import SymbolTable


# views whose elements mean something else than their base's (a conjugate or negative bit,
# complex pairs read as reals and back, another dtype): the runner cannot rebuild them with
# as_strided of the base, so kiln returns them as new tensors (a copy where eager shares)
REINTERPRETING = {"aten._conj.default", "aten._neg_view.default", "aten.view_as_real.default",
                  "aten.view_as_complex.default", "aten.view.dtype"}


def _is_view(n: torch.fx.Node) -> bool:
    """Whether `n`'s result aliases its first argument (an ATen view op)."""
    schema = getattr(n.target, "_schema", None)
    if n.op != "call_function" or schema is None or not schema.returns or not schema.arguments:
        return False
    if str(n.target) in REINTERPRETING:
        return False
    out, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    return out is not None and not out.is_write and first is not None and \
        not first.is_write and set(out.before_set) == set(first.before_set) and \
        isinstance(n.args[0], torch.fx.Node) and len(schema.returns) == 1 and \
        _shares_storage(n.meta.get("val"), n.args[0].meta.get("val"))


def _view_source(n: torch.fx.Node) -> torch.fx.Node | None:
    """The node whose storage `n` views: the first argument of a view op, or the input of a
    view op with several results (split, chunk, unbind) that `n` takes one of; None when `n`
    is no view."""
    if _is_view(n):
        return n.args[0]
    if n.op == "call_function" and n.target is operator.getitem and \
            isinstance(n.args[0], torch.fx.Node):
        parent = n.args[0]
        schema = getattr(parent.target, "_schema", None)
        if parent.op != "call_function" or schema is None or len(schema.returns) != 1 or \
                not schema.arguments or not isinstance(parent.args[0], torch.fx.Node):
            return None
        # `Tensor(a -> *) self -> Tensor(a)[]`: the list's elements may alias self; the
        # traced values say whether this one does
        first = schema.arguments[0].alias_info
        if first is not None and not first.is_write and \
                str(schema.returns[0].type) == "List[Tensor]" and \
                _shares_storage(n.meta.get("val"), parent.args[0].meta.get("val")):
            return parent.args[0]
    return None


def _shares_storage(val, arg) -> bool:
    """Whether the traced values share storage: a schema's alias annotation says "may alias"
    (reshape, flatten: a view where the strides allow one, else a copy), the traced values
    say what this call did."""
    if not isinstance(val, torch.Tensor) or not isinstance(arg, torch.Tensor):
        return False
    try:
        return bool(torch._C._is_alias_of(val, arg))
    except Exception:  # no storage to compare (e.g. sparse): not provably a view
        return False


def _text(e: sympy.Expr) -> int | str | None:
    """An int, or a polynomial with integer coefficients over size symbols as text."""
    e = sympy.expand(e)
    if e.is_Integer:
        return int(e)
    if not e.free_symbols or not all(s.name.startswith("s") for s in e.free_symbols):
        return None  # data-dependent sizes (u0) are not known to the runner from the inputs
    try:  # FloorDiv, Mod and the like are not polynomials: not recorded
        poly = sympy.Poly(e, *sorted(e.free_symbols, key=lambda s: s.name))
    except sympy.PolynomialError:
        return None
    if not e.is_polynomial(*e.free_symbols) or not all(c.is_Integer for c in poly.coeffs()):
        return None
    return str(e)


def _compact(val: torch.Tensor) -> bool:
    try:
        return bool(val.is_contiguous())
    except Exception:  # a guard on data-dependent sizes: not provably compact
        return False


def _same_layout(a, b) -> bool:
    """Whether fake tensors `a` and `b` have the same dtype, sizes, strides and offset."""
    try:
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.dtype == b.dtype and a.dim() == b.dim() and \
            all(bool(x == y) for x, y in zip(a.shape, b.shape)) and \
            all(bool(x == y) for x, y in zip(a.stride(), b.stride())) and \
            bool(a.storage_offset() == b.storage_offset())
    except Exception:  # a guard on symbolic sizes that cannot be decided: not provably equal
        return False


def _whole(val, root_val) -> bool:
    """Whether `val` views all of `root_val` compactly from its first element: kiln's compact
    buffer for it then holds the root's elements in the root's own order."""
    try:
        return isinstance(val, torch.Tensor) and isinstance(root_val, torch.Tensor) and \
            val.dtype == root_val.dtype and _compact(val) and _compact(root_val) and \
            bool(val.numel() == root_val.numel()) and \
            bool(val.storage_offset() == root_val.storage_offset())
    except Exception:  # a guard on symbolic sizes that cannot be decided: not provably whole
        return False


def _record(val, root_val, syms: SymbolTable, of: str, index: int) -> dict | None:
    try:
        parts = [syms.convert(d) for d in val.shape], [syms.convert(s) for s in val.stride()], \
            syms.convert(val.storage_offset()) - syms.convert(root_val.storage_offset())
    except UnsupportedError:
        return None
    sizes, strides, offset = ([_text(e) for e in parts[0]], [_text(e) for e in parts[1]],
                              _text(parts[2]))
    if None in sizes or None in strides or offset is None:
        return None
    return {"of": of, "index": index, "sizes": sizes, "strides": strides, "offset": offset}


def _replay(n: torch.fx.Node, root: torch.fx.Node, generic: bool = False):
    """(compact base, view): the view ops from `root` to `n` applied again to a compactly laid
    out tensor of root's shape (fake, symbolic sizes); None when one of them cannot make a view
    of it (a `view` whose dims the compact layout cannot merge) or anything fails. `generic`:
    on a base whose dims no view can merge (each stride that of a buffer one longer in every
    dim) instead: a chain that still views it views a base in any layout."""
    chain = []
    while n is not root:
        chain.append(n)
        n = _view_source(n)
        if n is None:
            return None
    root_val = root.meta["val"]
    mode = getattr(root_val, "fake_mode", None)
    if mode is None:
        return None

    def val(a):
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    try:
        with mode:
            if generic:
                strides, step = [], 1
                for d in reversed(root_val.shape):
                    strides.append(step)
                    step = step * (d + 1)
                base = torch.empty_strided(root_val.shape, tuple(reversed(strides)),
                                           dtype=root_val.dtype, device=root_val.device)
            else:
                base = torch.empty(root_val.shape, dtype=root_val.dtype,
                                   device=root_val.device)
            x = base
            for v in reversed(chain):
                if v.target is operator.getitem:
                    op = v.args[0]
                    rest = [val(a) for a in op.args[1:]]
                    x = op.target(x, *rest, **{k: val(a) for k, a in op.kwargs.items()})[
                        v.args[1]]
                else:
                    rest = [val(a) for a in v.args[1:]]
                    x = v.target(x, *rest, **{k: val(a) for k, a in v.kwargs.items()})
            if not torch._C._is_alias_of(x, base):
                return None
            return base, x
    except Exception:  # a guard it cannot decide, a view the compact layout cannot make
        return None


def _view_record(n: torch.fx.Node, root: torch.fx.Node, syms: SymbolTable, of: str,
                 index: int, same: bool, base: torch.fx.Node | None = None,
                 when: list | None = None) -> dict | None:
    """The record of `n`, a view of `root` (input or output `index`; `same`: root itself).
    `base`: output `index`'s node when `of` is "output" (root or a whole view of it); `when`:
    the user inputs' strides at export (texts; None where one cannot be written)."""
    val, root_val = n.meta.get("val"), root.meta.get("val")
    record = None
    if isinstance(root_val, torch.Tensor) and isinstance(val, torch.Tensor) and \
            root_val.dtype == val.dtype:
        if _compact(root_val):
            record = _record(val, root_val, syms, of, index)
        else:  # kiln's base is compact (an output; an input given compact): the view
            # on it is the view chain replayed on a compact base, not the metadata's
            replayed = _replay(n, root)
            if replayed is not None:
                record = _record(replayed[1], replayed[0], syms, of, index)
    if same:  # the very tensor (`return x`, `return y, y`): in any layout
        record = {**(record or {"of": of, "index": index}), "same": True}
    if record is None:
        return None
    generic = _replay(n, root, generic=True) is not None
    if of == "input":
        # compact at export, the output may be eager's `v.contiguous()` (a no-op there, so
        # not in the graph): v only where v is contiguous at run time
        if _compact(val):
            record["contiguous"] = True
        if not generic:  # a reshape that views only some layouts: of a compact input only
            record["compact_only"] = True
        return record
    # of an output: eager's layout of the root is its run-time decision; where the sharing
    # rests on it (either output compact at export: possibly an elided `contiguous()`; a
    # reshape on the way), it holds when the inputs come with the export's strides
    base_val = base.meta.get("val") if base is not None else None
    if _compact(val) or not isinstance(base_val, torch.Tensor) or _compact(base_val) or \
            not generic or (base is not root and _replay(base, root, generic=True) is None):
        if when is None:
            return None
        record["when_strides"] = when
    return record


def _input_strides(nodes: dict, user_inputs: list[str], syms: SymbolTable) -> list | None:
    """Each user input's strides at export as texts (None for a number input); None when one
    is not a polynomial over the input size symbols."""
    out: list = []
    for name in user_inputs:
        val = nodes[name].meta.get("val") if name in nodes else None
        if not isinstance(val, torch.Tensor):
            out.append(None)
            continue
        try:
            texts = [_text(syms.convert(st)) for st in val.stride()]
        except (UnsupportedError, TypeError):
            return None
        if None in texts:
            return None
        out.append(texts)
    return out


def _contiguous_of(n: torch.fx.Node) -> torch.fx.Node | None:
    """The argument of eager's `v.contiguous()` (v itself when v is contiguous, else a compact
    copy): `aten.contiguous`, or the clone torch's decomposition makes of it (its `from_node`
    provenance names aten.contiguous; an explicit clone always copies); None otherwise."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], torch.fx.Node):
        return None
    if n.target is torch.ops.aten.contiguous.default:
        fmt = n.args[1] if len(n.args) > 1 else n.kwargs.get("memory_format")
    elif n.target is torch.ops.aten.clone.default and any(
            getattr(f, "target", None) == "aten.contiguous.default"
            for f in n.meta.get("from_node") or ()):
        fmt = n.kwargs.get("memory_format")
    else:
        return None
    return n.args[0] if fmt in (None, torch.contiguous_format) else None


def _contiguous_record(n: torch.fx.Node, user_inputs: list[str], syms: SymbolTable
                       ) -> dict | None:
    """`v.contiguous()` where v is a user input or a view of one, not contiguous at export
    (else the export records no op): the record of v, marked "contiguous": the runner returns
    v (a view of the input as given) when it is contiguous at run time, as eager does. Only
    of inputs, whose run-time layout is eager's too (an output's base is kiln's compact
    buffer, which eager may lay out otherwise)."""
    v = root = _contiguous_of(n)
    while _view_source(root) is not None:
        root = _view_source(root)
    val = n.meta.get("val")
    if root.name not in user_inputs or not isinstance(val, torch.Tensor) or \
            not isinstance(v.meta.get("val"), torch.Tensor) or v.meta["val"].dtype != val.dtype:
        return None
    index = user_inputs.index(root.name)
    record = _view_record(v, root, syms, "input", index, v is root)
    return None if record is None else {**record, "contiguous": True}


def output_aliases(ep: torch.export.ExportedProgram, user_inputs: list[str],
                   outputs: list[str | None], syms: SymbolTable,
                   written: dict[str, str] | None = None) -> tuple[dict | None, ...]:
    """`outputs`: the FX node name of each user output (None: not a tensor node). `written`:
    FX node name of the new contents of a user input the program writes in place -> that
    input's name: in eager such an output is the input itself, and a view of the new contents
    (`x.add_(1); return x[1:]`) a view of the input (the runner writes the contents back
    before it shares storage). The new contents stand in for the input only where they have
    its dtype, shape and strides at export, so the view's record reads the same over both."""
    nodes = {n.name: n for n in ep.graph.nodes}
    written = written or {}
    outputs = [written.get(o, o) if o is not None else None for o in outputs]
    first_output: dict[str, int] = {}
    roots = []
    for j, name in enumerate(outputs):
        n = nodes.get(name) if name is not None else None
        while n is not None and _view_source(n) is not None:
            n = _view_source(n)
        if n is not None and n.name in written and written[n.name] in nodes and \
                _same_layout(n.meta.get("val"), nodes[written[n.name]].meta.get("val")):
            n = nodes[written[n.name]]  # a view of a written input's new contents
        roots.append(n)
        if name is not None and name in nodes and _view_source(nodes[name]) is None:
            first_output.setdefault(name, j)  # an output that owns (or is) its root
    for j, name in enumerate(outputs):  # a root no output returns: the first output that views
        root = roots[j]  # all of it compactly stands in for it (matmul's view of its bmm)
        if root is None or root.name in first_output or root.name in user_inputs:
            continue
        if _whole(nodes[name].meta.get("val"), root.meta.get("val")):
            first_output[root.name] = j
    out: list[dict | None] = []
    when = _input_strides(nodes, user_inputs, syms)
    for j, name in enumerate(outputs):
        root, val = roots[j], nodes[name].meta.get("val") if name in nodes else None
        record = None
        if root is not None and isinstance(val, torch.Tensor):
            if root.name in user_inputs:
                of, index = "input", user_inputs.index(root.name)
            elif first_output.get(root.name, j) != j:
                of, index = "output", first_output[root.name]
            else:
                of = None
            if of is not None:
                same = name == (user_inputs[index] if of == "input" else outputs[index])
                record = _view_record(nodes[name], root, syms, of, index, same,
                                      nodes.get(outputs[index]) if of == "output" else None,
                                      when)
            elif _contiguous_of(nodes[name]) is not None:
                record = _contiguous_record(nodes[name], user_inputs, syms)
        out.append(record)
    return tuple(out)
