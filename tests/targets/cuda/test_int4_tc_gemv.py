"""The tensor-core int4 GEMV in the compiler (issue 17 item 4): with
Options(cuda_int4_tensor_core=True) (off by default: slower end to end on an H100 so far),
bfloat16 GEMMs with int4 weights in groups of 128 or more are stored in kiln/gemm/int4_tc.py's
`pack_tc` order (quant_gemv.py `tc_packed`), the decode GEMVs print the tensor-core kernel
(gemv_template.py `_print_int4_tc_gemv`: `_kl_i4mma`, inline PTX) with the template's prologue
and epilogue, and the prefill kernel (`qlinear_int4_kernel`, TC) reads the same bytes.

Here (no GPU): the packing rule and its errors, the tensor-core configs, the prefill kernel's
TC addressing and the printed GEMVs (RMSNorm, silu(gate) * up, bias + residual; prefetch depths
0-2) in Triton's interpreter, whose `_kl_i4mma` sums each element's own products, against
float64 math of the dequantised module; a decode step's kernels, and the layout the PTX relies
on in a GEMV compiled for sm_90. On a GPU (`-m gpu`): the same modules at decoder widths and a
bf16 decode + prefill package against dequantised eager."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

import kiln  # noqa: E402
from kiln.gemm import gemv as GV  # noqa: E402
from kiln.gemm import int4_tc as TC  # noqa: E402
from kiln.gemm import quant_gemv as QG  # noqa: E402
from kiln.options import Options  # noqa: E402

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
from test_gemv import GluLin, NormLin, ResLin  # noqa: E402
from test_quant_gemv import build, dequantised, gemv_kernels, quant_opts  # noqa: E402


def test_packing_rule_and_its_switch():
    """Options.cuda_int4_tensor_core: bf16 and a power-of-two group >= 128 only; off (the
    default): the plain order."""
    assert QG.tc_packed(128, torch.bfloat16, True) and QG.tc_packed(256, torch.bfloat16, True)
    assert not QG.tc_packed(64, torch.bfloat16, True)
    assert not QG.tc_packed(128, torch.float16, True)
    assert not QG.tc_packed(128, torch.float32, True)
    assert not QG.tc_packed(192, torch.bfloat16, True)
    assert not QG.tc_packed(128, torch.bfloat16, False)
    assert not Options().cuda_int4_tensor_core


def test_tc_storage_is_the_same_values():
    """quantize_int4(tc=True) stores the plain form's bytes permuted: dequantize(tc=True)
    gives the same matrix, and the bytes differ."""
    torch.manual_seed(0)
    w = torch.randn(37, 512)
    plain, tc = QG.quantize_int4(w, 128), QG.quantize_int4(w, 128, tc=True)
    assert torch.equal(plain["s"], tc["s"]) and not torch.equal(plain["q"], tc["q"])
    assert torch.equal(QG.dequantize("int4", plain, 128),
                       QG.dequantize("int4", tc, 128, tc=True))
    assert torch.equal(TC.unpack_tc(tc["q"]), plain["q"])


def test_tc_configs():
    """Each config's BLOCK_K a multiple of the group dividing K; the heuristic's first by N
    (the standalone H100 winners); no duplicates."""
    for n, k, g in ((28672, 4096, 128), (4096, 14336, 128), (6144, 4096, 128), (37, 384, 128),
                    (1024, 1280, 256), (128256, 4096, 128)):
        cs = GV.tc_configs(n, k, g)
        assert cs and len(set(cs)) == len(cs)
        assert all(k % c.block_k == 0 and c.block_k % g == 0 for c in cs), cs
        first = cs[0]
        want = (16, 512, 1) if n >= 8192 else (8, 1024, 2) if n <= 4096 else (4, 1024, 1)
        if k % want[1] == 0:
            assert (first.block_n, first.block_k, first.num_warps) == want, (n, k, first)


_PREFILL = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined
    import torch, triton
    from kiln.gemm import quant_gemv as QG
    torch.manual_seed(0)
    bad = []
    for m, n, k, g in [(1, 40, 256, 128), (5, 24, 512, 128), (17, 33, 256, 256)]:
        w = torch.randn(n, k)
        parts = QG.quantize_int4(w, g, tc=True)
        want_w = QG.dequantize("int4", parts, g, tc=True)
        x = torch.randn(m, k).to(torch.float32)
        want = x.double() @ want_w.t()
        for consts, warps, _ in QG.configs("int4", 1 if m == 1 else None, n, k, g)[:2]:
            out = torch.empty(m, n, dtype=x.dtype)
            grid = (triton.cdiv(n, consts["BLOCK_N"]), triton.cdiv(m, consts["BLOCK_M"]))
            QG.qlinear_int4_kernel[grid](x, parts["q"], parts["s"], out, m, n, k, G=g,
                                         PRECISION="tf32x3", TC=True, num_warps=warps,
                                         **consts)
            err = (out.double() - want).abs().max().item()
            tol = 1e-5 * want.abs().max().item() * (1 if m == 1 else 4) + 1e-5
            print(m, n, k, g, consts, f"err {err:.3g} tol {tol:.3g}")
            if not err <= tol:
                bad.append(f"m={m} n={n} k={k} g={g} {consts}: {err:.3g} > {tol:.3g}")
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
""")


