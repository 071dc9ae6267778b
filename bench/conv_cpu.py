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
                             [--kiln-modes im2col,direct,onednn,autotuned] [--no-eager]

--markdown FILE replaces the section between <!-- conv-cpu:begin --> and <!-- conv-cpu:end -->.
kiln modes: "im2col" and "direct" (Options.cpu_conv), "onednn" (every direct convolution on
oneDNN: cpu_conv_backends=("onednn",)), "autotuned" (max_autotune with both convolution
backends: each shape timed kiln vs oneDNN, the faster kept; kiln/targets/cpu/dnnl.py).

    python bench/conv_cpu.py --per-shape [--models resnet18,mobilenet_v2] [--markdown FILE]

times every distinct convolution shape of the models with the autotuner's own driver:
kiln_conv.h against oneDNN, calls alternating, each one's fastest call kept, on kiln's pool at
OMP_NUM_THREADS threads (run it under `taskset -c 1` with OMP_NUM_THREADS=1 for one core).
The standalone convolution steps of kiln's package (the autotuner's candidates) exactly, with
their fused epilogue and residual; then the convolutions inside MobileNetV2's fused inverted
residual blocks (recorded by forward hooks, the following ReLU6 as the epilogue), which run
as one kiln_conv.h call and are not candidates.
--markdown replaces <!-- conv-onednn:begin --> ... <!-- conv-onednn:end -->.
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
SHAPES_BEGIN, SHAPES_END = "<!-- conv-onednn:begin -->", "<!-- conv-onednn:end -->"
MODELS_BEGIN, MODELS_END = "<!-- conv-onednn-models:begin -->", "<!-- conv-onednn-models:end -->"
#: kiln mode -> Options
MODES = {"im2col": dict(cpu_conv="im2col"), "direct": {},
         "onednn": dict(cpu_conv_backends=("onednn",)), "autotuned": dict(max_autotune=True)}


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


def _median_ms(fn, calls: int, fastest: list | None = None) -> float:
    """Median ms of `calls` calls; the fastest call is appended to `fastest` when given."""
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    if fastest is not None:
        fastest.append(min(ts) * 1e3)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="resnet18,resnet18_b8,mobilenet_v2")
    ap.add_argument("--threads", default="2,1")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--markdown", default=None)
    ap.add_argument("--kiln-modes", default="im2col,direct")
    ap.add_argument("--no-eager", action="store_true")
    ap.add_argument("--per-shape", action="store_true")
    ap.add_argument("--seconds", default="1.0", help="--per-shape: timing per candidate")
    a = ap.parse_args()
    if a.per_shape:
        return per_shape(a)
    modes = a.kiln_modes.split(",")
    work = Path(tempfile.mkdtemp(prefix="kiln-conv-bench-"))
    threads = [int(t) for t in a.threads.split(",")]
    all_models = models()
    rows = []
    for name in a.models.split(","):
        module, x = all_models[name]
        with torch.no_grad():
            want = module(x)
        paths, compile_s = {}, {}
        for mode in modes:
            t = time.perf_counter()
            opts = kiln.Options(**MODES[mode], **({"num_threads": threads[0]}
                                                  if mode == "autotuned" else {}))
            paths[mode] = kiln.compile(module, (x,), options=opts).save(
                work / f"{name}_{mode}.kiln")
            compile_s[mode] = time.perf_counter() - t
            print(f"compiled {name} {mode} in {compile_s[mode]:.1f} s", flush=True)
        for nt in threads:
            impls = {mode: kr.load(paths[mode], num_threads=nt) for mode in paths}
            errs = {}
            for mode, r in impls.items():
                errs[mode] = (r(x) - want).abs().max().item()
            fns = {mode: (lambda r=r: r(x)) for mode, r in impls.items()}
            ort_fn = _ort_session(module, x, nt, work / f"{name}.onnx")
            if ort_fn is not None:
                fns["ort"] = ort_fn
            if not a.no_eager:
                fns["eager"] = _eager(module, x, nt)
            for fn in fns.values():  # warm-up
                fn(), fn()
            ms: dict[str, list[float]] = {k: [] for k in fns}
            best: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(a.rounds):
                for k, fn in fns.items():
                    ms[k].append(_median_ms(fn, a.calls, best[k]))
            med = {k: statistics.median(v) for k, v in ms.items()}
            med.update({f"{k}:min": min(v) for k, v in best.items()})
            rows.append((name, int(x.shape[0]), nt, med, errs, compile_s))
            print(name, nt, {k: round(v, 2) for k, v in med.items()}, "max err", errs,
                  flush=True)
            for r in impls.values():
                r.close()
    if modes != ["im2col", "direct"] or a.no_eager:
        return _generic_table(a, rows, modes)
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


