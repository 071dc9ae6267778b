"""``kiln report PKG`` (and ``kiln inspect PKG --html PATH``): one self-contained HTML page
about a package: its inputs, outputs and build, the kernel list with source ops and (from a
profiling run, :mod:`kiln.cli.profile`) per-step times, the GEMM choices with their autotuning
timings, the memory timeline (matplotlib, inline SVG) and the whole manifest. No scripts, no
external files: the page opens anywhere."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from kiln.cli.manifest_view import entries, fmt_bytes, fmt_shape, plan_summary, symbols
from kiln.cli.plots import memory_timeline

__all__ = ["render_report"]

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1150px;color:#222;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em}h2{margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.5em 0;font-size:13px}
th,td{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f4f4f4}td.num{text-align:right;font-variant-numeric:tabular-nums}
.bar{background:#4a7bd0;height:10px;display:inline-block}
.muted{color:#777}.note{background:#fff8e1;border-left:4px solid #e0b000;padding:.4em .8em}
pre{background:#f7f7f7;padding:1em;overflow:auto;font-size:12px}
svg{max-width:100%;height:auto}
"""


def _e(x: Any) -> str:
    return html.escape(str(x))


def _table(head: list[str], rows: list[list[Any]], cls: str = "", num: set[int] = set()) -> str:
    out = [f'<table class="{cls}">' + ("<thead><tr>" + "".join(
        f"<th>{_e(h)}</th>" for h in head) + "</tr></thead>" if any(head) else "") + "<tbody>"]
    for r in rows:
        out.append("<tr>" + "".join(
            f'<td class="num">{c}</td>' if i in num else f"<td>{c}</td>"
            for i, c in enumerate(r)) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def _us(s: float | None) -> str:
    return "-" if s is None else f"{s * 1e6:,.1f}"


def _kernels(manifest: dict[str, Any], profile: dict[str, Any] | None) -> str:
    times = {s["name"]: s for s in (profile or {}).get("steps", [])}
    total = sum(s["median_s"] for s in times.values()) or 1.0
    rows = []
    for i, k in enumerate(entries(manifest.get("kernels"))):
        name = str(k.get("name", ""))
        t = times.get(name)
        share = t.get("share", t["median_s"] / total) if t else 0.0
        rows.append([str(i), f"<code>{_e(name)}</code>", _e(k.get("kind", "")),
                     _e(", ".join(map(str, k.get("members", [])))),
                     _e(", ".join(map(str, k.get("source_ops", [])))),
                     _us(t["median_s"]) if t else "-",
                     f'<span class="bar" style="width:{share * 200:.0f}px"></span> '
                     f"{share * 100:.1f}%" if t else "",
                     _e(t["timed_as"]) if t else ""])
    head = ["#", "kernel", "kind", "members", "source ops", "median µs", "share", "timed as"]
    return _table(head, rows, "kernels", {5})


def _gemms(manifest: dict[str, Any]) -> str:
    gemms = [(k.get("name"), k["gemm"]) for k in entries(manifest.get("kernels"))
             if isinstance(k.get("gemm"), dict)]
    if not gemms:
        return '<p class="muted">No GEMM choices recorded (no GEMMs, or chosen without ' \
               'autotuning data).</p>'
    rows = []
    for name, g in gemms:
        timings = []
        for backend, runs in (g.get("timings") or {}).items():
            for cand, sec in (runs or [])[:3]:
                timings.append(f"{_e(backend)}: {_e(cand)} {float(sec) * 1e6:,.1f} µs")
        cfg = g.get("config") or {}
        rows.append([f"<code>{_e(name)}</code>", _e(g.get("problem", "")),
                     _e(g.get("backend", "?")) + (f" <span class='muted'>{_e(cfg)}</span>"
                                                  if cfg else ""),
                     _e(g.get("how", "?")), "<br>".join(timings) or "-"])
    return _table(["GEMM", "problem", "backend", "chosen by", "timings (best 3 per backend)"],
                  rows, "gemms")


def _io(manifest: dict[str, Any]) -> str:
    rows = [[kind, _e(s.get("name", "")), _e(s.get("dtype", "")), _e(fmt_shape(s.get("shape")))]
            for kind, key in (("input", "inputs"), ("output", "outputs"))
            for s in entries(manifest.get(key))]
    out = _table(["", "name", "dtype", "shape"], rows, "io")
    syms = symbols(manifest)
    if syms:
        out += _table(["size", "min", "max", "example"],
                      [[_e(n), _e(s.get("min")), _e(s.get("max")), _e(s.get("example"))]
                       for n, s in syms.items()], "symbols")
    return out


def _summary(manifest: dict[str, Any], path: Path, profile: dict[str, Any] | None) -> str:
    plan = plan_summary(manifest)
    weights = entries(manifest.get("weights"))
    build = manifest.get("build") or {}
    kernels = entries(manifest.get("kernels"))
    rows = [["package", f"{_e(path.name)} ({fmt_bytes(path.stat().st_size)})"],
            ["device", _e(manifest.get("device", "cpu"))],
            ["kiln / torch", f"{_e(manifest.get('kiln_version'))} / "
                             f"{_e(manifest.get('torch_version'))}"],
            ["compiler", _e(build.get("cxx", "?")) + f" (march {_e(build.get('march'))})"],
            ["compile time", f"{float(build.get('compile_seconds', 0)):.2f} s"],
            ["kernels", f"{len(kernels)}"],
            ["weights", f"{len(weights)} tensors, "
                        f"{fmt_bytes(sum(int(w.get('nbytes', 0)) for w in weights))}"],
            ["arena (peak) / lower bound",
             f"{fmt_bytes(plan['arena_bytes'])} / {fmt_bytes(plan['lower_bound_bytes'])}"
             + (f" ({plan['ratio']:.2f}x)" if plan["ratio"] else "")]]
    if profile:
        rows.append(["package run (median)",
                     f"{profile['package_run_median_s'] * 1e3:.3f} ms over {profile['repeat']} "
                     f"runs after {profile['warmup']} warm-up, {profile['threads']} threads"])
        if "other_s" in profile:  # the run's time outside its steps
            rows.append(["wrapper's own work (other)",
                         f"{profile['other_s'] * 1e6:,.1f} µs: input checks, output "
                         "allocation, the call"])
    return _table(["", ""], rows, "summary")


def render_report(path: str | Path, manifest: dict[str, Any],
                  profile: dict[str, Any] | None = None) -> str:
    """The HTML page (a string)."""
    path = Path(path)
    svg = memory_timeline(manifest, "svg", title=f"memory plan of {path.name}").decode()
    svg = svg[svg.index("<svg"):]  # inline: no XML prolog or doctype
    if profile:
        method = (f"<p class='note'>Times: {_e(profile['method'])}. "
                  f"CUDA: {_e(profile.get('cuda', ''))}.</p>")
    else:
        method = ("<p class='note'>No profiling run: <code>kiln report PKG</code> (without "
                  "<code>--no-profile</code>) or <code>kiln profile PKG</code> times each "
                  "kernel.</p>")
    parts = [
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>kiln report: {_e(path.name)}</title><style>{_CSS}</style></head><body>",
        f"<h1>kiln report: {_e(path.name)}</h1>",
        _summary(manifest, path, profile),
        "<h2>Inputs and outputs</h2>", _io(manifest),
        "<h2 id='kernels'>Kernels</h2>", method, _kernels(manifest, profile),
        "<h2>GEMM choices</h2>", _gemms(manifest),
        "<h2>Memory timeline</h2>",
        "<p>Each rectangle is a buffer: its steps live (x) and its bytes in the arena (y); "
        "the lines are the arena size (the peak) and the lower bound (the most bytes live at "
        "one step). Below: the bytes live at each step.</p>", svg,
        "<h2>Manifest</h2><details><summary>manifest.json</summary><pre>",
        _e(json.dumps(manifest, indent=1, default=str)), "</pre></details>",
        "</body></html>",
    ]
    return "\n".join(parts)
