"""Pointwise CUDA kernels of few rows (kiln/targets/cuda/kernel.py `row_split`) against eager
and the copy bandwidth, with the split off as a baseline in the same run.

    python bench/row_split_gpu.py [--repeat 20] [--markdown FILE]

Programs: `vec` relu(x) * 2 - sin(x) over a 1-d float32 vector (one row: before the split, one
program walked it all); `rows` two outputs over [4, n / 4] with a broadcast operand (four rows);
`wide` the same as `vec` over [1024, n / 1024] (rows enough: never split, a control). Per
program and size: ms per call back to back (median of `repeat` batches of 10), and GB/s of the
bytes the program must move (inputs read once, outputs written once) over the copy bandwidth
measured in the same run (`x.copy_(y)` of the same bytes: read + write). The baseline is the
same compile with `row_split` returning 0, so both packages differ only in the split."""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from bench.cuda_timing import stream_ms  # noqa: E402


class Vec(torch.nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2 - x.sin()


class Rows(torch.nn.Module):
    def forward(self, x, y):
        return x.sin() * y, torch.exp(-x.abs()) + y


def _programs(n: int):
    return {
        "vec": (Vec(), lambda: (torch.randn(n, device="cuda"),), 2),
        "rows": (Rows(), lambda: (torch.randn(4, n // 4, device="cuda"),
                                  torch.randn(n // 4, device="cuda")), 3),
        "wide": (Vec(), lambda: (torch.randn(1024, n // 1024, device="cuda"),), 2),
    }


def _compile(mod, args, split: bool, tmp: pathlib.Path, name: str):
    import kiln
    from kiln.targets.cuda import kernel as K

    keep = K.row_split
    if not split:
        K.row_split = lambda *a, **k: 0
    try:
        ep = torch.export.export(mod, tuple(a.cpu() for a in args))
        cm = kiln.compile(ep, device="cuda", options=kiln.Options(cuda_graphs=False))
        return kiln.load(cm.save(tmp / f"{name}_{int(split)}.kiln"), device="cuda")
    finally:
        K.row_split = keep


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1048576,16777216")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--markdown")
    a = ap.parse_args()
    tmp = pathlib.Path(tempfile.mkdtemp())
    rows = []
    for n in map(int, a.sizes.split(",")):
        src, dst = torch.randn(n, device="cuda"), torch.empty(n, device="cuda")
        copy_ms = stream_ms(lambda: dst.copy_(src), 10, a.repeat)
        copy_gbs = 2 * 4 * n / copy_ms / 1e6
        for name, (mod, make, words) in _programs(n).items():
            args = make()
            with torch.no_grad():
                want = mod(*args)
            want = want if isinstance(want, tuple) else (want,)
            r = {"program": name, "n": n}
            for label, fn in (("eager", lambda: mod(*args)),):
                r[label] = stream_ms(fn, 10, a.repeat)
            for split in (False, True):
                runner = _compile(mod, args, split, tmp, f"{name}_{n}")
                got = runner(*args)
                got = got if isinstance(got, tuple) else (got,)
                err = max((g - w).abs().max().item() for g, w in zip(got, want))
                r["split" if split else "base"] = stream_ms(lambda: runner(*args), 10, a.repeat)
                r["err"] = max(r.get("err", 0.0), err)
            nbytes = 4 * (n * words + (n // 4 if name == "rows" else 0))
            r["gbs"] = nbytes / r["split"] / 1e6
            r["of_copy"] = r["gbs"] / copy_gbs
            r["copy_gbs"] = copy_gbs
            rows.append(r)
            print(r, flush=True)
    head = ("| program | elements | eager ms | kiln before ms | kiln ms | before / after | "
            "kiln / eager | kiln GB/s | of copy GB/s | max abs err |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head] + [
        f"| {r['program']} | {r['n']} | {r['eager']:.4f} | {r['base']:.4f} | {r['split']:.4f} | "
        f"{r['base'] / r['split']:.1f} | {r['split'] / r['eager']:.2f} | {r['gbs']:.0f} | "
        f"{r['of_copy']:.2f} (copy {r['copy_gbs']:.0f}) | {r['err']:.1e} |" for r in rows]
    text = "\n".join(lines)
    print(text)
    if a.markdown:
        pathlib.Path(a.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
