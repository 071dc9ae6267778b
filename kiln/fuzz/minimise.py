"""Shrinks a failing fuzz program while it keeps failing the same way.

Steps, each kept only when the candidate is still valid in eager and `check` still gives the
same failure signature (status and first line of the detail, minus numbers):
1. keep a single output; 2. drop dead ops, inputs and parameters; 3. bypass an op (its users
read one of its operands instead); 4. make a dynamic program static; 5. halve input dims.
Candidates that eager rejects cost no compile. `budget` bounds the number of compiles."""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from kiln.fuzz.program import FuzzModule, clone, make_inputs
from kiln.fuzz.runner import Outcome, check


def _key(o: Outcome) -> str:
    """What must stay the same: the status and where it failed (numbers elided)."""
    first = o.detail.splitlines()[0][:120] if o.detail else ""
    first = re.sub(r"B=\d+", "B=#", first)
    if o.status == "mismatch":  # where, not by how much
        first = first.split(" elements differ")[0].rsplit(":", 1)[0]
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
        return bool(spec["ops"])
    except Exception:
        return False


def _candidates(spec: dict):
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
    if spec.get("dynamic"):
        yield {**clone(spec), "dynamic": False}
    for i, inp in enumerate(spec["inputs"]):
        for d, size in enumerate(inp["shape"]):
            if size != "B" and size > 1:
                for new in sorted({1, size // 2}):
                    s = clone(spec)
                    s["inputs"][i]["shape"][d] = new
                    yield s


def minimise(spec: dict, outcome: Outcome, budget: int = 40,
             log: Callable[[str], None] = lambda m: None) -> tuple[dict, Outcome]:
    """The smallest program found that fails like `outcome` (at most `budget` compiles)."""
    want = _key(outcome)
    best, best_out = prune(spec), outcome
    progress = True
    while progress and budget > 0:
        progress = False
        for cand in _candidates(best):
            if budget <= 0:
                break
            if not _valid(cand):
                continue
            budget -= 1
            out = check(cand)
            if out.failed and _key(out) == want:
                best, best_out, progress = cand, out, True
                log(f"  minimise: {len(best['ops'])} ops, inputs "
                    f"{[i['shape'] for i in best['inputs']]}")
                break
    return best, best_out
