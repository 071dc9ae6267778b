"""OpInfo sweep: every OpInfo of torch's own `op_db` whose op is in the core ATen set runs
through kiln on the CPU, on the OpInfo's own sample inputs, and is compared with eager.

Each sample is one verdict: pass (kiln's own kernels), aten (passes through the ATen fallback:
the package needs libtorch), unsupported (kiln said so clearly: UnsupportedError), export
(torch.export itself refused the sample), wrong (kiln's answer differs from eager: a bug) or
error (kiln failed in another way: a bug). Writes a markdown table (docs/coverage.md by default).

    python bench/opinfo_sweep.py                    # float32, then other dtypes
    python bench/opinfo_sweep.py --ops add,softmax --samples 2 --out /tmp/coverage.md
    python bench/opinfo_sweep.py --dtypes float16,bfloat16 --out /tmp/half.md
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

# outputs are uninitialised memory or random: nothing to compare with eager
NONDETERMINISTIC = {"empty", "empty_strided", "empty_like", "new_empty", "randn", "rand",
                    "randint", "bernoulli", "normal", "uniform", "multinomial"}
SECOND_PASS = (torch.float64, torch.int64, torch.int32, torch.bool)
MARKER = "<!-- hand-written sections below: kept when bench/opinfo_sweep.py rewrites this file -->"
VERDICTS = ("pass", "aten", "unsupported", "export", "wrong", "error")
# 16-bit floats (--dtypes float16,bfloat16): eager rounds each op to the half type, and so does
# kiln; two units in the last place allow for a different float32 evaluation order
HALF_TOL = {torch.float16: {"rtol": 2 * 2.0 ** -10, "atol": 1e-3},
            torch.bfloat16: {"rtol": 2 * 2.0 ** -7, "atol": 1e-2}}


def core_aten_names() -> set[str]:
    names = set()
    for name in dir(torch.ops.aten):
        try:
            packet = getattr(torch.ops.aten, name)
            if any(torch.Tag.core in getattr(packet, ov).tags for ov in packet.overloads()):
                names.add(name)
        except (AttributeError, RuntimeError):
            continue
    return names


def selected_ops(filter_names: set[str] | None):
    from torch.testing._internal.common_methods_invocations import op_db

    core = core_aten_names()
    out = [o for o in op_db if (o.name.split(".")[0] in core or (o.aten_name or "") in core)
           and o.name not in NONDETERMINISTIC]
    if filter_names:
        out = [o for o in out if o.name in filter_names]
    return out


class _Call(torch.nn.Module):
    """Calls the op with the sample's tensors as inputs and everything else closed over."""

    def __init__(self, op, structure, leaves_are_tensor):
        super().__init__()
        self.op, self.structure, self.is_tensor = op, structure, leaves_are_tensor
        self.constants = None

    def forward(self, *tensors):
        it = iter(tensors)
        leaves = [next(it) if t else c for t, c in zip(self.is_tensor, self.constants)]
        inp, args, kwargs = pytree.tree_unflatten(leaves, self.structure)
        return self.op(inp, *args, **kwargs)


def _module(op, sample):
    leaves, structure = pytree.tree_flatten((sample.input, tuple(sample.args),
                                             dict(sample.kwargs)))
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    m = _Call(op.op, structure, is_tensor)
    m.constants = leaves
    return m, tuple(x for x in leaves if isinstance(x, torch.Tensor))