def _run(src: str, env_extra: dict | None = None) -> str:
    env = dict(os.environ, PYTHONPATH=str(HERE.parents[2]), **(env_extra or {}))
    out = subprocess.run([sys.executable, "-c", src, str(HERE)], env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]
    return out.stdout


def test_prefill_kernel_reads_the_tc_order_in_triton_interpreter():
    """qlinear_int4_kernel with TC (the GEMV loop, M = 1, and the tensor-core tiles, M > 1)
    against float64 math of the dequantised weight (float32 x: TF32x3 tiles)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _PREFILL], capture_output=True, text=True,
                         timeout=900, env=dict(env, PYTHONPATH=str(HERE.parents[2])))
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]


def tc_cases():
    """(name, module, input shapes, dtype, mode, group, source ops a GEMV must name): bf16,
    groups of 128 / 256, N not a multiple of the tile, K of 1-4 steps at the configs used."""
    return [
        ("norm_tc", NormLin(512, 37), [(1, 512)], torch.bfloat16, "int4", 128, {"mean"}),
        ("glu_tc", GluLin(256, 384, 40), [(1, 256)], torch.bfloat16, "int4", 128, set()),
        ("res_tc", ResLin(1024, 70), [(1, 1024), (1, 70)], torch.bfloat16, "int4", 256,
         {"add"}),
    ]


_GEMVS = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, sys.argv[1])
    from test_int4_tc_gemv import tc_cases
    from test_quant_gemv import build, dequantised
    from kiln.ir import loop as L
    from kiln.targets.cuda.build import triton_kernels
    from kiln.targets.cuda.kernel import Config, print_triton_module
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program

    bad = []
    for name, m, shapes, dtype, mode, group, _ in tc_cases():
        os.environ.pop("KILN_GEMV_PREFETCH", None)  # (as the cubins were built: cached)
        m, args, cm = build(name, m, shapes, dtype, mode, group, tc=True)
        b = cm.built
        bufs = {x.name: x for x in b.loop.buffers}
        hints = {s.name: s.example for s in b.graph.symbols}
        gemvs = [s.name for s in L.flat_steps(b.steps)
                 if getattr(getattr(s, "config", None), "gemv", False)]
        ref_m = dequantised(m, mode, group, torch.float64)
        eager_m = dequantised(m, mode, group, dtype)
        g = torch.Generator().manual_seed(3)
        xs = [torch.randn(s, generator=g).to(dtype) for s in shapes]
        with torch.no_grad():
            ref = ref_m(*[x.double() for x in xs])
            mine = eager_m(*xs).double()
        scale = ref.abs().max().item()
        eager = (mine - ref).abs().max().item()
        bound = 2 * eager + 1e-2 * scale
        # None: the heuristic's configs, depths 0 and 2 (glu's down); "1": one group a step
        # (K of 2-4 steps); "cc": the CUDA-core loop reading the tensor-core order
        for depth in (None, "1", "cc"):
            os.environ.pop("KILN_GEMV_PREFETCH", None)
            cfgs = {}
            if depth == "1":
                os.environ["KILN_GEMV_PREFETCH"] = depth
                cfgs = {n: Config(4, group, 1, 1) for n in gemvs}
            elif depth == "cc":
                cfgs = {n: Config(4, group, 4, 1, "cc") for n in gemvs}
            tks = triton_kernels(b.steps, bufs, hints, cfgs)
            src = {t.name: t.source for t in tks}
            if not all(("= _kl_i4mma(" in src[n]) == (depth != "cc") for n in gemvs):
                bad.append(f"{name} {depth}: the wrong kernel printed")
            got = run_program(b.program, {t.name: t for t in tks},
                              import_triton_module(print_triton_module(tks)), b.weights, xs)[0]
            err = (got.double().reshape(ref.shape) - ref).abs().max().item()
            print(name, depth, f"err {err:.3g} bound {bound:.3g}")
            if not err <= bound:
                bad.append(f"{name} depth {depth}: {err} > {bound}")
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
""")


