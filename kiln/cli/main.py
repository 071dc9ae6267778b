"""Entry point of the ``kiln`` command: argument parsing, dispatch and error reporting.

Sub-commands: ``compile`` (here), ``run`` and ``inspect`` (:mod:`kiln.cli.commands`) and
``demo`` (:mod:`kiln.cli.demo`). A :class:`kiln.errors.KilnError` is printed in red as one line
and exits with status 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console
from rich.table import Table

from kiln.errors import InputError, KilnError
import kiln
from kiln.cli.targets import parse_options
from kiln.cli.manifest_view import fmt_bytes
from kiln.cli.targets import parse_dynamic, resolve_target
from kiln.cli.fuzz_cmd import add_parser as add_fuzz
import importlib
import os
import torch
from rich.markup import escape

__all__ = ["main", "build_parser"]

console = Console()
err_console = Console(stderr=True)


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


def cmd_compile(args: argparse.Namespace) -> int:
    """``kiln compile TARGET -o OUT``."""

    out = Path(args.output)
    t_start = time.perf_counter()
    with console.status(f"loading {args.target} ...") as status:
        target = resolve_target(args.target)
        options = _make_options(args.option)
        program = target.program
        if program is None:
            dyn = target.dynamic_shapes
            if args.dynamic:
                dyn = parse_dynamic(args.dynamic, target.example_args)
            status.update("exporting with torch.export ...")
            program = kiln.api.export(target.module, target.example_args,
                                      target.example_kwargs, dyn, what=target.label)
        elif args.dynamic:
            raise InputError("--dynamic applies to module targets; a .pt2 program already "
                             "carries its dynamic shapes")
        t_export = time.perf_counter() - t_start
        status.update("compiling (lower, schedule, plan, generate, build C++) ...")
        kwargs: dict[str, Any] = {"device": args.device, "options": options}
        if "progress" in inspect.signature(kiln.compile).parameters:
            kwargs["progress"] = lambda stage, *_: status.update(f"compiling: {stage} ...")
        compiled = kiln.compile(program, **kwargs)
        status.update(f"saving {out} ...")
        out.parent.mkdir(parents=True, exist_ok=True)
        compiled.save(str(out))
    report = dict(getattr(compiled, "report", {}) or {})
    console.print(_report_table(report, f"compiled {target.label}"))
    console.print(f"  load + export {t_export:.2f} s; total {time.perf_counter() - t_start:.2f} s")
    console.print(f"[green]wrote[/green] {out} ({out.stat().st_size / 1024:.1f} KiB)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``kiln`` argument parser with its four sub-commands."""
    p = argparse.ArgumentParser(prog="kiln", description="Ahead-of-time compiler for PyTorch.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("compile", help="compile a model into a .kiln package")
    c.add_argument("target", help="zoo:NAME, path/file.py:factory or a torch.export .pt2 file")
    c.add_argument("-o", "--output", required=True, help="package to write (e.g. model.kiln)")
    c.add_argument("--dynamic", action="append", default=[], metavar="ARG.DIM=NAME[:MIN:MAX]",
                   help="mark a dimension dynamic, e.g. 0.0=batch:1:64 (repeatable; replaces "
                        "the factory's dynamic_shapes)")
    c.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a kiln.Options field, e.g. num_threads=2 (repeatable)")
    c.add_argument("--device", default="cpu", help="target device (default cpu)")
    c.set_defaults(func=cmd_compile)

    r = sub.add_parser("run", help="run a package on given or random inputs")
    r.add_argument("package")
    src = r.add_mutually_exclusive_group()
    src.add_argument("--inputs", metavar="FILE.safetensors",
                     help="inputs by name (or by position as keys 0, 1, ...)")
    src.add_argument("--random", action="store_true",
                     help="random inputs from the manifest (the default)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--repeat", type=int, default=10, help="timed runs (median reported)")
    r.add_argument("--show", type=int, default=6, help="values to print per output")
    r.set_defaults(func=lambda a: _lazy("kiln.cli.commands", "cmd_run")(a))

    i = sub.add_parser("inspect", help="summarise a package's manifest")
    i.add_argument("package")
    i.add_argument("--manifest", action="store_true", help="print the whole manifest.json")
    i.add_argument("--kernels", action="store_true", help="list every kernel and its ops")
    i.add_argument("--memory", action="store_true", help="the memory plan in detail")
    i.add_argument("--json", action="store_true", help="machine-readable summary")
    i.add_argument("--png", metavar="PATH", help="draw the memory timeline (needs matplotlib)")
    i.add_argument("--html", metavar="PATH", help="write the HTML report (no profiling run)")
    i.set_defaults(func=lambda a: _lazy("kiln.cli.commands", "cmd_inspect")(a))

    pr = sub.add_parser("profile", help="time each kernel of a CPU package")
    pr.add_argument("package")
    pr.add_argument("--repeat", type=int, default=20, help="timed runs (medians reported)")
    pr.add_argument("--seed", type=int, default=0)
    pr.add_argument("--json", action="store_true", help="machine-readable times")
    pr.set_defaults(func=lambda a: _lazy("kiln.cli.commands", "cmd_profile")(a))

    rp = sub.add_parser("report", help="write a self-contained HTML report of a package")
    rp.add_argument("package")
    rp.add_argument("-o", "--output", metavar="PATH", help="HTML file (default PKG.html)")
    rp.add_argument("--no-profile", action="store_true", help="skip the profiling run")
    rp.add_argument("--repeat", type=int, default=20, help="profiling runs")
    rp.set_defaults(func=lambda a: _lazy("kiln.cli.commands", "cmd_report")(a))

    d = sub.add_parser("demo", help="compile, run and check the bundled demo model")
    d.add_argument("--repeat", type=int, default=50, help="timed runs (median reported)")
    d.add_argument("--keep", metavar="DIR", help="keep the package in DIR")
    d.set_defaults(func=lambda a: _lazy("kiln.cli.demo", "cmd_demo")(a))


    add_fuzz(sub)
    return p


def _lazy(module: str, name: str) -> Any:

    return getattr(importlib.import_module(module), name)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``kiln`` command; returns (and, as a console script, exits with) its status."""
    args = build_parser().parse_args(argv)
    if args.debug:  # compiler crashes propagate as they are, with their traceback
        os.environ["KILN_DEBUG"] = "1"
    try:
        return int(args.func(args) or 0)
    except KilnError as e:
        if args.debug:
            raise

        err_console.print(f"[bold red]error:[/bold red] [red]{type(e).__name__}: "
                          f"{escape(str(e))}[/red]", highlight=False, soft_wrap=True)
        return 2
    except KeyboardInterrupt:
        err_console.print("[red]interrupted[/red]")
        return 130
    except BrokenPipeError:  # e.g. `kiln inspect --json | head`

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
