"""``kiln compile TARGET -o OUT``: export (for module targets), compile with per-stage
progress (and, inside long stages, the counts they report: C++ files and Triton kernels built,
GEMM candidates and launch configs timed), save, and print the compile report. The progress
display is drawn on a terminal only; piped or redirected output gets the report alone."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                           TextColumn, TimeElapsedColumn)
from rich.table import Table

import kiln
from kiln.api import export
from kiln.cli.manifest_view import fmt_bytes
from kiln.cli.targets import parse_dynamic, parse_options, resolve_target
from kiln.errors import InputError

__all__ = ["cmd_compile"]

console = Console()


def _make_options(pairs: list[str]) -> Any:

    opts = parse_options(pairs)
    if dataclasses.is_dataclass(kiln.Options):
        known = {f.name for f in dataclasses.fields(kiln.Options)}
        unknown = sorted(set(opts) - known)
        if unknown:
            raise InputError(f"unknown option(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
    try:
        return kiln.Options(**opts)
    except (TypeError, ValueError) as e:
        raise InputError(f"bad --option: {e}") from None


def _report_table(report: dict[str, Any], title: str) -> Table:

    table = Table(title=title, show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    if "compile_seconds" in report:
        table.add_row("compile time", f"{report['compile_seconds']:.2f} s")
    for name, secs in (report.get("stages") or {}).items():
        table.add_row(f"  {name}", f"{secs:.3f} s")
    if "kernels" in report:
        table.add_row("kernels", f"{report['kernels']} ({report.get('fused_kernels', '?')} "
                                 f"generated, {report.get('extern_calls', '?')} GEMM/library "
                                 f"calls)")
    arena, lower = report.get("arena_bytes"), report.get("lower_bound_bytes")
    if arena is not None:
        extra = f"  (lower bound {fmt_bytes(lower)}, {arena / lower:.2f}x)" if lower else ""
        table.add_row("arena", fmt_bytes(arena) + extra)
    return table


def _progress() -> Progress:
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=console, transient=True,
                    disable=not console.is_terminal)


class _Counts:
    """The progress display's second line: the counts the running stage reports
    (kiln.compile's `detail`), hidden between stages."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.task = progress.add_task("", total=None, visible=False)

    def __call__(self, stage: str, what: str, done: int, total: int) -> None:
        self.progress.update(self.task, description=f"  {stage}: {what}", completed=done,
                             total=max(total, 1), visible=True)

    def hide(self) -> None:
        self.progress.update(self.task, visible=False)


def cmd_compile(args: argparse.Namespace) -> int:
    """``kiln compile TARGET -o OUT``: each step a line of the progress display (loading,
    torch.export, then the compiler's stages counted as they run, saving)."""
    out = Path(args.output)
    t_start = time.perf_counter()
    with _progress() as progress:
        step = progress.add_task(f"loading {args.target}", total=None)
        target = resolve_target(args.target)
        options = _make_options(args.option)
        program = target.program
        if program is None:
            dyn = target.dynamic_shapes
            if args.dynamic:
                dyn = parse_dynamic(args.dynamic, target.example_args)
            progress.update(step, description=f"torch.export of {target.label}")
            program = export(target.module, target.example_args, target.example_kwargs, dyn,
                             what=target.label)
        elif args.dynamic:
            raise InputError("--dynamic applies to module targets; a .pt2 program already "
                             "carries its dynamic shapes")
        t_export = time.perf_counter() - t_start
        progress.remove_task(step)
        stages = progress.add_task("compiling", total=None)
        counts = _Counts(progress)

        def on_stage(name: str, k: int, n: int) -> None:
            counts.hide()
            progress.update(stages, description=f"compiling: {name}", completed=k, total=n)

        compiled = kiln.compile(program, device=args.device, options=options,
                                progress=on_stage, detail=counts)
        counts.hide()
        progress.update(stages, description=f"saving {out}")
        out.parent.mkdir(parents=True, exist_ok=True)
        compiled.save(str(out))
    report = dict(getattr(compiled, "report", {}) or {})
    console.print(_report_table(report, f"compiled {target.label}"))
    console.print(f"  load + export {t_export:.2f} s; total {time.perf_counter() - t_start:.2f} s")
    console.print(f"[green]wrote[/green] {out} ({out.stat().st_size / 1024:.1f} KiB)")
    return 0