def _generic_table(a, rows, modes) -> None:
    load = os.getloadavg()
    peers = [k for k in ("ort", "eager") if any(k in r[3] for r in rows)]
    names = {"im2col": "kiln im2col", "direct": "kiln direct (default)",
             "onednn": "kiln, every conv on oneDNN", "autotuned": "kiln max_autotune "
             "(conv: kiln vs oneDNN per shape)", "ort": "ONNX Runtime", "eager": "eager"}
    cols = modes + peers
    out = [f"CPU convolution networks, median ms per call ({a.rounds} rounds x {a.calls} calls, "
           f"interleaved), in brackets the fastest call; `uptime` load {load[0]:.2f} "
           f"{load[1]:.2f} {load[2]:.2f}; {os.cpu_count()} CPUs; torch {torch.__version__}; "
           f"affinity {sorted(os.sched_getaffinity(0))}.",
           "",
           "| model | batch | threads | " + " | ".join(names[c] for c in cols)
           + "".join(f" | {m} / direct" for m in cols if m != "direct")
           + " | max abs err |",
           "| --- " * (3 + 2 * len(cols) - ("direct" in cols) + 1) + "|"]
    for name, b, nt, med, errs, _ in rows:
        cells = [f"{med[c]:.1f} ({med[c + ':min']:.1f})" if c in med else "-" for c in cols]
        ratios = [f"{med[c] / med['direct']:.2f} ({med[c + ':min'] / med['direct:min']:.2f})"
                  if c in med and "direct" in med else "-" for c in cols if c != "direct"]
        err = ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
        out.append(f"| {name.removesuffix('_b8')} | {b} | {nt} | " + " | ".join(cells + ratios)
                   + f" | {err} |")
    text = "\n".join(out)
    print(text)
    if a.markdown:
        splice(a.markdown, MODELS_BEGIN, MODELS_END, text,
               "## CPU convolution: kiln with oneDNN, whole models (bench/conv_cpu.py)")


