"""GPU benchmarks of the CUDA backend: latency, compile time, peak memory, bandwidth.

Table 1 (latency), per zoo model and dtype (fp32, and bf16 where listed): the median latency
of one call (inputs already on the GPU; each timed call ends with a device synchronise, so this
is launch + run latency) for kiln (CUDA graphs on, the default, and off), eager,
torch.compile default mode and torch.compile mode="reduce-overhead" (CUDA graphs); compile
times (kiln: export excluded, kernel cache as left by earlier runs; torch.compile: the first
call); kiln's max abs error against eager in the same dtype; device memory: kiln's as measured
by the driver (free memory before loading minus after loading and running: weights, arena,
cuBLAS workspace, graph buffers, modules) and torch's `max_memory_allocated` for eager and
reduce-overhead (weights + activations + graph pool; allocator overhead and cuBLAS workspace
excluded, so torch's figure is, if anything, low). Each system is warmed up first. A failure is
reported in its cell and the others go on.

Table 2 (memory-bound kernels): layer norm, softmax and a pointwise chain on large fp32 and
bf16 tensors, compiled by kiln (one fused kernel each), as bytes moved (inputs read once +
outputs written once) per second, against the measured device-to-device copy bandwidth
(`dst.copy_(src)` of 512 MiB: 2 bytes moved per byte copied).

    python bench/gpu.py [--models mlp,gpt] [--bf16 mlp,gpt,resnet18] [--repeat 100]
                        [--no-compile] [--no-bandwidth] [--markdown FILE]

--markdown FILE replaces the section between <!-- gpu:begin --> and <!-- gpu:end --> in FILE.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.utils import _pytree as pytree  # noqa: E402

from bench.cuda_timing import stream_ms, sync_ms  # noqa: E402
from bench.markdown import splice  # noqa: E402

BEGIN, END = "<!-- gpu:begin -->", "<!-- gpu:end -->"
DT = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _median_ms(fn, repeat: int) -> float:
    return sync_ms(fn, repeat, warmup=5)


def _cuda(x):
    return pytree.tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, x)


def _free() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def _torch_peak(fn) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**20


def bench_model(name: str, dtype: str, repeat: int, with_compile: bool) -> dict:
    import kiln
    from kiln.models import get
    from kiln.models.zoo import in_dtype
    from kiln.options import Options

    spec = get(name)
    if dtype != "fp32":
        spec = in_dtype(spec, DT[dtype])
    row: dict = {"model": name, "dtype": dtype}
    args = _cuda(spec.make_inputs(7))
    ep = spec.export()  # on the CPU module and example inputs, as a user would
    with torch.no_grad():
        try:
            free0 = _free()
            t0 = time.perf_counter()
            cm = kiln.compile(ep, device="cuda")
            row["kiln_compile_s"] = time.perf_counter() - t0
            runner = cm.load(Path(tempfile.mkdtemp()) / f"{name}.kiln", device="cuda:0")
            got = pytree.tree_leaves(runner(*args))
            row["kernels"] = cm.report["kernels"]
            row["gemms"] = cm.report["extern_calls"]
            row["kiln_ms"] = _median_ms(lambda: runner(*args), repeat)
            del got
            row["kiln_mib"] = (free0 - _free()) / 2**20
            off = kiln.compile(ep, device="cuda", options=Options(cuda_graphs=False)).load(
                Path(tempfile.mkdtemp()) / f"{name}.kiln", device="cuda:0")
            row["kiln_nograph_ms"] = _median_ms(lambda: off(*args), repeat)
            off = None  # unload before the next measurement
        except Exception as e:  # report and go on
            row["kiln_error"] = f"{type(e).__name__}: {e}"[:200]
            traceback.print_exc()
        module = copy.deepcopy(spec.module).cuda()
        ref = pytree.tree_leaves(module(*args))
        if "kiln_ms" in row:
            got = pytree.tree_leaves(runner(*args))
            row["kiln_err"] = max((g.double() - r.double()).abs().max().item()
                                  for g, r in zip(got, ref))
            del runner, got
        row["eager_ms"] = _median_ms(lambda: module(*args), repeat)
        row["eager_mib"] = _torch_peak(lambda: module(*args))
        if with_compile:
            for mode, key in (("default", "tc"), ("reduce-overhead", "tcro")):
                try:
                    torch._dynamo.reset()
                    compiled = torch.compile(copy.deepcopy(spec.module).cuda(), mode=mode)
                    t0 = time.perf_counter()
                    compiled(*args)
                    torch.cuda.synchronize()
                    row[f"{key}_compile_s"] = time.perf_counter() - t0
                    row[f"{key}_ms"] = _median_ms(lambda: compiled(*args), repeat)
                    row[f"{key}_mib"] = _torch_peak(lambda: compiled(*args))
                    del compiled
                except Exception as e:  # report and go on
                    row[f"{key}_error"] = f"{type(e).__name__}: {e}"[:200]
    return row


def _fmt(r, k, fmt="{:.3f}"):
    if k in r:
        return fmt.format(r[k])
    return "error" if k.split("_")[0] + "_error" in r else "-"


def table(rows: list[dict]) -> str:
    out = [f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, latency per call "
           "(median, synchronised, ms), lower is better; kiln uses CUDA graphs unless noted; "
           "tc = torch.compile, ro = mode=\"reduce-overhead\".", "",
           "| model | dtype | kernels + GEMMs | kiln | kiln no graphs | eager | tc | tc ro | "
           "kiln vs tc ro | kiln compile s | tc / ro compile s | kiln MiB | eager / ro MiB | "
           "max abs err |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ratio = f"{r['tcro_ms'] / r['kiln_ms']:.2f}x" if "kiln_ms" in r and "tcro_ms" in r \
            else "-"
        out.append(
            f"| {r['model']} | {r['dtype']} | {r.get('kernels', '-')} + {r.get('gemms', '-')} | "
            f"{_fmt(r, 'kiln_ms')} | {_fmt(r, 'kiln_nograph_ms')} | {_fmt(r, 'eager_ms')} | "
            f"{_fmt(r, 'tc_ms')} | {_fmt(r, 'tcro_ms')} | {ratio} | "
            f"{_fmt(r, 'kiln_compile_s', '{:.1f}')} | {_fmt(r, 'tc_compile_s', '{:.1f}')} / "
            f"{_fmt(r, 'tcro_compile_s', '{:.1f}')} | {_fmt(r, 'kiln_mib', '{:.0f}')} | "
            f"{_fmt(r, 'eager_mib', '{:.0f}')} / {_fmt(r, 'tcro_mib', '{:.0f}')} | "
            f"{_fmt(r, 'kiln_err', '{:.1e}')} |")
    errs = [f"- {r['model']} {r['dtype']}: {r[k]}" for r in rows
            for k in ("kiln_error", "tc_error", "tcro_error") if k in r]
    return "\n".join(out + ([""] + errs if errs else []))


class _LayerNorm(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.ln = torch.nn.LayerNorm(n)

    def forward(self, x):
        return self.ln(x)


class _Softmax(torch.nn.Module):
    def forward(self, x):
        return torch.softmax(x, -1)


class _Chain(torch.nn.Module):
    def forward(self, x, y):
        return torch.nn.functional.gelu(x * 1.5 + y).sigmoid() * y


def bandwidth(repeat: int) -> str:
    import kiln

    src = torch.empty(2**27, dtype=torch.float32, device="cuda")  # 512 MiB
    dst = torch.empty_like(src)
    copy_ms = stream_ms(lambda: dst.copy_(src), 20, max(5, repeat // 5))  # as the kernels
    copy_gbs = 2 * src.numel() * 4 / copy_ms / 1e6
    src = dst = None  # free the 1 GiB before the kernels
    rows = [f"Device-to-device copy: {copy_gbs:.0f} GB/s (bytes read + written).", "",
            "Device ms: per call with 20 calls enqueued back to back (CUDA events; the host's "
            "per-call work hidden, as in a loop); GB/s and the fraction of copy come from it. "
            "Call ms: one synchronised call, wall time (adds the Python call and the sync).", "",
            "| kernel | dtype | shape | kiln device ms | kiln GB/s | fraction of copy | "
            "kiln call ms | eager device GB/s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    shape = (16384, 4096)
    cases = [("layer norm", _LayerNorm(shape[-1]), 1), ("softmax", _Softmax(), 1),
             ("pointwise chain", _Chain(), 2)]
    for dtype in ("fp32", "bf16"):
        dt = DT[dtype]
        for label, base, n_in in cases:
            module = copy.deepcopy(base).to(dt).eval()  # a fresh copy: moved to the GPU below
            args = tuple(torch.randn(shape, dtype=dt) for _ in range(n_in))
            try:
                ep = torch.export.export(module, args)
                runner = kiln.compile(ep, device="cuda").load(
                    Path(tempfile.mkdtemp()) / "bw.kiln", device="cuda:0")
                dev = tuple(a.cuda() for a in args)
                moved = (n_in + 1) * args[0].numel() * args[0].element_size()
                ms = stream_ms(lambda: runner(*dev), 20, max(5, repeat // 5))
                call_ms = _median_ms(lambda: runner(*dev), repeat)
                gbs = moved / ms / 1e6
                mod = module.cuda()
                with torch.no_grad():
                    eager = moved / stream_ms(lambda: mod(*dev), 20, max(5, repeat // 5)) / 1e6
                rows.append(f"| {label} | {dtype} | {list(shape)} | {ms:.3f} | {gbs:.0f} | "
                            f"{gbs / copy_gbs:.0%} | {call_ms:.3f} | {eager:.0f} |")
                runner = dev = None
            except Exception as e:  # report and go on
                traceback.print_exc()
                rows.append(f"| {label} | {dtype} | {list(shape)} | error: "
                            f"{type(e).__name__}: {str(e)[:80]} | | | | |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,resnet18,gpt,ln_softmax")
    ap.add_argument("--bf16", default="mlp,resnet18,gpt", help="models also run in bfloat16")
    ap.add_argument("--repeat", type=int, default=100)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-bandwidth", action="store_true")
    ap.add_argument("--markdown")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU")
    rows = []
    runs = [(m, "fp32") for m in a.models.split(",") if m] + \
        [(m, "bf16") for m in a.bf16.split(",") if m]
    for name, dtype in runs:
        rows.append(bench_model(name, dtype, a.repeat, not a.no_compile))
        print(rows[-1], flush=True)
    text = table(rows)
    if not a.no_bandwidth:
        text += "\n\n" + bandwidth(a.repeat)
    if a.markdown:
        splice(a.markdown, BEGIN, END, text, "## GPU (CUDA backend)")
    print(text)


if __name__ == "__main__":
    main()
