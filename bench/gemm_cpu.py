"""CPU GEMM with prepacked weights: kiln before (every GEMM on OpenBLAS, the default for a
Linear weight before prepacking: `gemm_backends=("blas",)`) vs kiln after (the default: the
packed "cpp" kernel for constant B where the heuristic picks it) vs torch eager (F.linear,
MKL/oneDNN) vs onnxruntime (a one-node MatMul with the weight as initializer), at 1 and 2
threads, medians of interleaved rounds. M in {1, 8, 64, 512} x (N, K) in (1024, 1024),
(4096, 1024), (1024, 4096); for M = 1 the weight's GB/s against the machine's copy
bandwidth (a 256 MiB torch copy: read + write bytes per second). Then the zoo `mlp`, `gpt`
and a BERT-like encoder end to end, kiln before / after vs ORT (legacy torch.onnx export).

    PYTHONPATH=$PWD .venv/bin/python bench/gemm_cpu.py [--rounds 7] [--markdown BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import io
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import kiln  # noqa: E402
from kiln.models import zoo  # noqa: E402

SHAPES = [(1024, 1024), (4096, 1024), (1024, 4096)]  # (N, K): weight [N, K]
MS = (1, 8, 64, 512)
THREADS = (1, 2)
BEFORE = kiln.Options(gemm_backends=("blas",))
AFTER = kiln.Options()


def _bench(fns: dict, rounds: int, min_s: float = 0.03) -> dict[str, float]:
    """Median seconds per call of each fn, rounds interleaved (A B C A B C ...)."""
    times = {k: [] for k in fns}
    for f in fns.values():
        f()
    for _ in range(rounds):
        for k, f in fns.items():
            t0, n = time.perf_counter(), 0
            while True:
                f()
                n += 1
                dt = time.perf_counter() - t0
                if dt >= min_s:
                    break
            times[k].append(dt / n)
    return {k: statistics.median(v) for k, v in times.items()}


def copy_bandwidth(threads: int) -> float:
    """GB/s of a 256 MiB copy (read + write), torch at `threads` threads."""
    torch.set_num_threads(threads)
    a = torch.ones(64 << 20)
    b = torch.empty_like(a)
    t = _bench({"copy": lambda: b.copy_(a)}, 5, 0.2)["copy"]
    return 2 * a.numel() * 4 / t / 1e9


def _ort_session(onnx_bytes: bytes, threads: int):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    return ort.InferenceSession(onnx_bytes, so, providers=["CPUExecutionProvider"])


def _matmul_onnx(w_t: torch.Tensor) -> bytes:
    from onnx import TensorProto, helper, numpy_helper
    k, n = w_t.shape
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])
    init = numpy_helper.from_array(w_t.contiguous().numpy(), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm", [x], [y],
                              [init])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _load(model, args, dyn, opts, path: Path):
    return kiln.compile(model, args, dynamic_shapes=dyn, options=opts).load(path)


def gemm_table(rounds: int, work: Path, bw: dict[int, float]) -> list[str]:
    rows = ["| M | N x K | thr | kiln before | kiln after | torch | ORT | after / before | "
            "after / ORT | M=1 GB/s (% copy) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for n, k in SHAPES:
        torch.manual_seed(0)
        lin = torch.nn.Linear(k, n, bias=False).eval().requires_grad_(False)
        m_dim = torch.export.Dim("m", min=1, max=1024)
        ex = (torch.randn(8, k),)
        before = _load(lin, ex, ({0: m_dim},), BEFORE, work / f"b{n}_{k}.kiln")
        after = _load(lin, ex, ({0: m_dim},), AFTER, work / f"a{n}_{k}.kiln")
        onnx = _matmul_onnx(lin.weight.t())
        for thr in THREADS:
            torch.set_num_threads(thr)
            before.num_threads = after.num_threads = thr
            sess = _ort_session(onnx, thr)
            for m in MS:
                x = torch.randn(m, k)
                xn = x.numpy()
                ref = F.linear(x.double(), lin.weight.double())
                for r in (before, after):
                    torch.testing.assert_close(r(x).double(), ref, rtol=1e-4, atol=1e-3)
                t = _bench({"before": lambda: before(x), "after": lambda: after(x),
                            "torch": lambda: F.linear(x, lin.weight),
                            "ort": lambda: sess.run(None, {"x": xn})}, rounds)
                gbs = ""
                if m == 1:
                    g = n * k * 4 / t["after"] / 1e9
                    gbs = f"{g:.1f} ({100 * g / bw[thr]:.0f}%)"
                rows.append(f"| {m} | {n}x{k} | {thr} | {t['before'] * 1e6:.0f} us | "
                            f"{t['after'] * 1e6:.0f} us | {t['torch'] * 1e6:.0f} us | "
                            f"{t['ort'] * 1e6:.0f} us | {t['before'] / t['after']:.2f}x | "
                            f"{t['ort'] / t['after']:.2f}x | {gbs} |")
                print(rows[-1], flush=True)
    return rows


class EncoderLayer(torch.nn.Module):
    """A post-norm BERT layer written out (nn.TransformerEncoderLayer's eval fast path is one
    fused ATen op that neither export handles): fused QKV Linear, softmax attention, output
    Linear, residual + LayerNorm, GELU FFN, residual + LayerNorm."""

    def __init__(self, d=256, heads=4, ffn=1024):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.out = torch.nn.Linear(d, d)
        self.fc1 = torch.nn.Linear(d, ffn)
        self.fc2 = torch.nn.Linear(ffn, d)
        self.ln1 = torch.nn.LayerNorm(d)
        self.ln2 = torch.nn.LayerNorm(d)

    def forward(self, x):
        b, s, d = x.shape
        h = self.heads
        q, k, v = self.qkv(x).reshape(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
        att = torch.softmax(q @ k.transpose(-1, -2) * (d // h) ** -0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = self.ln1(x + self.out(y))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class BertLike(torch.nn.Module):
    """4 encoder layers, d_model 256, 4 heads, FFN 1024."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(EncoderLayer() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _models():
    out = []
    for name in ("mlp", "gpt"):
        spec = zoo.get(name)
        out.append((name, spec.module, spec.example_args, spec.dynamic_shapes))
    torch.manual_seed(0)
    out.append(("bert-like b4 s128", BertLike().eval().requires_grad_(False),
                (torch.randn(4, 128, 256),), None))
    return out


