"""Shrinks a failing fuzz program while it keeps failing the same way.

Candidates, each kept only when it is still valid in eager and `check` still gives the same
failure key (status, the stage or comparison that failed, the kind of mismatch; numbers,
dtypes and sizes elided), in this order:
1. structure: keep a single output; drop dead ops, inputs and parameters; bypass an op (its
   users read one of its operands instead);
2. dynamic -> static (and an unusual `Dim` declaration -> a bounded one);
3. shapes: one size made smaller everywhere it occurs (input and parameter shapes, index
   bounds, reshape/expand targets), halved or 1; one input dim halved or 1; a size-1 input
   dim dropped; any input dim dropped (fewer dims);
4. dtypes: float64 -> float32, int64/bool inputs -> float32, casts -> float32;
5. attributes: optional parameters (bias, norm weight) dropped; an op's function replaced by
   the simplest of its table (neg, add, sum); scalars -> 0 or 1 (slice start/end/step,
   select index, pad value, conv stride/padding/dilation/groups, keepdim, ...); reduction dim
   lists shortened; non-contiguous views made contiguous (permutation -> identity, slice
   step -> 1, transpose -> same dim).
Candidates eager rejects, and ones already tried, cost no compile; `budget` bounds the calls
of `check`. `check` is a parameter so tests can inject a fault (default: the runner's)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator

import torch

from kiln.fuzz import runner
from kiln.fuzz.program import B_EXAMPLE, FuzzModule, clone, make_inputs
from kiln.fuzz.runner import Outcome

Check = Callable[[dict], Outcome]

SIMPLEST_FN = {"unary": "neg", "int_unary": "neg", "binary": "add", "reduce": "sum"}
# the simplest value of a bool/None-able attribute; other numbers try 0 then 1
SIMPLE_ATTR = {"keep": False, "log": False, "max": True, "t": False, "end": None}


def _key(o: Outcome) -> str:
    """What must stay the same: the status and where it failed, not by how much nor at which
    dtype or size (so that dtypes and shapes can shrink)."""
    first = o.detail.splitlines()[0][:160] if o.detail else ""
    first = re.sub(r"B=\d+", "B=#", first)
    if o.status == "mismatch":  # "eager, B=3: output 0 (torch.float32): 2 of 8 elements..."
        against = first.split(",", 1)[0].split(":", 1)[0]
        kind = "values" if " elements differ" in first else \
            "dtype" if ": dtype " in first else "shape"
        return f"mismatch:{against}:{kind}"
    first = re.sub(r"torch\.\w+", "#", first)
    return o.status + ":" + re.sub(r"\b[-+]?\d[\d.e+-]*", "#", first)


def prune(spec: dict) -> dict:
    """Drop ops not reaching an output, then unused inputs and parameters; renumber."""
    s = clone(spec)
    n_in = len(s["inputs"])
    live = set(s["outputs"])
    for k in range(len(s["ops"]) - 1, -1, -1):
        if n_in + k in live:
            live.update(s["ops"][k][1])
    keep_in = [i for i in range(n_in) if i in live]
    keep_ops = [k for k in range(len(s["ops"])) if n_in + k in live]
    new = {old: j for j, old in enumerate(keep_in + [n_in + k for k in keep_ops])}
    ops = []
    for k in keep_ops:
        op, args, attrs = s["ops"][k]
        ops.append([op, [new[a] for a in args], attrs])
    used_p = {v for _, _, a in ops for key, v in a.items() if key in ("w", "b") and v}
    s["inputs"] = [s["inputs"][i] for i in keep_in]
    s["ops"] = ops
    s["outputs"] = [new[o] for o in s["outputs"]]
    s["params"] = {k: v for k, v in s["params"].items() if k in used_p}
    return s


def _valid(spec: dict) -> bool:
    try:
        with torch.no_grad():
            FuzzModule(spec)(*make_inputs(spec, spec["seed"]))
        return bool(spec["ops"]) and bool(spec["inputs"])
    except Exception:
        return False


# -- candidates, by kind ----------------------------------------------------------------------

def _structure(spec: dict) -> Iterator[dict]:
    n_in = len(spec["inputs"])
    if len(spec["outputs"]) > 1:
        for o in spec["outputs"]:
            yield prune({**spec, "outputs": [o]})
    for k in range(len(spec["ops"]) - 1, -1, -1):
        me = n_in + k
        for a in sorted(set(spec["ops"][k][1])):
            s = clone(spec)
            for op in s["ops"]:
                op[1] = [a if x == me else x for x in op[1]]
            s["outputs"] = [a if x == me else x for x in s["outputs"]]
            if all(o < n_in for o in s["outputs"]):
                continue  # an output must be computed by the program
            yield prune(s)


def _static(spec: dict) -> Iterator[dict]:
    if spec.get("export_layout"):  # exported with contiguous inputs
        yield {k: v for k, v in clone(spec).items() if k != "export_layout"}
    if spec.get("dynamic"):
        s = {**clone(spec), "dynamic": False}
        for i in s["inputs"]:  # the dynamic dim becomes a plain size, free to shrink
            i["shape"] = [B_EXAMPLE if d == "B" else d for d in i["shape"]]
        yield s
        if spec.get("dim", "bounded") != "bounded":
            yield {**clone(spec), "dim": "bounded"}


def _resize_all(spec: dict, old: int, new: int) -> dict:
    """Every occurrence of size `old` becomes `new`: input and parameter shapes, index bounds
    ("high") and the reshape / expand targets (dims that must agree shrink together)."""
    s = clone(spec)
    for i in s["inputs"]:
        i["shape"] = [new if d == old else d for d in i["shape"]]
        if i.get("high") == old:
            i["high"] = new
    for p in s["params"].values():
        p["shape"] = [new if d == old else d for d in p["shape"]]
    for op, _, a in s["ops"]:
        if op in ("reshape", "expand"):
            a["shape"] = [new if d == old else d for d in a["shape"]]
    return s


def _shapes(spec: dict) -> Iterator[dict]:
    sizes = sorted({d for i in spec["inputs"] for d in i["shape"] if d != "B" and d > 1} |
                   {d for p in spec["params"].values() for d in p["shape"] if d > 1},
                   reverse=True)
    for size in sizes:
        for new in sorted({1, size // 2}):
            yield _resize_all(spec, size, new)
    for i, inp in enumerate(spec["inputs"]):
        for d, size in enumerate(inp["shape"]):
            if size != "B" and size > 1:
                for new in sorted({1, size // 2}):
                    s = clone(spec)
                    s["inputs"][i]["shape"][d] = new
                    yield s
    for ones_only in (True, False):  # drop size-1 dims first, then any dim
        for i, inp in enumerate(spec["inputs"]):
            for d, size in enumerate(inp["shape"]):
                if (size == 1) == ones_only and size != "B":
                    s = clone(spec)
                    del s["inputs"][i]["shape"][d]
                    yield s


def _dtypes(spec: dict) -> Iterator[dict]:
    for simpler_from in (("float64",), ("int64", "bool")):
        for i, inp in enumerate(spec["inputs"]):
            if inp["dtype"] in simpler_from and not inp.get("high"):
                s = clone(spec)
                s["inputs"][i]["dtype"] = "float32"
                yield s
        for k, (op, _, a) in enumerate(spec["ops"]):
            if op == "cast" and a["dtype"] in simpler_from:
                s = clone(spec)
                s["ops"][k][2]["dtype"] = "float32"
                yield s


def _attrs(spec: dict) -> Iterator[dict]:
    def with_attr(k: int, key: str, value) -> dict:
        s = clone(spec)
        s["ops"][k][2][key] = value
        return prune(s)  # a dropped bias leaves an unused parameter

    for k, (op, _, a) in enumerate(spec["ops"]):
        for key in ("b", "w"):
            if a.get(key) and (key == "b" or op == "layer_norm"):
                yield with_attr(k, key, None)
        if "fn" in a and op in SIMPLEST_FN and a["fn"] != SIMPLEST_FN[op]:
            yield with_attr(k, "fn", SIMPLEST_FN[op])
        if op == "permute" and a["dims"] != sorted(a["dims"]):
            yield with_attr(k, "dims", sorted(a["dims"]))
        if op == "transpose" and a["d0"] != a["d1"]:
            yield with_attr(k, "d1", a["d0"])
        if op in ("reduce", "var") and len(a["dims"]) > 1:
            for j in range(len(a["dims"])):
                yield with_attr(k, "dims", a["dims"][:j] + a["dims"][j + 1:])
        if op == "pad" and any(a["pad"]):
            yield with_attr(k, "pad", [0] * len(a["pad"]))
        for key, v in sorted(a.items()):
            if key in SIMPLE_ATTR:
                if v != SIMPLE_ATTR[key]:
                    yield with_attr(k, key, SIMPLE_ATTR[key])
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and key not in (
                    "rank", "dim", "d0", "d1"):
                for simple in (0, 1):  # slice step 0, groups 0, ... are refused by eager
                    if v != simple:
                        yield with_attr(k, key, type(v)(simple))


PASSES = (_structure, _static, _shapes, _dtypes, _attrs)


def _candidates(spec: dict) -> Iterator[dict]:
    for p in PASSES:
        yield from p(spec)


def minimise(spec: dict, outcome: Outcome, budget: int = 100,
             log: Callable[[str], None] = lambda m: None,
             check: Check | None = None) -> tuple[dict, Outcome]:
    """The smallest program found that fails like `outcome` (at most `budget` checks)."""
    check = check or runner.check
    want = _key(outcome)
    best, best_out = prune(spec), outcome
    tried: set[str] = set()
    progress = True
    while progress and budget > 0:
        progress = False
        for cand in _candidates(best):
            if budget <= 0:
                break
            text = json.dumps(cand, sort_keys=True)
            if text in tried:
                continue
            tried.add(text)
            if not _valid(cand):
                continue
            budget -= 1
            out = check(cand)
            if out.failed and _key(out) == want:
                best, best_out, progress = cand, out, True
                log(f"  minimise: {len(best['ops'])} ops, inputs "
                    f"{[(i['shape'], i['dtype']) for i in best['inputs']]}")
                break
    return best, best_out


def size(spec: dict) -> tuple[int, int, int]:
    """(ops, input elements at B=1, parameter elements): how big a program is."""
    def numel(shape) -> int:
        n = 1
        for d in shape:
            n *= 1 if d == "B" else d
        return n

    return (len(spec["ops"]), sum(numel(i["shape"]) for i in spec["inputs"]),
            sum(numel(p["shape"]) for p in spec["params"].values()))
