"""``kiln run`` and ``kiln inspect``: execute a package, and summarise its manifest."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kiln.cli.manifest_view import (cpu_summary, entries, fmt_bytes, fmt_shape, kwarg_names,
                                    memory_summary, plan_summary, random_inputs, read_manifest,
                                    split_args, symbols)
from kiln.errors import InputError
import kiln
from kiln.cli.plots import memory_timeline
from kiln.cli.profile import profile_package
from kiln.cli.report import render_report
from safetensors.torch import load_file

__all__ = ["cmd_run", "cmd_inspect", "cmd_profile", "cmd_report", "flatten_outputs",
           "time_calls"]

console = Console()


def flatten_outputs(out: Any) -> list[torch.Tensor]:
    """Every tensor of an output pytree, in order (scalars become 0-d tensors)."""
    leaves, _ = torch.utils._pytree.tree_flatten(out)
    return [x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in leaves]


def time_calls(fn: Any, repeat: int, warmup: int = 1) -> list[float]:
    """Seconds taken by each of ``repeat`` calls of ``fn()`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(repeat, 1)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def _load_inputs(path: str, manifest: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:

    if not Path(path).is_file():
        raise InputError(f"inputs file {path!r} does not exist")
    tensors = load_file(path)
    specs = entries(manifest.get("inputs"))
    if not specs:  # no manifest description: positional keys 0, 1, ...
        keys = sorted(tensors, key=lambda k: (not k.isdigit(), k.zfill(9)))
        return [tensors[k] for k in keys], {}
    flat = []
    for i, spec in enumerate(specs):
        name = str(spec.get("name", i))
        key = name if name in tensors else str(i)
        if key not in tensors:
            raise InputError(f"{path!r} has no tensor for input {i} ({name!r}); "
                             f"it holds {', '.join(sorted(tensors)) or 'nothing'}")
        flat.append(tensors[key])
    return split_args(manifest, flat, kwarg_names(manifest))


def cmd_run(args: argparse.Namespace) -> int:
    """``kiln run PKG``: load, run on inputs, print outputs and the median latency."""

    with console.status(f"loading {args.package} ..."):
        runner = kiln.load(args.package)
    manifest = dict(getattr(runner, "manifest", None) or read_manifest(args.package))
    if args.inputs:
        call_args, call_kwargs = _load_inputs(args.inputs, manifest)
        source = args.inputs
    else:
        call_args, call_kwargs = random_inputs(manifest, args.seed)
        source = f"random (seed {args.seed})"
    console.print(f"inputs: {source}")
    for i, t in enumerate(list(call_args) + list(call_kwargs.values())):
        console.print(f"  [{i}] {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}")
    with torch.no_grad():
        out = runner(*call_args, **call_kwargs)
        times = time_calls(lambda: runner(*call_args, **call_kwargs), args.repeat)
    table = Table(title="outputs")
    for col in ("#", "shape", "dtype", "first values"):
        table.add_column(col)
    for i, t in enumerate(flatten_outputs(out)):
        vals = t.detach().reshape(-1)[: args.show].tolist()
        shown = ", ".join(f"{v:.5g}" if isinstance(v, float) else str(v) for v in vals)
        more = ", ..." if t.numel() > args.show else ""
        table.add_row(str(i), str(tuple(t.shape)), str(t.dtype).removeprefix("torch."),
                      escape(f"[{shown}{more}]"))
    console.print(table)
    med = statistics.median(times)
    console.print(f"latency: median {med * 1e3:.3f} ms over {len(times)} runs "
                  f"(min {min(times) * 1e3:.3f} ms)")
    return 0


def _summary(manifest: dict[str, Any], package: str) -> dict[str, Any]:
    weights = entries(manifest.get("weights"))
    wbytes = sum(int(w.get("nbytes", w.get("bytes", 0)) or 0) for w in weights)
    return {
        "package": package,
        "package_bytes": Path(package).stat().st_size if Path(package).is_file() else None,
        "inputs": entries(manifest.get("inputs")),
        "outputs": entries(manifest.get("outputs")),
        "symbols": symbols(manifest),
        "weights": {"count": len(weights), "bytes": wbytes},
        "kernels": entries(manifest.get("kernels")),
        "gemms": [{"name": k.get("name"), **k["gemm"]} for k in entries(manifest.get("kernels"))
                  if isinstance(k.get("gemm"), dict)],
        "plan": plan_summary(manifest),
        "cpu": cpu_summary(manifest),
        # every entry point (a package of one program: "forward") and the state they share
        "entry_points": [{"name": e.get("name"), "library": e.get("library"),
                          "inputs": entries(e.get("inputs")),
                          "outputs": entries(e.get("outputs"))}
                         for e in entries(manifest.get("entries"))] or
                        [{"name": "forward", "library": "lib/model.so",
                          "inputs": entries(manifest.get("inputs")),
                          "outputs": entries(manifest.get("outputs"))}],
        "state": [{"name": w.get("name"), "fqn": w.get("fqn"), "dtype": w.get("dtype"),
                   "shape": w.get("shape"), "nbytes": w.get("nbytes")}
                  for w in weights if w.get("state")],
    }


def _signature(tensors: list[dict[str, Any]]) -> str:
    return ", ".join(f"{t.get('name', '?')} {t.get('dtype', '?')}{fmt_shape(t.get('shape'))}"
                     for t in tensors)


def _print_cpu(cpu: dict[str, Any]) -> None:
    """The package's -march builds and the one this machine's loader picks."""
    for lv in cpu["levels"]:
        lacks = ", ".join(lv["missing_here"])
        mark = "picked here" if lv["march"] == cpu["picked_here"] else (
            f"this CPU lacks {lacks}" if lacks else "runs here")
        console.print(escape(f"cpu: -march={lv['march'] or '(none)'} {lv['library']} "
                             f"({len(lv['cpu_features'])} features; {mark})"), highlight=False)
    if cpu["picked_here"] is None:
        console.print("[red]cpu: no build of this package runs on this CPU[/red]")


def _gemm_table(gemms: list[dict[str, Any]]) -> Table:
    """Per GEMM: the backend linked, how it was chosen, and the best timings per backend."""
    table = Table(title="GEMMs (autotuning)", title_justify="left")
    for col in ("gemm", "problem", "backend", "chosen by", "best per backend"):
        table.add_column(col)
    for g in gemms:
        best = []
        for backend, runs in (g.get("timings") or {}).items():
            if runs:
                name, sec = runs[0]
                best.append(f"{backend}: {float(sec) * 1e6:.1f} us ({name})")
        cfg = g.get("config") or {}
        chosen = str(g.get("backend", "?")) + (
            " " + ",".join(f"{k}={v}" for k, v in cfg.items()) if cfg else "")
        how = str(g.get("how", "?"))
        if g.get("dropped"):
            how += f" ({len(g['dropped'])} candidates dropped)"
        if g.get("epilogue"):  # CUTLASS fused the epilogue, or why it did not
            how += f"; {g['epilogue']}"
        table.add_row(escape(str(g.get("name", ""))), escape(str(g.get("problem", ""))),
                      escape(chosen), escape(how), escape("; ".join(best) or "-"))
    return table


def _tensor_table(title: str, specs: list[dict[str, Any]]) -> Table:
    table = Table(title=title, title_justify="left")
    for col in ("#", "name", "dtype", "shape"):
        table.add_column(col)
    for i, s in enumerate(specs):
        table.add_row(str(i), escape(str(s.get("name", ""))), escape(str(s.get("dtype", "?"))),
                      escape(fmt_shape(s.get("shape"))))
    return table


def _kernel_ops(k: dict[str, Any]) -> str:
    ops = k.get("source_ops", k.get("ops", k.get("nodes", [])))
    if isinstance(ops, (list, tuple)):
        return ", ".join(str(o) for o in ops)
    return str(ops)


def cmd_inspect(args: argparse.Namespace) -> int:
    """``kiln inspect PKG``: summarise inputs, outputs, weights, kernels and the memory plan."""
    manifest = read_manifest(args.package)
    if args.manifest:
        console.print_json(json.dumps(manifest, default=str))
        return 0
    summary = _summary(manifest, args.package)
    if args.png:
        Path(args.png).write_bytes(memory_timeline(manifest, "png",
                                                   title=f"memory plan of {args.package}"))
    if args.html:
        Path(args.html).write_text(render_report(args.package, manifest), encoding="utf-8")
        console.print(f"[green]wrote[/green] {args.html}")
    if args.json and args.memory:
        print(json.dumps(memory_summary(manifest), indent=2, default=str))
        return 0
    if args.json:
        if not (args.kernels or args.memory):
            summary["kernels"] = len(summary["kernels"])
        print(json.dumps(summary, indent=2, default=str))
        return 0
    console.print(f"[bold]{escape(args.package)}[/bold] "
                  f"({fmt_bytes(summary['package_bytes'])}, format "
                  f"{manifest.get('format', manifest.get('format_version', '?'))})")
    console.print(_tensor_table("inputs", summary["inputs"]))
    console.print(_tensor_table("outputs", summary["outputs"]))
    for name, s in summary["symbols"].items():
        console.print(escape(f"  {name}: range [{s.get('min', '?')}, {s.get('max', '?')}], "
                             f"example {s.get('example', '?')}"))
    if "entries" in manifest:
        console.print(f"entry points: {len(summary['entry_points'])} (inputs and outputs above: "
                      f"the first one's)")
        for e in summary["entry_points"]:
            console.print(escape(f"  {e['name']}({_signature(e['inputs'])}) -> "
                                 f"{_signature(e['outputs'])}  [{e['library']}]"),
                          highlight=False)
    w = summary["weights"]
    console.print(f"weights: {w['count']} tensors, {fmt_bytes(w['bytes'])}")
    if summary["state"]:
        console.print(f"state: {len(summary['state'])} buffers, "
                      f"{fmt_bytes(sum(int(x['nbytes'] or 0) for x in summary['state']))} "
                      "(updated by the runs, one copy per loaded model, shared by the entry "
                      "points)")
    kernels = summary["kernels"]
    kinds: dict[str, int] = {}
    for k in kernels:
        kinds[str(k.get("kind", "?"))] = kinds.get(str(k.get("kind", "?")), 0) + 1
    detail = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    console.print(f"kernels: {len(kernels)}" + (f" ({escape(detail)})" if detail else ""))
    if args.kernels:
        table = Table(title_justify="left")
        for col in ("#", "kernel", "kind", "source ops"):
            table.add_column(col)
        for i, k in enumerate(kernels):
            table.add_row(str(i), escape(str(k.get("name", ""))), escape(str(k.get("kind", ""))),
                          escape(_kernel_ops(k)))
        console.print(table)
    if summary["gemms"]:
        console.print(_gemm_table(summary["gemms"]))
    if summary["cpu"]:
        _print_cpu(summary["cpu"])
    plan = summary["plan"]
    ratio = f"{plan['ratio']:.2f}x" if plan["ratio"] else "?"
    console.print(f"plan: arena {fmt_bytes(plan['arena_bytes'])}, lower bound "
                  f"{fmt_bytes(plan['lower_bound_bytes'])} (ratio {ratio}), "
                  f"{plan['buffers']} buffers")
    if args.memory:
        _print_memory(manifest)
    else:
        for b in plan["largest"]:
            console.print(f"  {escape(str(b.get('name', '')))}: {fmt_bytes(b.get('size'))}",
                          highlight=False)
    if args.png:
        console.print(f"[green]wrote[/green] {args.png}")
    return 0


def _print_memory(manifest: dict[str, Any], top: int = 10) -> None:
    """The ``--memory`` detail: planning, baselines, in-place pairs, sizes, largest buffers."""
    m = memory_summary(manifest, top)
    secs = m["planning_seconds"]
    console.print(f"planned {escape(str(m['planned_at'] or '?'))} by "
                  f"{escape(str(m['algorithm'] or '?'))}"
                  + (f" in {secs * 1e3:.2f} ms" if isinstance(secs, (int, float)) else ""))
    console.print(f"baselines: no reuse {fmt_bytes(m['naive_bytes'])}, exact-size reuse "
                  f"{fmt_bytes(m['exact_size_reuse_bytes'])}")
    pairs = m["inplace_pairs"]
    console.print(f"in place: {len(pairs)} outputs reuse a dying input's bytes, saving "
                  f"{fmt_bytes(m['inplace_saved_bytes'])}", highlight=False)
    if m["sizes"]:
        table = Table(title="run-time plan per size (planned when the sizes change)",
                      title_justify="left")
        for col in ("sizes", "arena", "lower bound", "ratio"):
            table.add_column(col)
        for s in m["sizes"]:
            sizes = ", ".join(f"{k}={v}" for k, v in (s.get("sizes") or {}).items())
            ratio = s.get("ratio")
            table.add_row(escape(sizes), fmt_bytes(s.get("arena_bytes")),
                          fmt_bytes(s.get("lower_bound_bytes")),
                          f"{ratio:.3f}" if isinstance(ratio, (int, float)) else "?")
        console.print(table)
    buffers = entries((manifest.get("plan") or {}).get("buffers"))
    table = Table(title=f"largest buffers (of {len(buffers)}; at the example sizes)",
                  title_justify="left")
    for col in ("name", "size", escape("live [start, end]"), "offset"):
        table.add_column(col)
    for b in sorted(buffers, key=lambda b: -int(b.get("size", 0) or 0))[:top]:
        table.add_row(escape(str(b.get("name", ""))), fmt_bytes(b.get("size")),
                      escape(f"[{b.get('start', '?')}, {b.get('end', '?')}]"),
                      str(b.get("offset", "?")))
    console.print(table)


def _profile_table(prof: dict[str, Any]) -> Table:
    total = sum(s["median_s"] for s in prof["steps"]) or 1.0
    where = "on the GPU" if prof["device"] == "cuda" else f"{prof['threads']} threads"
    table = Table(title=f"per-step times (median of {prof['repeat']} runs after "
                        f"{prof['warmup']} warm-up, {where})",
                  title_justify="left")
    for col in ("step", "kind", "source ops", "median", "share", "timed as"):
        table.add_column(col, justify="right" if col in ("median", "share") else "left")
    for s in sorted(prof["steps"], key=lambda s: -s["median_s"]):
        table.add_row(escape(s["name"]), escape(s["kind"]), escape(", ".join(s["source_ops"])),
                      f"{s['median_s'] * 1e6:,.1f} us",
                      f"{s.get('share', s['median_s'] / total):.1%}",
                      escape(s["timed_as"]))
    if "other_s" in prof:  # the share is of the end-to-end run: the rest is the wrapper's
        run = prof["package_run_median_s"] or 1.0
        table.add_row("(other)", "", "checks, output allocation, the call",
                      f"{prof['other_s'] * 1e6:,.1f} us", f"{prof['other_s'] / run:.1%}", "")
    return table


def cmd_profile(args: argparse.Namespace) -> int:
    """``kiln profile PKG``: per-kernel times of a CPU or CUDA package."""
    with console.status(f"profiling {args.package} ({args.repeat} runs) ..."):
        prof = profile_package(args.package, repeat=args.repeat, seed=args.seed)
    if args.json:
        print(json.dumps(prof, indent=2))
        return 0
    console.print(_profile_table(prof))
    console.print(f"package run: median {prof['package_run_median_s'] * 1e3:.3f} ms "
                  f"(min {prof['package_run_min_s'] * 1e3:.3f} ms)")
    console.print(f"[dim]{escape(prof['method'])}[/dim]")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """``kiln report PKG``: one self-contained HTML page (manifest, kernels with times, GEMM
    choices, memory timeline)."""
    manifest = read_manifest(args.package)
    prof = None
    if not args.no_profile:
        with console.status(f"profiling {args.package} ({args.repeat} runs) ..."):
            prof = profile_package(args.package, repeat=args.repeat)
    out = Path(args.output or Path(args.package).with_suffix(".html"))
    out.write_text(render_report(args.package, manifest, prof), encoding="utf-8")
    console.print(f"[green]wrote[/green] {out}")
    return 0
