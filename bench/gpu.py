"""GPU latency of the zoo models in fp32: kiln (CUDA package) vs eager vs torch.compile.

For each model: kiln's compile time, then the median latency of one call (inputs already on the
GPU; each timed call ends with a device synchronise, so this is launch + run latency) for
kiln, eager and torch.compile (default mode), and kiln's max abs error against eager. Each
system is warmed up first; torch.compile's compile time is excluded. A failure is reported in
its cell and the others go on. Prints one markdown table last; --markdown FILE replaces the
section between <!-- gpu:begin --> and <!-- gpu:end --> in FILE with it.

    python bench/gpu.py [--models mlp,gpt] [--repeat 100] [--no-compile] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

BEGIN, END = "<!-- gpu:begin -->", "<!-- gpu:end -->"


def _median_ms(fn, repeat: int) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _cuda(x):
    return pytree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, x)


def bench_model(name: str, repeat: int, with_compile: bool) -> dict:
    import kiln
    from kiln.models import get

    spec = get(name)
    row: dict = {"model": name}
    args = _cuda(spec.make_inputs(7))
    ep = spec.export()  # on the CPU module and example inputs, as a user would
    module = copy.deepcopy(spec.module).cuda()
    with torch.no_grad():
        ref = pytree.tree_leaves(module(*args))
    try:
        t0 = time.perf_counter()
        cm = kiln.compile(ep, device="cuda")
        row["kiln_compile_s"] = time.perf_counter() - t0
        runner = cm.load(Path(tempfile.mkdtemp()) / f"{name}.kiln", device="cuda:0")
        got = pytree.tree_leaves(runner(*args))
        row["kiln_err"] = max((g - r).abs().max().item() for g, r in zip(got, ref))
        row["kernels"] = cm.report["kernels"]
        row["gemms"] = cm.report["extern_calls"]
        row["kiln_ms"] = _median_ms(lambda: runner(*args), repeat)
    except Exception as e:  # report and go on
        row["kiln_error"] = f"{type(e).__name__}: {e}"[:200]
        traceback.print_exc()
    with torch.no_grad():
        row["eager_ms"] = _median_ms(lambda: module(*args), repeat)
        if with_compile:
            try:
                compiled = torch.compile(module)
                t0 = time.perf_counter()
                compiled(*args)
                torch.cuda.synchronize()
                row["tc_compile_s"] = time.perf_counter() - t0
                row["tc_ms"] = _median_ms(lambda: compiled(*args), repeat)
            except Exception as e:  # report and go on
                row["tc_error"] = f"{type(e).__name__}: {e}"[:200]
    return row


def table(rows: list[dict]) -> str:
    def f(r, k, fmt="{:.3f}"):
        return fmt.format(r[k]) if k in r else "error" if k.split("_")[0] + "_error" in r else "-"
    out = [f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, fp32, latency "
           "per call (median, synchronised), lower is better.", "",
           "| model | kernels + GEMMs | kiln ms | eager ms | torch.compile ms | kiln vs eager | "
           "kiln vs torch.compile | kiln compile s | max abs err |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = lambda k: f"{r[k] / r['kiln_ms']:.2f}x" if "kiln_ms" in r and k in r else "-"  # noqa: E731
        out.append(f"| {r['model']} | {r.get('kernels', '-')} + {r.get('gemms', '-')} | "
                   f"{f(r, 'kiln_ms')} | {f(r, 'eager_ms')} | {f(r, 'tc_ms')} | "
                   f"{ratio('eager_ms')} | {ratio('tc_ms')} | {f(r, 'kiln_compile_s', '{:.1f}')} "
                   f"| {f(r, 'kiln_err', '{:.1e}')} |")
    errs = [f"- {r['model']}: {r[k]}" for r in rows for k in ("kiln_error", "tc_error") if k in r]
    return "\n".join(out + ([""] + errs if errs else []))


def main() -> None:
    from kiln.models import ALL_MODELS

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(ALL_MODELS))
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU")
    rows = []
    for name in a.models.split(","):
        rows.append(bench_model(name, a.repeat, not a.no_compile))
        print(rows[-1], flush=True)
    text = table(rows)
    if a.markdown:
        p = Path(a.markdown)
        doc = p.read_text() if p.exists() else ""
        block = f"{BEGIN}\n{text}\n{END}"
        if BEGIN in doc and END in doc:
            doc = doc[:doc.index(BEGIN)] + block + doc[doc.index(END) + len(END):]
        else:
            doc += f"\n## GPU (CUDA backend)\n\n{block}\n"
        p.write_text(doc)
    print(text)


if __name__ == "__main__":
    main()