# -- per convolution shape: kiln_conv.h against oneDNN ------------------------------------------
def _conv_shapes(module, x) -> list[tuple]:
    """(Geometry, count) of every Conv2d call of `module` at input `x`, in first-use order:
    channels padded to the channel block as the package stores them, the activation that
    follows (ReLU -> relu, ReLU6 -> clamp 0..6) as the epilogue."""
    from kiln.targets.cpu import dnnl  # deferred: a benchmark of an optional backend
    from kiln.targets.cpu.conv import channel_block
    from kiln import config
    block = channel_block(kiln.Options(), config.cxx())
    seen: dict = {}
    mods = list(module.modules())
    nxt = {id(m): mods[i + 1] if i + 1 < len(mods) else None for i, m in enumerate(mods)}
    if any(isinstance(m, nn.BatchNorm2d) for m in mods):  # conv -> bn -> act
        nxt = {k: (nxt.get(id(v)) if isinstance(v, nn.BatchNorm2d) else v)
               for k, v in nxt.items()}

    def hook(m, args, out):
        xin = args[0]
        n, c, h, w = xin.shape
        dwise = m.groups > 1
        if m.groups not in (1, c):
            return
        plain = not dwise and c < block
        pad = lambda v: -(-v // block) * block  # noqa: E731
        act, lo, hi = 0, 0.0, 0.0
        f = nxt.get(id(m))
        if isinstance(f, nn.ReLU6):
            act, lo, hi = 2, 0.0, 6.0
        elif isinstance(f, nn.ReLU):
            act = 1
        g = dnnl.Geometry(n, c if plain else pad(c), h, w, pad(m.out_channels), out.shape[2],
                          out.shape[3], *m.kernel_size, *m.stride, *m.padding, *m.dilation,
                          dwise, plain, block, act, lo, hi, False, 1)
        seen[g] = seen.get(g, 0) + 1

    hs = [m.register_forward_hook(hook) for m in mods if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        module(x)
    for h in hs:
        h.remove()
    return list(seen.items())


def _package_shapes(module, x) -> list[tuple]:
    """(Geometry, count) of the convolution steps kiln's package runs standalone (candidates
    of the autotuner), exact: epilogue, residual and all, read from the create() lines of a
    build with every such step on oneDNN."""
    import re
    from kiln.targets.cpu import dnnl  # deferred: a benchmark of an optional backend
    compiled = kiln.compile(module, (x,), options=kiln.Options(
        cpu_conv_backends=("onednn",), num_threads=1))
    seen: dict = {}
    conv = {"true": True, "false": False, "INFINITY": float("inf"), "-INFINITY": float("-inf")}
    for m in re.finditer(r'\.init\(e, "[^"]*", ([^\n]*),\n', compiled.sources["model.cpp"]):
        vals = [conv[v] if v in conv else (float(v) if "." in v else int(v))
                for v in m.group(1).split(", ")]
        g = dnnl.Geometry(*vals)
        seen[g] = seen.get(g, 0) + 1
    return list(seen.items())


def per_shape(a) -> None:
    import subprocess
    from kiln.targets.cpu import dnnl  # deferred: a benchmark of an optional backend
    from kiln.targets.cpu.build import toolchain
    from kiln.toolchain.onednn import find_library
    found = find_library()
    if found is None:
        sys.exit("oneDNN is not installed: pip install onednn-cpu-gomp")
    all_models = models()
    load0 = os.popen("uptime").read().strip()
    rows = []
    for name in a.models.split(","):
        module, x = all_models[name]
        standalone = _package_shapes(module, x)
        key = lambda g: (g.icp, g.ih, g.iw, g.ocp, g.kh, g.kw, g.sh, g.depthwise)  # noqa: E731
        keys = {key(g) for g, _ in standalone}
        # the rest (MobileNetV2's expand / depthwise / project inside a fused block): shown,
        # not candidates (the block runs as one kiln_conv.h call)
        shapes = [(g, c, "") for g, c in standalone] + [
            (g, c, " (in a fused block)") for g, c in _conv_shapes(module, x)
            if key(g) not in keys]
        exe = dnnl.build_driver(toolchain(kiln.Options()), str(found[0]), shapes[0][0].block)
        for g, count, note in shapes:
            p = subprocess.run([str(exe), *g.args(), a.seconds], capture_output=True, text=True)
            line = next((ln.split() for ln in p.stdout.splitlines()
                         if ln.startswith("KILN_CONV_PROFILE")), None)
            if line is None:
                print(name, g.describe(), "failed:", p.stderr.strip()[-200:], flush=True)
                continue
            kiln_s, dnnl_s, err, tol = map(float, line[1:5])
            flops = 2 * g.n * g.ocp * g.oh * g.ow * g.kh * g.kw * (1 if g.depthwise else g.icp)
            rows.append((name, g, count, kiln_s, dnnl_s, line[5], err <= tol, flops, note))
            print(name, g.describe(), f"x{count}", f"kiln {kiln_s * 1e6:.1f} us",
                  f"oneDNN {dnnl_s * 1e6:.1f} us ({line[5]})", flush=True)
    load1 = os.popen("uptime").read().strip()
    omp = os.environ.get("OMP_NUM_THREADS", "")
    out = [f"Per convolution shape, batch 1, microseconds per call (best of interleaved "
           f"rounds, the autotuner's driver; OMP_NUM_THREADS={omp}, affinity "
           f"{sorted(os.sched_getaffinity(0))}); oneDNN "
           f"{found[1]} ({found[0].name}); load before `{load0}`, after `{load1}`.",
           "",
           "| model | convolution | calls | kiln us | oneDNN us | kiln GFLOPS | oneDNN GFLOPS "
           "| oneDNN / kiln | oneDNN impl | agree |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    tot: dict = {}
    for name, g, count, ks, ds, impl, ok, fl, note in rows:
        out.append(f"| {name} | {g.describe()}{note} | {count} | {ks * 1e6:.1f} | {ds * 1e6:.1f} | "
                   f"{fl / ks / 1e9:.0f} | {fl / ds / 1e9:.0f} | {ds / ks:.2f} | {impl} | "
                   f"{'yes' if ok else 'NO'} |")
        if note:
            continue
        t = tot.setdefault(name, [0.0, 0.0, 0.0])
        t[0] += ks * count
        t[1] += ds * count
        t[2] += min(ks, ds) * count
    out.append("")
    for name, (k, d, best) in tot.items():
        out.append(f"{name}: sum over its standalone convolutions kiln {k * 1e3:.2f} ms, oneDNN "
                   f"{d * 1e3:.2f} ms, the faster per shape {best * 1e3:.2f} ms.")
    text = "\n".join(out)
    print(text)
    if a.markdown:
        splice(a.markdown, SHAPES_BEGIN, SHAPES_END, text,
               "## CPU convolution: kiln_conv.h against oneDNN per shape (bench/conv_cpu.py)")


if __name__ == "__main__":
    main()
