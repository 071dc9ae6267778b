"""Entry point of the ``kiln`` command: argument parsing, dispatch and error reporting.

Sub-commands: ``compile`` (here), ``run`` and ``inspect`` (:mod:`kiln.cli.commands`) and
``demo`` (:mod:`kiln.cli.demo`). A :class:`kiln.errors.KilnError` is printed in red as one line
and exits with status 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape

from kiln.errors import KilnError

__all__ = ["main", "build_parser"]

err_console = Console(stderr=True)


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
    c.set_defaults(func=lambda a: _lazy("kiln.cli.compile_cmd", "cmd_compile")(a))

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

    pr = sub.add_parser("profile", help="time each kernel of a package (CPU, or CUDA on a GPU)")
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

    g = sub.add_parser("generate", help="generate tokens with a prefill/decode package")
    g.add_argument("package", help="a package with entry points prefill and decode "
                                   "(kiln.models.hf_decoder.export_decoder)")
    g.add_argument("--prompt-ids", required=True, metavar="ID,ID,...", action="append",
                   help="the prompt's token ids, comma-separated; repeat it for several "
                        "prompts (a batched package: kiln.models.batched_decoder)")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (1: all)")
    g.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    g.add_argument("--stop", type=int, default=None, metavar="ID", help="stop at this token")
    g.add_argument("--threads", type=int, default=None, help="OpenMP threads per run")
    g.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (a CUDA package)")
    g.add_argument("--host-sampling", action="store_true",
                   help="on CUDA: sample on the host even when the package has a sample entry")
    g.add_argument("--repeat", type=int, default=1,
                   help="generate this many times, report the last (on CUDA the first run "
                        "captures the CUDA graphs)")
    g.add_argument("--json", action="store_true", help="tokens and timings as JSON")
    g.set_defaults(func=lambda a: _lazy("kiln.cli.generate_cmd", "cmd_generate")(a))

    d = sub.add_parser("demo", help="compile, run and check the bundled demo model")
    d.add_argument("--repeat", type=int, default=50, help="timed runs (median reported)")
    d.add_argument("--keep", metavar="DIR", help="keep the package in DIR")
    d.set_defaults(func=lambda a: _lazy("kiln.cli.demo", "cmd_demo")(a))


    f = sub.add_parser("fuzz", help="differential fuzzing against eager and the interpreter")
    f.add_argument("--n", type=int, default=100, help="programs to generate")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--start", type=int, default=0, help="index of the first program")
    f.add_argument("--out", default="tests/fuzz_regressions",
                   help="where minimised reproducers are written")
    f.add_argument("--max-ops", type=int, default=8)
    f.add_argument("--index-sort", type=float, default=0.3, metavar="P",
                   help="share of programs given scatters and sorts (kiln/fuzz/gen_index_sort.py)")
    f.add_argument("--no-minimise", action="store_true")
    f.add_argument("--no-interp", action="store_true", help="skip the Loop IR interpreter")
    f.add_argument("--bounded-dims", action="store_true",
                   help="declare every Dim with min and max (avoids known compile crashes)")
    f.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="stop starting programs after S seconds (the summary counts those run)")
    f.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="compile CUDA packages and run them on cuda:0 (eager on the CPU)")
    f.add_argument("--compile-only", action="store_true",
                   help="export, compile and save only (a CUDA package without a GPU)")
    f.add_argument("--verbose", "-v", action="store_true")
    f.set_defaults(func=lambda a: _lazy("kiln.cli.fuzz_cmd", "cmd_fuzz")(a))
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
