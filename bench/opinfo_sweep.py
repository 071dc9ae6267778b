"""OpInfo sweep: every OpInfo of torch's own `op_db` whose op is in the core ATen set runs
through kiln on the CPU, on the OpInfo's own sample inputs, and is compared with eager.

Each sample is one verdict: pass (kiln's own kernels), aten (passes through the ATen fallback:
the package needs libtorch), unsupported (kiln said so clearly: UnsupportedError), export
(torch.export itself refused the sample), wrong (kiln's answer differs from eager: a bug) or
error (kiln failed in another way: a bug). Writes a markdown table (docs/coverage.md by default).

    python bench/opinfo_sweep.py                    # float32, then other dtypes
    python bench/opinfo_sweep.py --ops add,softmax --samples 2 --out /tmp/coverage.md
    python bench/opinfo_sweep.py --dtypes float16,bfloat16,complex64,complex128 \
        --jsonl /tmp/lowp.jsonl --budget 3000     # the dtype sweep: float64 references

With --dtypes, low-precision and complex samples are judged against a float64 / complex128
computation of the same op on the upcast inputs (see `_judged`; the rule is stated in
docs/coverage.md), results are appended per op to --jsonl (a rerun skips what is there, so a
sweep can be resumed or split with --shard i/n), and the per-dtype table is written into the
hand-written part of --out between DTYPE_BEGIN and DTYPE_END.
"""

from __future__ import annotations

import argparse
import json
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
# the dtype sweep (--dtypes): each sample's float64 / complex128 reference
WIDE = {torch.float16: torch.float64, torch.bfloat16: torch.float64, torch.float32: torch.float64,
        torch.float64: torch.float64, torch.complex32: torch.complex128,
        torch.complex64: torch.complex128, torch.complex128: torch.complex128}
# torch.testing.assert_close's default tolerances per output dtype: the floor of the bound
FLOOR = {torch.float16: (1e-3, 1e-5), torch.bfloat16: (1.6e-2, 1e-5),
         torch.float32: (1.3e-6, 1e-5), torch.float64: (1e-7, 1e-7),
         torch.complex32: (1e-3, 1e-5), torch.complex64: (1.3e-6, 1e-5),
         torch.complex128: (1e-7, 1e-7)}
DTYPE_BEGIN = "<!-- dtype sweep: written by bench/opinfo_sweep.py --dtypes -->"
DTYPE_END = "<!-- end of dtype sweep -->"


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


def _widened(op, sample):
    """The sample with every floating / complex tensor upcast to float64 / complex128 (index
    tensors and dtype arguments untouched): the reference computation."""
    def up(x):
        if isinstance(x, torch.Tensor) and x.dtype in WIDE:
            return x.detach().to(WIDE[x.dtype])
        return x
    leaves, structure = pytree.tree_flatten((sample.input, tuple(sample.args),
                                             dict(sample.kwargs)))
    inp, args, kwargs = pytree.tree_unflatten([up(x) for x in leaves], structure)
    return op.op(inp, *args, **kwargs)