def test_tc_gemvs_match_float64_in_triton_interpreter():
    """The printed tensor-core GEMVs with each fusion at prefetch depths 0-2 and the
    heuristic's config, in the interpreter, against float64 math of the dequantised module
    within twice eager's own bf16 error plus 1e-2 of the scale."""
    for c in tc_cases():  # cubins first: the AOT compiler cannot run in interpreter mode
        build(*c[:6], tc=True)
    _run(_GEMVS, {"TRITON_INTERPRET": "1"})


def test_decode_step_prints_the_tc_gemvs():
    """A bf16 Llama decode step with int4 group 128: every GEMV the tensor-core kernel (the
    same kernel list as bf16: prologues and epilogues kept), weights stored tc-ordered, and
    the tuner's candidates both kernels (variant "cc": the CUDA-core loop on that order);
    group 64, or the option off, keep the CUDA-core kernel."""
    pytest.importorskip("transformers")
    from kiln.models.hf_decoder import export_step, llama
    model = llama(layers=1, hidden=256, heads=4, kv_heads=2, vocab=256, inter=512)
    _, ep = export_step(model, 16, dtype=torch.bfloat16)
    base = [k["kind"] for k in kiln.compile(ep, device="cuda", options=replace(
        quant_opts("none"), weight_quant="none")).manifest["kernels"]]
    cm = kiln.compile(ep, device="cuda", options=quant_opts("int4", 128, tc=True))
    assert [k["kind"] for k in cm.manifest["kernels"]] == base
    gv = gemv_kernels(cm)
    assert len(gv) == 4 + 1 and all(":tc" in k["gemm"]["problem"] for k in gv), gv
    src = cm.built.sources["kernels_triton.py"]
    assert src.count("(tensor-core order)") == 5 and src.count("= _kl_i4mma(") >= 5
    # the launch tuner's candidates: the tensor-core configs first, then the CUDA-core loop's
    from kiln.gemm.configs import GemvConfig
    from kiln.ir import loop as L
    from kiln.targets.cuda.gemv_template import gemv_candidates
    for gk in [s for s in L.flat_steps(cm.built.steps)
               if getattr(getattr(s, "config", None), "gemv", False)]:
        cands = gemv_candidates(gk)
        assert cands[0].variant == "" and {c.variant for c in cands} == {"", "cc"}, cands
    c = GemvConfig(8, 1024, 2, 1, "cc")
    assert GemvConfig.from_json(c.to_json()) == c and c.name.endswith("_cc")
    cm64 = kiln.compile(ep, device="cuda", options=quant_opts("int4", 64, tc=True))
    assert "= _kl_i4mma(" not in cm64.built.sources["kernels_triton.py"]
    plain = kiln.compile(ep, device="cuda", options=quant_opts("int4", 128))
    assert "= _kl_i4mma(" not in plain.built.sources["kernels_triton.py"]
    assert not any(":tc" in k["gemm"]["problem"] for k in gemv_kernels(plain))


