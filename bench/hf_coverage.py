"""Coverage of real Hugging Face architectures (issue 16): each model is built from its config,
shrunk to a few layers of small width (random weights, no download), exported with
torch.export, compiled by kiln and compared with eager on fresh inputs.

    python bench/hf_coverage.py [--models llama,bert,...] [--device cpu|cuda] [--dynamic]
                                [--jobs 2] [--timeout 600] [--json FILE] [--markdown FILE]

One subprocess per model (a crash or hang is that model's row). Each row says where the model
stopped: `export` (torch.export refused it: not kiln's failure, listed apart), `compile`
(kiln refused or failed), `run` (the package failed at run time), `mismatch` (outputs differ
from eager beyond tolerance: max |kiln - eager| > 1e-3 * max|eager| + 1e-4, fp32), or `ok`.
Every output of the model is compared (the model's output fields, flattened). `--dynamic`
exports the batch and sequence (images: batch) dimensions as automatic dynamic dims and runs
the package at a second size as well. The models come from `kiln/models/hf_corpus.py`, wrapped
to take named tensors and return a flat tuple (the model keeps `return_dict`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

BEGIN, END = "<!-- hf-coverage:begin -->", "<!-- hf-coverage:end -->"

def _worker(model_type: str, device: str, dynamic: bool) -> dict:
    import torch

    import kiln
    from kiln.models import hf_corpus as C

    kind = C.ARCHS[model_type]
    flat, cfg, tiny = C.build(model_type, device)
    row: dict = {"kind": kind, "config": "shrunk" if tiny else "default",
                 "params": sum(p.numel() for p in flat.parameters())}
    example = {k: v.to(device) for k, v in C.inputs(kind, cfg, 2, 16).items()}
    stage = "export"
    try:
        t0 = time.perf_counter()
        # the model in a wrapper taking its inputs as named tensors (export names their dims)
        # and returning its output's tensors as a flat tuple (the model keeps return_dict)
        ep = C.export(flat, kind, example, dynamic)
        row["export_s"] = time.perf_counter() - t0
        stage = "compile"
        t0 = time.perf_counter()
        cm = kiln.compile(ep, device="cuda" if device.startswith("cuda") else "cpu")
        row["compile_s"] = time.perf_counter() - t0
        runner = cm.load(Path(tempfile.mkdtemp()) / f"{model_type}.kiln", device=device)
        sizes = [(2, 16)] + ([(3, 24)] if dynamic else [])  # images: batch 3, same side
        worst = 0.0
        with torch.no_grad():
            for batch, length in sizes:
                x = {k: v.to(device) for k, v in C.inputs(kind, cfg, batch, length).items()}
                stage = "run"
                got, want = runner(**x), flat(**x)
                if len(got) != len(want):
                    raise AssertionError(f"{len(got)} outputs, eager has {len(want)}")
                for g, w in zip(got, want):  # every output of the model
                    if g.shape != w.shape:
                        raise AssertionError(f"output shape {list(g.shape)}, eager "
                                             f"{list(w.shape)}")
                    if not w.is_floating_point() or not w.numel():
                        worst = max(worst, float(not torch.equal(g, w)) * 1e9)
                        continue
                    err = float((g.float() - w.float()).abs().max())
                    worst = max(worst, err / (1e-3 * float(w.float().abs().max()) + 1e-4))
        row["err_ratio"] = worst
        row["status"] = "ok" if worst <= 1.0 else "mismatch"
    except Exception as e:  # noqa: BLE001 - the row records where and why
        row["status"] = stage
        first = (str(e).strip().splitlines() or [""])[0]
        row["error"] = f"{type(e).__name__}: {first}"[:300]
        traceback.print_exc()
    return row


def _run_one(model_type: str, a) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--one", model_type, "--out", f.name,
               "--device", a.device] + (["--dynamic"] if a.dynamic else [])
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, timeout=a.timeout, capture_output=True, text=True)
            text = Path(f.name).read_text()
            row = json.loads(text) if text else {
                "status": "crash", "error": f"exit {p.returncode}: {p.stderr.strip()[-200:]}"}
        except subprocess.TimeoutExpired:
            row = {"status": "timeout", "error": f"over {a.timeout:.0f} s"}
    row.update(model=model_type, wall_s=time.perf_counter() - t0)
    return row


def _archs() -> dict[str, str]:
    from kiln.models.hf_corpus import ARCHS  # deferred: imports transformers

    return ARCHS


def table(rows: list[dict], a) -> str:
    ok = sum(r["status"] == "ok" for r in rows)
    exported = [r for r in rows if r["status"] != "export"]
    lines = [f"{ok} of {len(exported)} exported models compile and match eager "
             f"({len(rows) - len(exported)} refused by torch.export); device {a.device}, "
             f"{'dynamic batch/sequence' if a.dynamic else 'static shapes'}.", "",
             "| model | input | status | compile s | error / max err over tolerance |",
             "|---|---|---|---:|---|"]
    for r in rows:
        detail = r.get("error", f"{r['err_ratio']:.2f}" if "err_ratio" in r else "")
        detail = detail.replace("|", "/").replace("\n", " ")[:140]
        cs = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
        lines.append(f"| {r['model']} | {r.get('kind', _archs().get(r['model'], '?'))} | "
                     f"{r['status']} | {cs} | {detail} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dynamic", action="store_true")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--markdown", metavar="FILE")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.one:
        try:
            row = _worker(a.one, a.device, a.dynamic)
        except Exception as e:  # noqa: BLE001 - building the model failed
            traceback.print_exc()
            row = {"status": "build", "error": f"{type(e).__name__}: {e}"[:300]}
        Path(a.out).write_text(json.dumps(row))
        return 0
    archs = _archs()
    models = [m for m in a.models.split(",") if m] or list(archs)
    unknown = [m for m in models if m not in archs]
    if unknown:
        p.error(f"unknown model types {unknown}; known: {', '.join(archs)}")
    with ThreadPoolExecutor(max(a.jobs, 1)) as pool:
        rows = []
        for row in pool.map(lambda m: _run_one(m, a), models):
            rows.append(row)
            print(json.dumps(row), flush=True)
    text = table(rows, a)
    print("\n" + text)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.markdown:
        from bench.markdown import splice

        splice(a.markdown, BEGIN, END, text, "## Hugging Face coverage (issue 16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
