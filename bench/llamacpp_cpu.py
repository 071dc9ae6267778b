"""Decode one token of a Llama-shaped decoder on the CPU: kiln against llama.cpp (issue 17).

The model is bench/llm_cpu.py's (`--size`, random weights at std 1/sqrt(fan-in), seed 0),
saved with `save_pretrained` and converted to GGUF by llama.cpp's own converter
(convert_hf_to_gguf.py's `conversion` package, run in this process: f32 and bf16), and
quantised by llama.cpp's `llama_model_quantize` from the f32 GGUF (Q8_0 and Q4_0, `pure`:
every weight, output and token embedding included, in that one format; llama.cpp's default
would keep the output matrix in Q6_K). The model has no tokenizer: the GGUF's vocabulary is
the converter's "none" (`vocab_size` dummy tokens); token ids are fed directly.

Formats (kiln's package of the same model; llama.cpp's GGUF):

  fp32       kiln fp32                                    | GGUF F32
  bf16       kiln bf16 (the model in bfloat16)            | GGUF BF16 (norms F32)
  int8       Options(weight_quant="int8"): int8 per output channel, fp32 activations
             ("dequant" kernel)                            | Q8_0
  int8_vnni  the same weights, weight_quant_kernel="vnni": activations quantised to int8 per
             row, integer dot products                    | Q8_0
  int4       Options(weight_quant="int4", weight_quant_group=`--group`): int4 group-wise along
             K, an fp32 scale per group, fp32 activations  | Q4_0
  int4_vnni  the same int4 weights, weight_quant_kernel="vnni": activations quantised to int8
             per row, integer dot products (vpdpbusd)     | Q4_0

Q8_0 and Q4_0 are llama.cpp's block formats: 32 values share one fp16 scale, and the
activations are quantised to Q8_0 blocks for integer dot products (CPU "repack" layouts where
the CPU has them). The KV cache: F32 in llama.cpp for every format but bf16 (BF16), as kiln's
cache is in the model's dtype.

Position: both decode one token at position `--pos` (128) after a prompt of `--pos` random
tokens. kiln: the package's one-token program (bench/llm_cpu.py's build: HF static cache of
`--cache` positions), the prompt fed token by token (the agreement check), then every timed
call decodes at `--pos` (the same slot rewritten; at a further thread count a freshly loaded
package, whose zero cache costs the same work). llama.cpp: `Llama(n_ctx=--cache,
logits_all=True)`, the prompt evaluated as one batch, then every timed call is
`Llama.eval([token])` with `n_tokens` reset to `--pos` (llama.cpp drops the cache cells from
`--pos` on and decodes at `--pos`; the full vocabulary's logits are copied out, as kiln
returns them).

Agreement: the logits at the prompt's last position against eager fp32 (the HF model on the
whole prompt): max |diff| and whether the argmax agrees, kiln's and llama.cpp's, every format.
fp32 must agree closely (a wrong rope layout or norm epsilon shows here first).

Timing: `--rounds` rounds, each timing kiln and llama.cpp in turn (order swapped every round)
for `--calls` calls after 2 warm-up calls (bench/llm_cpu.py's time_calls); a round's figure is
its median call, the reported one the median over rounds. `uptime` load is sampled every round.
Pin the process yourself (`taskset -c 1` for 1 thread).

Needs llama-cpp-python (`pip install -e .[bench-llamacpp]`: built from source, about 25
minutes on 2 cores) and llama.cpp's converter: the llama.cpp tree vendored in the
llama-cpp-python sdist (`pip download --no-deps --no-binary :all: llama-cpp-python`, unpack,
`<dir>/vendor/llama.cpp`), given as `--llama-cpp-src` or $LLAMA_CPP_SRC.

    python bench/llamacpp_cpu.py --llama-cpp-src DIR [--size 8x1024] [--threads 1,2]
        [--formats fp32,bf16,int8,int8_vnni,int4,int4_vnni] [--rounds 5] [--calls 10] [--group 128]
        [--markdown BENCHMARKS.md] [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kiln  # noqa: E402
# bench/llm_cpu.py: the model sizes, the HF decoder helpers (tests/e2e/hf_decoders.py as H),
# its call timer and load sampler; imported, not copied
from bench.llm_cpu import SIZES, H, load_avg, time_calls  # noqa: E402
from bench.machine import cpu_name  # noqa: E402
from bench.markdown import splice  # noqa: E402

#: format -> (kiln model dtype, kiln Options fields, GGUF type)
FORMATS = {
    "fp32": (torch.float32, {}, "F32"),
    "bf16": (torch.bfloat16, {}, "BF16"),
    "int8": (torch.float32, {"weight_quant": "int8"}, "Q8_0"),
    "int8_vnni": (torch.float32, {"weight_quant": "int8", "weight_quant_kernel": "vnni"},
                  "Q8_0"),
    "int4": (torch.float32, {"weight_quant": "int4"}, "Q4_0"),
    "int4_vnni": (torch.float32, {"weight_quant": "int4", "weight_quant_kernel": "vnni"},
                  "Q4_0"),
}
#: the environment of llama.cpp's OpenMP pool (libgomp; kiln's packages run their own pool),
#: recorded with each run
OPENMP_ENV = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS", "OMP_PROC_BIND")
#: ggml.h's GGML_TYPE_BF16 (llama_cpp.py names F32 and F16 but not this one)
GGML_TYPE_BF16 = 30


def import_llama_cpp():
    """llama_cpp, or exit with what to install."""
    try:
        import llama_cpp  # deferred: optional benchmark dependency (extra bench-llamacpp)
    except ImportError as e:
        sys.exit("bench/llamacpp_cpu.py: llama_cpp (llama-cpp-python) is not importable "
                 f"({e}). Install it with `pip install -e .[bench-llamacpp]` (builds "
                 "llama.cpp from source) or put a built copy on PYTHONPATH.")
    return llama_cpp


def import_converter(src: str | None):
    """llama.cpp's HF -> GGUF converter (`conversion`, `gguf`) from a llama.cpp tree."""
    if not src:
        sys.exit("bench/llamacpp_cpu.py: --llama-cpp-src (or $LLAMA_CPP_SRC) must name a "
                 "llama.cpp source tree with convert_hf_to_gguf.py (the sdist of "
                 "llama-cpp-python carries one in vendor/llama.cpp)")
    path = Path(src)
    if not (path / "conversion").is_dir():
        sys.exit(f"bench/llamacpp_cpu.py: --llama-cpp-src {src}: expected llama.cpp's "
                 f"`conversion` package (convert_hf_to_gguf.py's) in it, found none")
    sys.path.insert(0, str(path))
    if (path / "gguf-py").is_dir():  # the converter's own gguf, as convert_hf_to_gguf.py does
        sys.path.insert(1, str(path / "gguf-py"))
    import gguf  # deferred: only with --llama-cpp-src; the tree's own copy
    from conversion import get_model_class  # deferred: llama.cpp's converter, from that tree
    return gguf, get_model_class