def test_package_prefill_reads_what_decode_stores():
    """A bf16 Llama package (prefill + decode, int4 group 128): decode's GEMVs are the
    tensor-core kernel, every prefill kernel call of qlinear_int4_kernel reads the tc order
    (TC True in each config), and the stored int4 weights are decode's, which prefill reads."""
    pytest.importorskip("transformers")
    import re
    from kiln.models import hf_decoder
    model = hf_decoder.llama(layers=1, hidden=256, heads=8, kv_heads=4, vocab=512,
                             inter=512).to(torch.bfloat16)
    cm = kiln.compile(hf_decoder.export_decoder(model, max_cache_len=64, max_prompt=16),
                      device="cuda", options=quant_opts("int4", 128, tc=True))
    pre, dec = cm.entries["prefill"], cm.entries["decode"]
    calls = re.findall(r"# (\w+) <- \w+: config 0 \{([^}]*)\}", pre.sources["user_triton.py"])
    assert len(calls) == 5 and all("'TC': True" in c for _, c in calls), calls
    assert dec.sources["kernels_triton.py"].count("= _kl_i4mma(") >= 5
    q4 = {w["name"] for w in cm.manifest["weights"] if w["name"].endswith("_q4")}
    ents = {e["name"]: e for e in cm.manifest["entries"]}
    read = lambda e: {v if isinstance(v, str) else v["key"]  # noqa: E731
                      for v in ents[e]["weights"].values()}
    assert q4 and q4 <= read("decode") and q4 & read("prefill"), (q4, ents)


def test_tc_gemv_compiles_to_the_layout_the_ptx_assumes():
    """An RMSNorm GEMV's tensor-core kernel compiled for sm_90 here: every operand of the
    inline PTX in one blocked layout of the [T, H, 4] tile, lanes along T in quads (no lane
    along the 4 words, one chunk a lane), and the mma in the PTX."""
    import re
    from kiln.ir import loop as L
    from kiln.targets.cuda.build import triton_kernels
    from kiln.targets.cuda.kernel import Config, print_triton_module
    from kiln.targets.cuda.wrapper_py import import_triton_module
    from kiln.toolchain.triton_aot import compile_kernel
    _, _, cm = build("norm", NormLin(1024, 300), [(1, 1024)], torch.bfloat16, "int4", 128,
                     tc=True)
    b = cm.built
    bufs = {x.name: x for x in b.loop.buffers}
    (gk,) = [s for s in L.flat_steps(b.steps) if getattr(getattr(s, "config", None), "gemv",
                                                          False)]
    for cfg in (Config(16, 512, 1, 1), Config(8, 1024, 2, 1)):
        tks = triton_kernels(b.steps, bufs, {}, {gk.name: cfg})
        tk = next(t for t in tks if t.name == gk.name)
        ck = compile_kernel(import_triton_module(print_triton_module(tks)), tk, 90)
        ttgir = ck.asm["ttgir"]
        line = next(t for t in ttgir.splitlines() if "tt.elementwise_inline_asm" in t)
        names = set(re.findall(r"tensor<[0-9x]+x(?:i32|bf16|f32), (#blocked\d*)>", line))
        assert len(names) == 1, names
        m = re.search(re.escape(names.pop()) + r" = #ttg\.blocked<\{(.*)\}>", ttgir)
        lay = {k: [int(v) for v in vs.split(",")] for k, vs in
               re.findall(r"(\w+) = \[([0-9, ]+)\]", m.group(1))}
        assert lay["order"][:2] == [2, 0], lay
        assert lay["threadsPerWarp"][2] == 1 and lay["threadsPerWarp"][0] % 4 == 0, lay
        assert lay["sizePerThread"][0] == 1, lay
        assert "mma.sync.aligned.m16n8k16" in ck.asm["ptx"]


# -- on a GPU (-m gpu) --------------------------------------------------------------------------

