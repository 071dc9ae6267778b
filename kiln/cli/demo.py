"""``kiln demo``: compile the bundled demo model, run it from its package and compare with eager.

Prints compile time, latency (median, kiln vs eager), package size, arena bytes and peak RSS;
exits 1 if kiln's outputs do not match eager within the model's tolerances.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from kiln.cli.commands import flatten_outputs, time_calls
from kiln.cli.manifest_view import fmt_bytes
import kiln
from kiln.models import get

__all__ = ["cmd_demo", "peak_rss_bytes"]

console = Console()


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _max_abs_err(got: object, want: object) -> tuple[float, bool, str]:
    g, w = flatten_outputs(got), flatten_outputs(want)
    if len(g) != len(w):
        return float("inf"), False, f"{len(g)} outputs, eager has {len(w)}"
    worst, ok, why = 0.0, True, ""
    for a, b in zip(g, w):
        if a.shape != b.shape or a.dtype != b.dtype:
            return float("inf"), False, f"{tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
        worst = max(worst, float((a.double() - b.double()).abs().max()) if a.numel() else 0.0)
    return worst, ok, why


def interleaved(kiln_call, eager_call, repeat: int, warmup: int = 5):
    """Median seconds of each and the per-pair eager/kiln ratios, timing the two alternately
    after `warmup` untimed calls of each (eager's first calls are cold: allocator, thread
    pool), so load on a shared machine hits both alike."""
    for _ in range(warmup):
        kiln_call()
        eager_call()
    tk, te = [], []
    for _ in range(max(repeat, 1)):
        tk += time_calls(kiln_call, 1, warmup=0)
        te += time_calls(eager_call, 1, warmup=0)
    ratios = [e / k for k, e in zip(tk, te)]
    return statistics.median(tk), statistics.median(te), ratios


def cmd_demo(args: argparse.Namespace) -> int:
    """Compile ``zoo:demo``, save, load, check against eager and time both."""

    torch.manual_seed(0)
    spec = get("demo")
    tmp = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kiln-demo-"))
    tmp.mkdir(parents=True, exist_ok=True)
    pkg = tmp / "demo.kiln"
    console.print(f"[bold]kiln demo[/bold]: {spec.name} "
                  f"({sum(p.numel() for p in spec.module.parameters()):,} parameters, "
                  f"input {tuple(spec.example_args[0].shape)}, dynamic batch)")
    with console.status("compiling ..."):
        compiled = kiln.compile(spec.module, spec.example_args,
                                dynamic_shapes=spec.dynamic_shapes)
        compiled.save(str(pkg))
    with console.status("loading and running ..."):
        runner = kiln.load(str(pkg))
        checks = []
        with torch.no_grad():
            for seed, sizes in ((0, {}), (1, {"batch": 1}), (2, {"batch": 200})):
                x = spec.make_inputs(seed, **sizes)
                got, want = runner(*x), spec.module(*x)
                err, same, why = _max_abs_err(got, want)
                ok = same and all(torch.allclose(a.double(), b.double(), rtol=spec.rtol,
                                                 atol=spec.atol)
                                  for a, b in zip(flatten_outputs(got), flatten_outputs(want)))
                checks.append((tuple(x[0].shape), err, ok, why))
            x = spec.example_args
            t_kiln, t_eager, ratios = interleaved(lambda: runner(*x), lambda: spec.module(*x),
                                                  args.repeat)
    report = dict(getattr(compiled, "report", {}) or {})
    table = Table(show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    if "compile_seconds" in report:
        table.add_row("compile time", f"{report['compile_seconds']:.2f} s")
    if "kernels" in report:
        table.add_row("kernels", str(report["kernels"]))
    for shape, err, ok, why in checks:
        mark = "[green]match[/green]" if ok else f"[red]MISMATCH[/red] {why}"
        table.add_row(f"input {shape}", f"max abs error {err:.2e}  {mark}")
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    table.add_row("latency (median)", f"kiln {t_kiln * 1e3:.3f} ms, eager {t_eager * 1e3:.3f} ms")
    table.add_row("speed-up over eager", f"{statistics.median(ratios):.2f}x (median of "
                  f"{len(ratios)} interleaved pairs after warm-up; middle half "
                  f"{q[0]:.2f}x to {q[2]:.2f}x)")
    where = str(pkg) if args.keep else "deleted; keep it with --keep DIR"
    table.add_row("package", f"{fmt_bytes(pkg.stat().st_size)} ({where})")
    arena, lower = report.get("arena_bytes"), report.get("lower_bound_bytes")
    if arena is not None:
        table.add_row("arena", fmt_bytes(arena) + (f" (lower bound {fmt_bytes(lower)})"
                                                   if lower is not None else ""))
    table.add_row("peak RSS", fmt_bytes(peak_rss_bytes()))
    console.print(table)
    if not args.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    if not all(ok for *_, ok, _ in checks):
        console.print("[bold red]kiln's output does not match eager[/bold red]")
        return 1
    console.print("[bold green]ok[/bold green]")
    return 0