def _judged(got, want, ref) -> str:
    """'' when kiln's output `got` is right, else why not. Elementwise, with r the float64
    reference, w eager and g kiln (all upcast): right when g == w (NaN == NaN), or g equals r
    rounded to the output dtype (also for inf / NaN), or both g and r are finite and
    |g - r| <= 2 |w - r| + rtol |r| + atol (rtol, atol: torch.testing's defaults for the
    output dtype; a non-finite eager value counts as no allowance). Integer and bool outputs
    must equal eager's."""
    g_, w_ = pytree.tree_leaves(got), pytree.tree_leaves(want)
    r_ = pytree.tree_leaves(ref) if ref is not None else [None] * len(w_)
    if len(g_) != len(w_) or len(r_) != len(w_):
        return f"{len(g_)} outputs, eager has {len(w_)}"
    for i, (g, w, r) in enumerate(zip(g_, w_, r_)):
        if not isinstance(w, torch.Tensor):
            w = torch.tensor(w)
        if not isinstance(g, torch.Tensor):
            g = torch.tensor(g)
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"output {i}: {g.dtype}{list(g.shape)}, eager {w.dtype}{list(w.shape)}"
        if not (w.is_floating_point() or w.is_complex()):
            if not torch.equal(g, w):
                return f"output {i}: {int((g != w).sum())} of {w.numel()} elements differ"
            continue
        wide = WIDE[w.dtype]
        if not isinstance(r, torch.Tensor) or r.shape != w.shape:
            r = w  # no reference of this output: eager's own value
        gw, ww, rw = g.to(wide), w.to(wide), r.to(wide)
        rl = r.to(w.dtype).to(wide)
        ok = (gw == ww) | (gw.isnan() & ww.isnan()) | (gw == rl) | (gw.isnan() & rw.isnan())
        rtol, atol = FLOOR[w.dtype]
        e_w = (ww - rw).abs().nan_to_num(nan=0.0, posinf=0.0)
        e_w = torch.where(ww.isfinite(), e_w, torch.zeros_like(e_w))
        bound = 2 * e_w + rtol * rw.abs() + atol
        fin = gw.isfinite() & rw.isfinite()
        ok |= fin & ((gw - rw).abs() <= bound)
        if not bool(ok.all()):
            bad = (~ok).nonzero()[0].tolist()
            j = tuple(bad)
            return (f"output {i}: {int((~ok).sum())} of {w.numel()} elements wrong, e.g. {j}: "
                    f"kiln {g[j].item() if g.dim() else g.item()}, "
                    f"eager {w[j].item() if w.dim() else w.item()}, "
                    f"float64 {r[j].item() if r.dim() else r.item()}")
    return ""


def run_sample(op, sample, workdir: Path, reference: bool = False) -> tuple[str, str]:
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
    if reference:
        try:
            with torch.no_grad():
                ref = _widened(op, sample)
        except Exception:  # noqa: BLE001 - no float64 kernel: eager is the reference
            ref = None
        why = _judged(got, want, ref)
        if why:
            return "wrong", why
    elif not _close(got, want):
        return "wrong", "differs from eager"
    return ("aten", "ATen fallback: " + ", ".join(aten)) if aten else ("pass", "")


def _lookup(key: tuple[str, str]):
    from torch.testing._internal.common_methods_invocations import op_db

    return next(o for o in op_db if (o.name, o.variant_test_name) == key)


def sweep_op(job) -> tuple[str, str, Counter, list[str]]:
    key, dtype, n_samples = job[:3]
    reference = len(job) > 3 and job[3]
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
                verdict, note = run_sample(op, s, Path(d), reference)
            except Exception:  # noqa: BLE001
                verdict, note = "error", traceback.format_exc(limit=1)[-160:]
            counts[verdict] += 1
            if note and verdict not in ("pass", "aten") and note not in notes:
                notes.append(note)
    return op.name, str(dtype).removeprefix("torch."), counts, notes


def sweep_op_samples(job) -> dict:
    """The dtype sweep's job: one op and dtype, each sample judged against float64."""
    key, dtype, n_samples = job
    op = _lookup(key)
    row = {"op": op.name, "variant": op.variant_test_name,
           "dtype": str(dtype).removeprefix("torch."), "samples": []}
    if dtype not in op.supported_dtypes("cpu"):
        return row
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        try:
            samples = list(op.sample_inputs("cpu", dtype))[:n_samples]
        except Exception as e:  # noqa: BLE001
            row["samples"].append(["error", f"no samples: {str(e)[:160]}"])
            return row
        for s in samples:
            try:
                verdict, note = run_sample(op, s, Path(d), reference=True)
            except Exception:  # noqa: BLE001
                verdict, note = "error", traceback.format_exc(limit=1)[-160:]
            row["samples"].append([verdict, note])
    row["seconds"] = round(time.time() - t0, 1)
    return row


def _refusal_class(note: str) -> str:
    """A short class for a refusal note: its text up to the first detail (a node name, a
    parenthesis, a colon)."""
    cut = min([note.find(c) for c in (" of node", " (", ": ", "; ") if c in note] + [80])
    return note[:cut]