def _close(got, want) -> bool:
    g, w = pytree.tree_leaves(got), pytree.tree_leaves(want)
    if len(g) != len(w):
        return False
    for a, b in zip(g, w):
        if not isinstance(b, torch.Tensor):
            b = torch.tensor(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        tol = HALF_TOL.get(b.dtype, {"rtol": 1e-4, "atol": 1e-4}) if b.is_floating_point() \
            else {"rtol": 0, "atol": 0}
        try:
            torch.testing.assert_close(a, b, equal_nan=True, **tol)
        except AssertionError:
            return False
    return True


def run_sample(op, sample, workdir: Path) -> tuple[str, str]:
    import kiln

    m, tensors = _module(op, sample)
    try:
        ep = torch.export.export(m, tensors)
    except Exception as e:  # noqa: BLE001 - torch.export refusing a sample is a verdict
        return "export", f"{type(e).__name__}: {str(e)[:120]}"
    try:
        cm = kiln.compile(ep)
        runner = cm.load(workdir / "m.kiln")
        got = runner(*[t.contiguous() for t in tensors])
        aten = cm.manifest["requires"]["aten_fallback_ops"]
    except kiln.errors.UnsupportedError as e:
        return "unsupported", str(e)[:160]
    except Exception as e:  # noqa: BLE001 - any other failure is a kiln bug to report
        return "error", f"{type(e).__name__}: {str(e)[:160]}"
    with torch.no_grad():
        want = m(*tensors)
    if not _close(got, want):
        return "wrong", "differs from eager"
    return ("aten", "ATen fallback: " + ", ".join(aten)) if aten else ("pass", "")


def _lookup(key: tuple[str, str]):
    from torch.testing._internal.common_methods_invocations import op_db

    return next(o for o in op_db if (o.name, o.variant_test_name) == key)


def sweep_op(job) -> tuple[str, str, Counter, list[str]]:
    key, dtype, n_samples = job
    op = _lookup(key)
    counts: Counter = Counter()
    notes: list[str] = []
    if dtype not in op.supported_dtypes("cpu"):
        return op.name, str(dtype), counts, notes
    with tempfile.TemporaryDirectory() as d:
        try:
            samples = list(op.sample_inputs("cpu", dtype))[:n_samples]
        except Exception as e:  # noqa: BLE001
            return op.name, str(dtype), counts, [f"no samples: {e}"]
        for s in samples:
            try:
                verdict, note = run_sample(op, s, Path(d))
            except Exception:  # noqa: BLE001
                verdict, note = "error", traceback.format_exc(limit=1)[-160:]
            counts[verdict] += 1
            if note and verdict not in ("pass", "aten") and note not in notes:
                notes.append(note)
    return op.name, str(dtype).removeprefix("torch."), counts, notes


def write_markdown(rows, path: Path, seconds: float) -> None:
    total = Counter()
    for *_, c, _ in rows:
        total.update(c)
    n = sum(total.values())
    exportable = max(n - total["export"], 1)
    lines = ["# Operator coverage (OpInfo sweep)", "",
             "Produced by `python bench/opinfo_sweep.py` (torch's own OpInfo samples for every",
             "OpInfo whose op is a core ATen op; CPU). Verdicts: pass (kiln's own kernels); aten",
             "(right answer through the ATen fallback: the package needs libtorch); unsupported",
             "(a clear `UnsupportedError`); export (torch.export refused the sample); wrong (a",
             "different answer: a bug); error (another failure: a bug). Random ops (rand, randn,",
             "randint, bernoulli, normal, uniform) are left out: kiln's generator is not torch's;",
             "they are checked statistically in tests/ops/test_ops_random.py.", "",
             f"Samples: {n}; " + ", ".join(f"{v}: {total[v]}" for v in VERDICTS) +
             f"; pass rate {100 * (total['pass'] + total['aten']) / exportable:.1f}%"
             f" of exportable samples ({100 * total['pass'] / exportable:.1f}% "
             f"without the ATen fallback); {seconds:.0f} s.", "",
             "| op | dtype | pass | aten | unsupported | export | wrong | error | first note |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, dtype, c, notes in rows:
        if not sum(c.values()):
            continue
        note = notes[0].replace("|", "/").replace("\n", " ") if notes else ""
        lines.append(f"| {name} | {dtype} | " + " | ".join(str(c[v]) for v in VERDICTS) +
                     f" | {note} |")
    kept = ""
    if path.exists() and MARKER in path.read_text():  # hand-written sections stay
        kept = "\n" + MARKER + path.read_text().split(MARKER, 1)[1]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n" + kept)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", default="", help="comma-separated OpInfo names")
    ap.add_argument("--samples", type=int, default=3, help="samples per op and dtype")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--no-second-pass", action="store_true")
    ap.add_argument("--dtypes", default="", help="comma-separated dtypes to sweep instead of "
                    "float32 then the second pass (e.g. float16,bfloat16)")
    ap.add_argument("--out", default="docs/coverage.md")
    a = ap.parse_args()
    ops = selected_ops(set(a.ops.split(",")) if a.ops else None)
    keys = [(op.name, op.variant_test_name) for op in ops]
    jobs = [(k, torch.float32, a.samples) for k in keys]
    if a.dtypes:
        jobs = [(k, getattr(torch, dt), a.samples) for dt in a.dtypes.split(",") for k in keys]
    elif not a.no_second_pass:
        jobs += [(k, dt, a.samples) for k in keys for dt in SECOND_PASS]
    t0 = time.time()
    with mp.get_context("spawn").Pool(a.jobs) as pool:
        rows = []
        for row in pool.imap(sweep_op, jobs):
            rows.append(row)
            if sum(row[2].values()):
                print(row[0], row[1], dict(row[2]), flush=True)
    write_markdown(rows, Path(a.out), time.time() - t0)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
