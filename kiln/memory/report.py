"""Human-facing views of a memory plan: a JSON summary and a timeline picture.

Input: the `Interval`s and the `Plan` made for them (and, for the picture, a file path).
Output: `plan_summary` returns a JSON-serialisable dict (plain ints, floats, strings, lists);
`render_timeline_png` writes a PNG where x is the step and y the arena address (0 at the
bottom), one filled box per buffer of size > 0 spanning [start, end + 1) x [offset, offset +
size), outlined so neighbours stay apart.

Invariants: neither function changes its inputs; the PNG is a valid 8-bit RGB image no larger
than the requested width x height, written without matplotlib (which kiln does not depend on):
the boxes are rasterised into a numpy array and encoded with zlib and struct (PNG chunks with
CRC-32, filter type 0 on every row). Colours are fixed per buffer (from its input position), so
the same plan always yields the same bytes.
"""
from __future__ import annotations

import struct
import zlib
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from kiln.memory.intervals import Interval, exact_size_reuse_bytes, naive_bytes
from kiln.memory.planner import Plan


def plan_summary(intervals: Sequence[Interval], plan: Plan, alignment: int = 64,
                 top: int = 10) -> dict[str, Any]:
    """Arena, bounds, baselines, algorithms and the `top` largest buffers of a plan."""
    biggest = sorted(intervals, key=lambda iv: (-iv.size, iv.start, iv.name))[:top]
    return {
        "arena_bytes": int(plan.arena_bytes),
        "lower_bound_bytes": int(plan.lower_bound_bytes),
        "ratio": (plan.arena_bytes / plan.lower_bound_bytes) if plan.lower_bound_bytes else 1.0,
        "naive_bytes": naive_bytes(intervals, alignment),
        "exact_size_reuse_bytes": exact_size_reuse_bytes(intervals, alignment),
        "algorithm": plan.algorithm,
        "planning_seconds": float(plan.seconds),
        "candidates": {name: int(v) for name, v in plan.candidates.items()},
        "n_buffers": len(intervals),
        "top_buffers": [
            {"name": iv.name, "size": int(iv.size), "start": int(iv.start), "end": int(iv.end),
             "offset": int(plan.offsets[iv.name])}
            for iv in biggest
        ],
    }


def _colour(i: int) -> tuple[int, int, int]:
    """A bright, deterministic colour for buffer number i (golden-ratio hue walk)."""
    h = (i * 0.6180339887) % 1.0
    k = int(h * 6)
    f = h * 6 - k
    v, s = 230, 0.55
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    rgb = [(v, t, p), (q, v, p), (p, v, t), (p, q, v), (t, p, v), (v, p, q)][k % 6]
    return int(rgb[0]), int(rgb[1]), int(rgb[2])


def _png_bytes(pixels: np.ndarray) -> bytes:
    """Encode an (h, w, 3) uint8 array as a PNG file."""
    h, w, _ = pixels.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    raw = np.concatenate([np.zeros((h, 1), dtype=np.uint8), pixels.reshape(h, w * 3)], axis=1)
    header = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(raw.tobytes(), 9)) + chunk(b"IEND", b""))


def render_timeline_png(intervals: Sequence[Interval], plan: Plan, path: str | Path,
                        width: int = 1024, height: int = 640) -> Path:
    """Draw the plan as boxes in steps (x) by addresses (y) into the PNG file `path`."""
    margin = 8
    img = np.full((height, width, 3), 255, dtype=np.uint8)
    live = [(i, iv) for i, iv in enumerate(intervals) if iv.size > 0]
    first = min((iv.start for _, iv in live), default=0)
    last = max((iv.end + 1 for _, iv in live), default=1)
    arena = max(plan.arena_bytes, 1)
    inner_w, inner_h = width - 2 * margin, height - 2 * margin

    def x_of(step: int) -> int:
        return margin + round((step - first) * inner_w / max(last - first, 1))

    def y_of(addr: int) -> int:  # address 0 at the bottom
        return min(height - 1, max(0, height - margin - round(addr * inner_h / arena)))

    img[margin:height - margin, margin - 1] = 0  # address axis
    img[height - margin, margin - 1:width - margin] = 0  # time axis
    img[y_of(plan.lower_bound_bytes), margin:width - margin:4] = (200, 0, 0)  # lower bound
    for i, iv in live:
        offset = plan.offsets[iv.name]
        x0, x1 = x_of(iv.start), max(x_of(iv.end + 1), x_of(iv.start) + 1)
        y1, y0 = y_of(offset), min(y_of(offset + iv.size), y_of(offset) - 1)
        img[y0:y1, x0:x1] = _colour(i)
        if x1 - x0 > 2 and y1 - y0 > 2:  # outline
            img[y0, x0:x1] = img[y1 - 1, x0:x1] = 40
            img[y0:y1, x0] = img[y0:y1, x1 - 1] = 40
    out = Path(path)
    out.write_bytes(_png_bytes(img))
    return out
