"""Value numbering of a Triton row kernel's body, over a small statement IR.

The row-kernel printer (kernel.py) prints each member of a kernel on its own: every member
loads what it reads and computes its index math again. When the members' tiles are single (no
loop, the body at the kernel's top level), a softmax's three passes would then load each
element three times. The printer therefore emits its body as statements (`Assign`, `Store`,
`Line`) whose code names the variables it uses (`Ref`); `value_number` removes the
assignments that repeat an earlier one, and `render` prints what is left.

Code is a tuple of literal text and `Ref`s, built with `code` from a format template (the
same templates the printer's op spellings are). Two values are equal when their codes are
equal after the references are renamed to the values they stand for, so no printed text is
parsed."""

from __future__ import annotations

import string
from collections import Counter
from dataclasses import dataclass, replace
from typing import Sequence, Union


@dataclass(frozen=True)
class Ref:
    """A reference to a variable of the kernel body."""

    name: str


#: literal text and variable references, in order; adjacent literals are merged
Code = tuple[Union[str, Ref], ...]


def code(template: str, *args, **kw) -> Code:
    """`template.format(*args, **kw)` as Code: a str argument is literal text, a `Ref` a
    variable, a tuple (Code) is spliced in."""
    parts: list = []
    auto = 0
    for lit, field, spec, conv in string.Formatter().parse(template):
        parts.append(lit)
        if field is None:
            continue
        if spec or conv:
            raise ValueError(f"code templates take no format spec or conversion: {template!r}")
        if field == "":
            field, auto = str(auto), auto + 1
        arg = args[int(field)] if field.isdigit() else kw[field]
        if isinstance(arg, tuple):
            parts.extend(arg)
        elif isinstance(arg, (str, Ref)):
            parts.append(arg)
        else:
            raise TypeError(f"code argument {arg!r}: a str, a Ref or Code")
    return _merge(parts)


def _merge(parts) -> Code:
    out: list = []
    for p in parts:
        if isinstance(p, str):
            if not p:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += p
                continue
        out.append(p)
    return tuple(out)


def text(c: Code) -> str:
    """The printed form of a Code."""
    return "".join(p.name if isinstance(p, Ref) else p for p in c)


@dataclass(frozen=True)
class Assign:
    """`name = value`, `depth` loops deep (0: the kernel's top level). `load`: the buffer
    whose elements `value` is (a `tl.load` of it), else None."""

    name: str
    value: Code
    depth: int = 0
    load: str | None = None


@dataclass(frozen=True)
class Store:
    """`tl.store(buf_<buf> + offset, value, mask=mask)`."""

    buf: str
    offset: Code
    value: Code
    mask: Code
    depth: int = 0


@dataclass(frozen=True)
class Line:
    """Any other line (a comment, a loop header, a barrier, a status store): `code`."""

    code: Code
    depth: int = 0


Stmt = Union[Assign, Store, Line]


def _rename(c: Code, alias: dict[str, str]) -> Code:
    return tuple(Ref(alias.get(p.name, p.name)) if isinstance(p, Ref) else p for p in c)


def _renamed(s: Stmt, alias: dict[str, str]) -> Stmt:
    if not alias:
        return s
    if isinstance(s, Assign):
        return replace(s, value=_rename(s.value, alias))
    if isinstance(s, Store):
        return replace(s, offset=_rename(s.offset, alias), value=_rename(s.value, alias),
                       mask=_rename(s.mask, alias))
    return replace(s, code=_rename(s.code, alias))


def _constant(value: Code) -> bool:
    return bool(value) and isinstance(value[0], str) and value[0].startswith("tl.full(")


def value_number(body: Sequence[Stmt]) -> list[Stmt]:
    """The body with every top-level assignment that repeats an earlier one removed, and the
    references to its name renamed to the earlier one's (also in nested statements).

    Eligible assignments: at the top level (depth 0: computed once per program, visible to
    everything after it); to a name assigned exactly once in the whole body (accumulators,
    loop-carried and re-assigned index variables hold more than one value); whose value does
    not start with a `tl.full(...)` literal (accumulator initial values, casts of inline
    constants: never shared today). Two eligible assignments repeat each other when their
    values are equal after renaming, i.e. the same code over the same values.

    The store rule: a `Store` to a buffer forgets the earlier loads of that buffer (an
    assignment with `load` == that buffer), wherever the store is (nested too), so a load
    after it reads the stored data again. Values computed from a forgotten load stay shared:
    they are the values of the earlier load, which a later load of new data is not.

    Pure: the input is not changed; the statements keep their order."""
    counts = Counter(s.name for s in body if isinstance(s, Assign))
    alias: dict[str, str] = {}
    seen: dict[Code, Assign] = {}
    out: list[Stmt] = []
    for s in body:
        s = _renamed(s, alias)
        if isinstance(s, Store):
            seen = {k: a for k, a in seen.items() if a.load != s.buf}
        elif isinstance(s, Assign) and s.depth == 0 and counts[s.name] == 1 \
                and not _constant(s.value):
            if s.value in seen:
                alias[s.name] = seen[s.value].name
                continue
            seen[s.value] = s
        out.append(s)
    return out


def render(body: Sequence[Stmt], indent: str = "    ") -> list[str]:
    """The statements as lines of Python, each indented by `indent` and 4 spaces a depth."""
    out = []
    for s in body:
        pad = indent + "    " * s.depth
        if isinstance(s, Assign):
            out.append(f"{pad}{s.name} = {text(s.value)}")
        elif isinstance(s, Store):
            out.append(f"{pad}tl.store(buf_{s.buf} + {text(s.offset)}, {text(s.value)}, "
                       f"mask={text(s.mask)})")
        else:
            out.append(pad + text(s.code))
    return out