def convert(hf_dir: Path, out: Path, gguf_type: str, src: str | None, llama_cpp) -> Path:
    """The GGUF of `gguf_type` of the saved HF model (cached under `out`)."""
    path = out / f"{hf_dir.name}-{gguf_type.lower()}.gguf"
    if path.exists():
        return path
    if gguf_type in ("F32", "BF16"):
        gguf, get_model_class = import_converter(src)
        base = get_model_class("LlamaForCausalLM")

        class NoVocab(base):  # the model has no tokenizer: "none" vocabulary of vocab_size
            model_arch = base.model_arch

            def set_vocab(self):
                self._set_vocab_none()

        ftype = {"F32": gguf.LlamaFileType.ALL_F32, "BF16": gguf.LlamaFileType.MOSTLY_BF16}
        with torch.inference_mode():
            NoVocab(hf_dir, ftype[gguf_type], path).write()
        return path
    f32 = convert(hf_dir, out, "F32", src, llama_cpp)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
                    "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}[gguf_type]
    params.pure = True
    params.nthread = 1
    rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(path).encode(),
                                        ctypes.byref(params))
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {gguf_type} failed ({rc})")
    return path


def kiln_package(model: torch.nn.Module, fmt: str, cache: int, threads: int, group: int,
                 work: Path, tag: str) -> Path:
    """kiln's package of `model` in `fmt` (cached under `work`)."""
    dtype, fields, _ = FORMATS[fmt]
    opts = replace(kiln.Options(num_threads=threads), **fields)
    grouped = fmt.startswith("int4")
    if grouped:
        opts = replace(opts, weight_quant_group=group)
    pkg = work / f"kiln_{tag}_{fmt}{'_g%d' % group if grouped else ''}_t{threads}.kiln"
    if not pkg.exists():
        module = H.static_module(model.to(dtype), cache)
        t = time.perf_counter()
        kiln.compile(H.export_decode(module), options=opts).save(pkg)
        print(f"compiled {pkg.name} in {time.perf_counter() - t:.0f} s", flush=True)
    return pkg


