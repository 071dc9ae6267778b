"""The memory timeline of a package's plan, drawn with matplotlib (the optional `report`
extra): each buffer a named rectangle (x: the steps it is live, y: its bytes in the arena),
the arena size (peak) and the liveness lower bound as labelled lines, and below it the bytes
live at each step. Written as PNG or SVG (`kiln inspect --png`, `kiln report`)."""

from __future__ import annotations

import io
from typing import Any

from kiln.cli.manifest_view import entries, fmt_bytes
from kiln.errors import KilnError

__all__ = ["memory_timeline", "timeline_data"]


def timeline_data(manifest: dict[str, Any]) -> dict[str, Any]:
    """Buffers (name, size, start, end, offset), arena and lower bound from the manifest."""
    plan = manifest.get("plan") or {}
    buffers = [{"name": str(b.get("name", i)), "size": int(b["size"]),
                "start": int(b.get("start", 0)), "end": int(b.get("end", b.get("start", 0))),
                "offset": int(b.get("offset", 0))}
               for i, b in enumerate(entries(plan.get("buffers"))) if "size" in b]
    arena = plan.get("arena_bytes")
    if arena is None:
        arena = max([b["offset"] + b["size"] for b in buffers] or [0])
    lower = plan.get("lower_bound_bytes", plan.get("lower_bound", 0)) or 0
    return {"buffers": buffers, "arena": int(arena), "lower": int(lower)}


def _pyplot():
    try:
        import matplotlib  # deferred: optional extra `report`
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # deferred: optional extra `report`
        from matplotlib import ticker  # deferred: optional extra `report`
    except ImportError:
        raise KilnError("drawing needs matplotlib: pip install 'kiln[report]'") from None
    return plt, ticker


def _binary_step(top: float) -> int:
    """A power-of-two tick step giving 3 to 8 ticks up to `top` bytes."""
    step = 1
    while top / step > 8:
        step *= 2
    return step


def memory_timeline(manifest: dict[str, Any], fmt: str = "svg", title: str = "") -> bytes:
    """The timeline as an image (`fmt` "svg" or "png")."""
    plt, ticker = _pyplot()
    data = timeline_data(manifest)
    bufs, arena, lower = data["buffers"], data["arena"], data["lower"]
    steps = max([b["end"] for b in bufs] or [0]) + 1
    live = [sum(b["size"] for b in bufs if b["start"] <= t <= b["end"]) for t in range(steps)]
    fig, (ax, ax_live) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1]})
    cmap = plt.get_cmap("tab20")
    scale = max(arena, 1)
    for i, b in enumerate(sorted(bufs, key=lambda b: -b["size"])):
        width = b["end"] - b["start"] + 1
        ax.add_patch(plt.Rectangle((b["start"] - 0.5, b["offset"]), width, b["size"],
                                   facecolor=cmap(i % 20), edgecolor="black", linewidth=0.5,
                                   label=f"{b['name']} ({fmt_bytes(b['size'])})"
                                   if i < 12 else None))
        if b["size"] >= 0.06 * scale and width >= max(1, steps / 12):
            ax.text(b["start"] - 0.5 + width / 2, b["offset"] + b["size"] / 2, b["name"],
                    ha="center", va="center", fontsize=7, clip_on=True)
    ax.axhline(arena, color="crimson", linestyle="-", linewidth=1.2,
               label=f"arena (peak) {fmt_bytes(arena)}")
    if lower:
        ax.axhline(lower, color="navy", linestyle="--", linewidth=1.2,
                   label=f"lower bound {fmt_bytes(lower)}")
    ax.set_xlim(-0.5, steps - 0.5)
    ax.set_ylim(0, max(arena, lower, 1) * 1.08)
    as_bytes = ticker.FuncFormatter(lambda v, _: fmt_bytes(int(v)))
    ax.yaxis.set_major_locator(ticker.MultipleLocator(_binary_step(max(arena, lower, 1))))
    ax.yaxis.set_major_formatter(as_bytes)
    ax.xaxis.set_major_locator(ticker.MaxNLocator(integer=True))
    ax.set_ylabel("arena offset (bytes)")
    ax.set_title(title or f"memory plan: {len(bufs)} buffers over {steps} steps")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7, frameon=False,
              title="largest buffers")
    ax_live.step(range(steps), live, where="mid", color="black", label="live bytes")
    ax_live.axhline(arena, color="crimson", linewidth=1.0)
    if lower:
        ax_live.axhline(lower, color="navy", linestyle="--", linewidth=1.0)
    ax_live.yaxis.set_major_locator(ticker.MultipleLocator(
        2 * _binary_step(max(arena, lower, 1))))
    ax_live.yaxis.set_major_formatter(as_bytes)
    ax_live.set_ylim(0, max(arena, lower, 1) * 1.1)
    ax_live.set_ylabel("live")
    ax_live.set_xlabel("step (program order)")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format=fmt, dpi=110, metadata={"Date": None} if fmt == "svg" else None)
    plt.close(fig)
    return out.getvalue()