def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [c[0] for c in tc_cases()] + ["norm_8b", "glu_8b", "res_8b"])
def test_tc_gemvs_match_float64_on_gpu(tmp_path, case):
    """The interpreter's cases and 8B-wide ones (q/k/v 6144 x 4096 after RMSNorm, down
    4096 x 14336 of silu(gate) * up, a residual GEMV 4096 x 4096), launch configs tuned,
    against float64 math of the dequantised module."""
    _gpu()
    big = {"norm_8b": (NormLin(4096, 6144), [(1, 4096)], 128),
           "glu_8b": (GluLin(4096, 14336, 4096), [(1, 4096)], 128),
           "res_8b": (ResLin(4096, 4096), [(1, 4096), (1, 4096)], 128)}
    if case in big:
        m, shapes, group = big[case]
    else:
        _, m, shapes, _, _, group, _ = next(c for c in tc_cases() if c[0] == case)
    torch.manual_seed(0)
    dtype = torch.bfloat16
    m = m.to(dtype).eval()
    ref_m = dequantised(m, "int4", group, torch.float64).cuda()
    eager_m = dequantised(m, "int4", group, dtype).cuda()
    args = tuple(torch.randn(s).to(dtype) for s in shapes)
    cm = kiln.compile(torch.export.export(m, args), device="cuda",
                      options=Options(weight_quant="int4", weight_quant_group=group,
                                      cuda_int4_tensor_core=True))
    assert gemv_kernels(cm) and "= _kl_i4mma(" in cm.built.sources["kernels_triton.py"]
    runner = cm.load(tmp_path / "q.kiln", device="cuda:0")
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        xs = [torch.randn(s, device="cuda", generator=g).to(dtype) for s in shapes]
        with torch.no_grad():
            ref = ref_m(*[x.double() for x in xs])
            mine = eager_m(*xs).double()
        got = runner(*xs).double().reshape(ref.shape)
        scale = ref.abs().max().item()
        err, eager = (got - ref).abs().max().item(), (mine - ref).abs().max().item()
        assert err <= 2 * eager + 1e-2 * scale, (case, seed, err, eager, scale)


@pytest.mark.gpu
def test_bf16_int4_package_prefill_reads_the_tc_order(tmp_path):
    """A bf16 Llama package (prefill + decode, int4 group 128; decode's GEMVs on the tensor
    cores, prefill's kernel reading the same tc-ordered weights): prefill's logits against
    the dequantised model (float32 eager) within twice bf16 eager's own error plus 1% of the
    scale. (Decode steps: test_quant_cuda.py's dequantised-eager test at group 128.)"""
    _gpu()
    pytest.importorskip("transformers")
    import copy
    from kiln.models import hf_decoder
    from test_quant_cuda import fake_quant
    model = hf_decoder.llama(layers=2, hidden=256, heads=8, kv_heads=4, vocab=512, inter=512)
    model = model.to(torch.bfloat16)
    deq = fake_quant(copy.deepcopy(model).float(), "int4", 128)  # the bf16 weights quantised
    progs = hf_decoder.export_decoder(model, max_cache_len=64, max_prompt=16)
    cm = kiln.compile(progs, device="cuda", options=Options(
        weight_quant="int4", weight_quant_group=128, autotune=False, cuda_int4_tensor_core=True))
    assert "= _kl_i4mma(" in cm.entries["decode"].sources["kernels_triton.py"]
    r = kiln.load(cm.save(tmp_path / "p.kiln"), device="cuda")
    ids = torch.tensor([[3, 17, 42, 5, 99, 7, 1, 2]], device="cuda")
    cp = torch.arange(ids.shape[1], device="cuda")
    with torch.no_grad():
        want = hf_decoder.static_cache_module(deq.to("cuda"), 64)(input_ids=ids,
                                                                  cache_position=cp)
        mine = hf_decoder.static_cache_module(copy.deepcopy(deq).to("cuda", torch.bfloat16),
                                              64)(input_ids=ids, cache_position=cp)
    got = r.prefill(input_ids=ids, cache_position=cp)
    first = lambda t: (t[0] if isinstance(t, (tuple, list)) else t).double()  # noqa: E731
    got, want, mine = first(got).reshape(-1), first(want).reshape(-1), first(mine).reshape(-1)
    scale = want.abs().max().item()
    err, eager = (got - want).abs().max().item(), (mine - want).abs().max().item()
    assert err <= 2 * eager + 1e-2 * scale, (err, eager, scale)
    r.close()