def write_dtype_markdown(rows: list[dict], path: Path, command: str) -> None:
    """The per-dtype table and the remaining refusals, between DTYPE_BEGIN and DTYPE_END of
    path's hand-written part (appended there the first time)."""
    by_dtype: dict[str, Counter] = {}
    bad: list[str] = []
    classes: Counter = Counter()
    for r in rows:
        c = by_dtype.setdefault(r["dtype"], Counter())
        for verdict, note in r["samples"]:
            c[verdict] += 1
            if verdict not in ("pass", "aten", "export"):
                name = r["op"] + (f".{r['variant']}" if r["variant"] else "")
                bad.append(f"| {name} | {r['dtype']} | {verdict} | "
                           f"{note.replace('|', '/').replace(chr(10), ' ')[:200]} |")
            if verdict in ("unsupported", "error"):
                classes[(verdict, r["dtype"], _refusal_class(note))] += 1
    lines = [DTYPE_BEGIN, "", f"Command: `{command}`", "",
             "| dtype | samples | passed (kiln) | passed (ATen fallback) | refused | wrong | "
             "error | export failed | passed % of samples | passed % of exportable |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for dt, c in by_dtype.items():
        n = sum(c.values())
        if not n:
            continue
        ok = c["pass"] + c["aten"]
        lines.append(f"| {dt} | {n} | {c['pass']} | {c['aten']} | {c['unsupported']} | "
                     f"{c['wrong']} | {c['error']} | {c['export']} | {100 * ok / n:.1f} | "
                     f"{100 * ok / max(n - c['export'], 1):.1f} |")
    lines += ["", "Samples not passed (one line each; export failures are torch's and left out):",
              "", "| op | dtype | verdict | note |", "| --- | --- | --- | --- |", *bad, "",
              "Refusals and errors by class:", "", "| verdict | dtype | class | samples |",
              "| --- | --- | --- | --- |"]
    lines += [f"| {v} | {dt} | {k.replace('|', '/')} | {n} |"
              for (v, dt, k), n in classes.most_common()]
    lines += ["", DTYPE_END]
    block = "\n".join(lines)
    text = path.read_text() if path.exists() else ""
    if DTYPE_BEGIN in text and DTYPE_END in text:
        head, rest = text.split(DTYPE_BEGIN, 1)
        text = head + block + rest.split(DTYPE_END, 1)[1]
    else:
        text = text + ("" if MARKER in text else "\n" + MARKER + "\n") + "\n" + block + "\n"
    path.write_text(text)


def dtype_sweep(a, keys) -> None:
    """--dtypes: one JSON line per op and dtype in a.jsonl; stops submitting after a.budget s."""
    out = Path(a.jsonl)
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            r = json.loads(line)
            done.add((r["op"], r["variant"], r["dtype"]))
    jobs = [(k, getattr(torch, dt), a.samples) for dt in a.dtypes.split(",") for k in keys
            if (*k, dt) not in done]
    i, n = (int(x) for x in a.shard.split("/"))
    jobs = jobs[i::n]
    t0 = time.time()
    with mp.get_context("spawn").Pool(a.jobs, maxtasksperchild=20) as pool, out.open("a") as f:
        for row in pool.imap_unordered(sweep_op_samples, jobs):
            f.write(json.dumps(row) + "\n")
            f.flush()
            if row["samples"]:
                print(row["op"], row["variant"], row["dtype"],
                      dict(Counter(v for v, _ in row["samples"])), row.get("seconds"), flush=True)
            if a.budget and time.time() - t0 > a.budget:
                print(f"budget of {a.budget} s spent: stopping (rerun to resume)")
                pool.terminate()
                break
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    order = {dt: j for j, dt in enumerate(a.dtypes.split(","))}
    rows.sort(key=lambda r: order.get(r["dtype"], 99))
    write_dtype_markdown(rows, Path(a.out), a.command or
                         "python bench/opinfo_sweep.py --dtypes " + a.dtypes)
    print(f"wrote {a.out}")


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
    ap.add_argument("--jsonl", default="bench/results/opinfo_dtypes.jsonl",
                    help="--dtypes: results, one line per op and dtype (a rerun resumes)")
    ap.add_argument("--budget", type=float, default=0, help="--dtypes: seconds, then stop")
    ap.add_argument("--shard", default="0/1", help="--dtypes: i/n, every n-th job from i")
    ap.add_argument("--command", default="", help="--dtypes: the command named in --out")
    a = ap.parse_args()
    ops = selected_ops(set(a.ops.split(",")) if a.ops else None)
    keys = [(op.name, op.variant_test_name) for op in ops]
    if a.dtypes:
        Path(a.jsonl).parent.mkdir(parents=True, exist_ok=True)
        dtype_sweep(a, keys)
        return
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
