"""CPU convolution networks: kiln's direct NCHWc convolution (Options.cpu_conv "direct", the
default) against kiln's im2col + GEMM path (cpu_conv "im2col", what kiln did before), ONNX
Runtime and torch eager, at 1 and 2 threads, in one run.

Models: ResNet-18 (kiln.models.zoo, 3x224x224) at batch 1 and 8, and MobileNetV2 (width 1.0,
224x224, defined here: no torchvision) at batch 1, float32, eval mode. Each implementation is
timed in interleaved rounds (round r runs every implementation once, `--calls` calls each,
after warm-up); the figure is the median call time over all rounds. kiln packages are loaded
with `num_threads`; ONNX Runtime sessions (exported with torch.onnx.export, dynamo=False;
ORT_ENABLE_ALL) use intra_op_num_threads; eager uses torch.set_num_threads. The load average
(`uptime`) is printed with the table: the box is shared, so compare ratios within one run.

    python bench/conv_cpu.py [--models resnet18,resnet18_b8,mobilenet_v2] [--threads 2,1]
                             [--rounds 5] [--calls 10] [--markdown BENCHMARKS.md]

--markdown FILE replaces the section between <!-- conv-cpu:begin --> and <!-- conv-cpu:end -->.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kiln  # noqa: E402
from bench.markdown import splice  # noqa: E402
from kiln import runtime as kr  # noqa: E402
from kiln.models.zoo import resnet18  # noqa: E402

BEGIN, END = "<!-- conv-cpu:begin -->", "<!-- conv-cpu:end -->"


# -- MobileNetV2 (Sandler et al. 2018), width 1.0 ------------------------------------------------
def _cbr(cin, cout, k, stride, groups=1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, k, stride, k // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout), nn.ReLU6()]


class InvertedResidual(nn.Module):
    def __init__(self, cin, cout, stride, expand) -> None:
        super().__init__()
        hid = cin * expand
        layers = _cbr(cin, hid, 1, 1) if expand != 1 else []
        layers += _cbr(hid, hid, 3, stride, groups=hid)
        layers += [nn.Conv2d(hid, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.body = nn.Sequential(*layers)
        self.skip = stride == 1 and cin == cout

    def forward(self, x):
        y = self.body(x)
        return x + y if self.skip else y


class MobileNetV2(nn.Module):
    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                (6, 160, 3, 2), (6, 320, 1, 1))  # expand, channels, repeats, first stride

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers = _cbr(3, 32, 3, 2)
        cin = 32
        for t, c, n, s in self.SETTINGS:
            for i in range(n):
                layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        layers += _cbr(cin, 1280, 1, 1)
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(1280, num_classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def _randomise_bn(m: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    for b in m.modules():
        if isinstance(b, nn.BatchNorm2d):
            with torch.no_grad():
                b.running_mean.copy_(torch.randn(b.num_features, generator=g) * 0.1)
                b.running_var.copy_(torch.rand(b.num_features, generator=g) + 0.5)
    return m.eval()


def models() -> dict:
    """name -> (module, example input)."""
    r18 = resnet18().module.eval()
    torch.manual_seed(0)
    mb = _randomise_bn(MobileNetV2(), 0)
    return {"resnet18": (r18, torch.randn(1, 3, 224, 224)),
            "resnet18_b8": (r18, torch.randn(8, 3, 224, 224)),
            "mobilenet_v2": (mb, torch.randn(1, 3, 224, 224))}


# -- the implementations ---------------------------------------------------------------------------
def _ort_session(module, x, threads: int, path: Path):
    try:
        import onnxruntime as ort  # deferred: a benchmark-only extra
    except ImportError:
        return None
    if not path.exists():
        torch.onnx.export(module, (x,), str(path), dynamo=False, input_names=["x"],
                          output_names=["y"], opset_version=17)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    feed = {"x": x.numpy()}
    return lambda: sess.run(None, feed)


def _eager(module, x, threads: int):
    def run():
        torch.set_num_threads(threads)
        with torch.no_grad():
            return module(x)
    return run


def _median_ms(fn, calls: int) -> float:
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet18,resnet18_b8,mobilenet_v2")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--markdown", default=None)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kiln-conv-bench-"))
    threads = [int(t) for t in a.threads.split(",")]
    all_models = models()
    rows = []
    for name in a.models.split(","):
        module, x = all_models[name]
        with torch.no_grad():
            want = module(x)
        paths, compile_s = {}, {}
        for mode in ("im2col", "direct"):
            t = time.perf_counter()
            paths[mode] = kiln.compile(module, (x,), options=kiln.Options(cpu_conv=mode)).save(
                work / f"{name}_{mode}.kiln")
            compile_s[mode] = time.perf_counter() - t
        for nt in threads:
            impls = {mode: kr.load(paths[mode], num_threads=nt) for mode in paths}
            errs = {}
            for mode, r in impls.items():
                errs[mode] = (r(x) - want).abs().max().item()
            fns = {mode: (lambda r=r: r(x)) for mode, r in impls.items()}
            ort_fn = _ort_session(module, x, nt, work / f"{name}.onnx")
            if ort_fn is not None:
                fns["ort"] = ort_fn
            fns["eager"] = _eager(module, x, nt)
            for fn in fns.values():  # warm-up
                fn(), fn()
            ms: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(a.rounds):
                for k, fn in fns.items():
                    ms[k].append(_median_ms(fn, a.calls))
            med = {k: statistics.median(v) for k, v in ms.items()}
            rows.append((name, int(x.shape[0]), nt, med, errs, compile_s))
            print(name, nt, {k: round(v, 2) for k, v in med.items()}, "max err", errs,
                  flush=True)
            for r in impls.values():
                r.close()
    load = os.getloadavg()
    out = [f"CPU convolution networks, median ms per call ({a.rounds} rounds x {a.calls} calls, "
           f"interleaved); `uptime` load {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
           f"{os.cpu_count()} CPUs; torch {torch.__version__}.",
           "",
           "| model | batch | threads | kiln im2col (before) | kiln direct | ONNX Runtime | eager "
           "| before / direct | direct / ORT | direct / eager | max abs err direct |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, b, nt, med, errs, _ in rows:
        ort = med.get("ort", float("nan"))
        out.append(f"| {name.removesuffix('_b8')} | {b} | {nt} | {med['im2col']:.1f} | "
                   f"{med['direct']:.1f} | {ort:.1f} | {med['eager']:.1f} | "
                   f"{med['im2col'] / med['direct']:.2f}x | {med['direct'] / ort:.2f} | "
                   f"{med['direct'] / med['eager']:.2f} | {errs['direct']:.1e} |")
    text = "\n".join(out)
    print(text)
    if a.markdown:
        splice(a.markdown, BEGIN, END, text, "## CPU convolution (bench/conv_cpu.py)")


if __name__ == "__main__":
    main()