def llama_context(llama_cpp, path: Path, gguf_type: str, cache: int, threads: int):
    kv = GGML_TYPE_BF16 if gguf_type == "BF16" else llama_cpp.GGML_TYPE_F32
    return llama_cpp.Llama(model_path=str(path), n_ctx=cache, n_batch=cache, n_ubatch=cache,
                           n_threads=threads, n_threads_batch=threads, logits_all=True,
                           type_k=kv, type_v=kv, verbose=False)


def agreement(logits: torch.Tensor, ref: torch.Tensor) -> dict:
    logits = logits.float().reshape(-1)
    return {"max_abs_diff": (logits - ref).abs().max().item(),
            "argmax_agrees": bool(logits.argmax() == ref.argmax())}


def run(args) -> dict:
    llama_cpp = import_llama_cpp()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    threads = [int(t) for t in str(args.threads).split(",")]
    formats = args.formats.split(",")
    for f in formats:
        if f not in FORMATS:
            sys.exit(f"--formats: unknown format {f!r} (known: {', '.join(FORMATS)})")
    if not all((work / f"hf_{args.size}-{FORMATS[f][2].lower()}.gguf").exists()
               for f in formats):
        import_converter(args.llama_cpp_src)  # fail before building anything
    sizes = SIZES[args.size]
    tag = args.size
    hf_dir = work / f"hf_{tag}"

    def fresh_model():
        return H.build_model("llama", torch.float32, **sizes, max_pos=max(2048, args.cache))

    model = fresh_model()
    if not (hf_dir / "config.json").exists():
        model.save_pretrained(hf_dir)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, sizes["vocab"], (args.pos,), generator=gen).tolist()
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    del model
    token = prompt[-1]
    res = {"size": args.size, "config": sizes, "cache": args.cache, "pos": args.pos,
           "group": args.group, "cpu": cpu_name(), "llama_cpp": llama_cpp.__version__,
           "affinity": sorted(os.sched_getaffinity(0)), "rows": [], "agreement": {},
           "env": {k: os.environ[k] for k in OPENMP_ENV if k in os.environ}}
    for fmt in formats:
        gguf_type = FORMATS[fmt][2]
        gguf_path = convert(hf_dir, work, gguf_type, args.llama_cpp_src, llama_cpp)
        pkg = kiln_package(fresh_model(), fmt, args.cache, max(threads), args.group, work, tag)
        gc.collect()
        llm = llama_context(llama_cpp, gguf_path, gguf_type, args.cache, max(threads))
        llm.eval(prompt)
        agree = {"llama.cpp": agreement(torch.from_numpy(np.array(llm.scores[args.pos - 1])),
                                        ref)}
        runner = kiln.load(pkg, num_threads=max(threads))
        for p, tok in enumerate(prompt):
            out = runner(input_ids=torch.tensor([[tok]]), cache_position=torch.tensor([p]))
        agree["kiln"] = agreement(out, ref)
        res["agreement"][fmt] = {**agree, "gguf": gguf_type,
                                 "gguf_bytes": gguf_path.stat().st_size}
        print(json.dumps({"format": fmt, **res["agreement"][fmt]}), flush=True)
        ids, pos = torch.tensor([[token]]), torch.tensor([args.pos])
        for nt in threads:
            if nt != max(threads):  # a fresh cache: the same work (every position < pos read)
                runner.close()
                runner = kiln.load(pkg, num_threads=nt)
            llama_cpp.llama_set_n_threads(llm.ctx, nt, nt)

            def llamacpp_step(m=llm):
                m.n_tokens = args.pos
                m.eval([token])

            systems = {"kiln": lambda r=runner: r(input_ids=ids, cache_position=pos),
                       "llama.cpp": llamacpp_step}
            times = {n: [] for n in systems}
            loads = []
            names = list(systems)
            for r in range(args.rounds):
                loads.append(load_avg())
                for n in (names if r % 2 == 0 else names[::-1]):
                    torch.set_num_threads(nt)
                    times[n].append(time_calls(systems[n], args.calls))
            row = {"format": fmt, "gguf": gguf_type, "threads": nt, "loads": loads, "ms": {}}
            for n in names:
                row["ms"][n] = {"median": statistics.median(times[n]) * 1e3,
                                "rounds": [t * 1e3 for t in times[n]]}
            res["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "loads"}), flush=True)
        runner.close()
        del llm, runner
        gc.collect()
    return res


def markdown(runs: list[tuple[dict, str]]) -> str:
    """The tables of one or more runs (result, command): e.g. 1 thread and 2 threads, each
    under its own `taskset`."""
    res = runs[0][0]
    c = res["config"]
    lines = [f"Llama-shaped decoder `{res['size']}` (hidden {c['hidden']}, {c['layers']} layers, "
             f"{c['heads']} heads / {c['kv_heads']} KV heads, MLP {c['intermediate']}, vocab "
             f"{c['vocab']}), one token decoded at position {res['pos']} after a "
             f"{res['pos']}-token prompt, context {res['cache']}, {res['cpu']}, llama-cpp-python "
             f"{res['llama_cpp']}. Commands (CPU affinity of each process):", ""]
    lines += ["    " + "".join(f"{k}={v} " for k, v in r.get("env", {}).items())
              + f"{cmd}    # CPU affinity {r['affinity']}" for r, cmd in runs]
    lines += ["",
             "| format (kiln) | llama.cpp | threads | OpenMP env | kiln ms/token "
             "| llama.cpp ms/token | llama.cpp / kiln | load (1/5/15 min) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    def name(run: dict, fmt: str) -> str:
        return f"{fmt} (g{run['group']})" if fmt.startswith("int4") else fmt

    for run, _ in runs:
        for r in run["rows"]:
            k, lc = r["ms"]["kiln"]["median"], r["ms"]["llama.cpp"]["median"]
            env = " ".join(f"{k}={v}" for k, v in run.get("env", {}).items()) or "default"
            lines.append(f"| {name(run, r['format'])} | {r['gguf']} | {r['threads']} | {env} "
                         f"| {k:.1f} "
                         f"| {lc:.1f} | {lc / k:.2f}x | {r['loads'][0]} ... {r['loads'][-1]} |")
    lines += ["", "Logits at the prompt's last position against eager fp32 (max |diff|, "
              "argmax agrees):", "",
              "| format | GGUF | GGUF MiB | kiln | llama.cpp |", "| --- | --- | --- | --- | --- |"]
    seen = set()
    for run, _ in runs:  # the same model and prompt in every run: each format once
        for fmt, a in run["agreement"].items():
            if name(run, fmt) in seen:
                continue
            seen.add(name(run, fmt))
            cell = [f"{a[s]['max_abs_diff']:.2e}, {'yes' if a[s]['argmax_agrees'] else 'no'}"
                    for s in ("kiln", "llama.cpp")]
            lines.append(f"| {name(run, fmt)} | {a['gguf']} | {a['gguf_bytes'] / 2**20:.0f} "
                         f"| {cell[0]} | {cell[1]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="8x1024", choices=sorted(SIZES))
    ap.add_argument("--formats", default="fp32,bf16,int8,int8_vnni,int4,int4_vnni")
    ap.add_argument("--threads", default="1", help="thread counts, comma-separated")
    ap.add_argument("--cache", type=int, default=512)
    ap.add_argument("--pos", type=int, default=128)
    ap.add_argument("--group", type=int, default=128, help="kiln's int4 group size")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--llama-cpp-src", default=os.environ.get("LLAMA_CPP_SRC"))
    ap.add_argument("--work", default="/tmp/kiln-llamacpp-cpu")
    ap.add_argument("--json")
    ap.add_argument("--markdown")
    ap.add_argument("--combine", nargs="+", metavar="JSON",
                    help="run nothing: write --markdown from these --json results (one table)")
    args = ap.parse_args()
    if args.combine:
        runs = [(d := json.loads(Path(p).read_text()), d["command"]) for p in args.combine]
    else:
        res = run(args)
        res["command"] = "python bench/llamacpp_cpu.py " + " ".join(sys.argv[1:])
        if args.json:
            Path(args.json).write_text(json.dumps(res, indent=1, default=str))
        runs = [(res, res["command"])]
    if args.markdown:
        splice(args.markdown, "<!-- llamacpp-cpu:begin -->", "<!-- llamacpp-cpu:end -->",
               markdown(runs), heading="## CPU decode: kiln against llama.cpp (issue 17)")


if __name__ == "__main__":
    main()