def _onnx_export(module, args) -> bytes | None:
    f = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, args, f, dynamo=False, opset_version=17)
    except Exception as e:  # exporter gaps: the ORT column stays empty
        print(f"onnx export failed: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
        return None
    return f.getvalue()


def model_table(rounds: int, work: Path) -> list[str]:
    rows = ["| model | thr | kiln before | kiln after | ORT | after / before | after / ORT | "
            "2 thr speedup (after) |", "|---|---|---|---|---|---|---|---|"]
    for name, module, args, dyn in _models():
        before = _load(module, args, dyn, BEFORE, work / f"{name[:4]}_b.kiln")
        after = _load(module, args, dyn, AFTER, work / f"{name[:4]}_a.kiln")
        onnx = _onnx_export(module, args)
        feeds = None
        one = {}
        for thr in THREADS:
            torch.set_num_threads(thr)
            before.num_threads = after.num_threads = thr
            fns = {"before": lambda: before(*args), "after": lambda: after(*args)}
            if onnx is not None:
                sess = _ort_session(onnx, thr)
                feeds = {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)}
                fns["ort"] = lambda: sess.run(None, feeds)
            t = _bench(fns, rounds)
            one.setdefault("after", t["after"])
            ort = t.get("ort")
            ort_ms = "" if ort is None else f"{ort * 1e3:.2f} ms"
            ort_ratio = "" if ort is None else f"{ort / t['after']:.2f}x"
            rows.append(f"| {name} | {thr} | {t['before'] * 1e3:.2f} ms | "
                        f"{t['after'] * 1e3:.2f} ms | {ort_ms} | "
                        f"{t['before'] / t['after']:.2f}x | {ort_ratio} | "
                        f"{one['after'] / t['after']:.2f}x |")
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--skip-models", action="store_true")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp())
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    bw = {t: copy_bandwidth(t) for t in THREADS}
    head = [f"`uptime` at start: {load}", "",
            f"copy bandwidth (256 MiB, read + write): "
            f"{', '.join(f'{t} thr {bw[t]:.1f} GB/s' for t in THREADS)}", ""]
    print("\n".join(head), flush=True)
    rows = gemm_table(a.rounds, work, bw)
    mrows = [] if a.skip_models else model_table(a.rounds, work)
    end = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    body = "\n".join(head + rows + [""] + mrows + ["", f"`uptime` at end: {end}"])
    print(body)
    if a.markdown:
        from bench.markdown import splice
        splice(a.markdown, "<!-- gemm-prepacked:begin -->", "<!-- gemm-prepacked:end -->", body,
               "## CPU GEMM with prepacked weights (bench/gemm_cpu.py)")


if __name__ == "__main__":
    main()
