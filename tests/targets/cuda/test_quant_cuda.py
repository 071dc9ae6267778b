"""Weight-only int8 / int4 GEMMs on CUDA (Options.weight_quant; kiln/gemm/quant_gemv.py,
kiln/targets/cuda/quant.py; issue 17).

Without a GPU, in Triton's interpreter: a sample of the launch configurations of both kernels
(GEMV for M = 1, tensor-core tiles otherwise; each tile size) against x @ W^T in float64 with W
the float64 value of the stored weights, at several M, N, K, group sizes and dtypes (the
interpreter's bfloat16 tl.dot is wrong, so the tile path runs float32 and float16 there); the
packing against the definition; a Llama step compiled with weight_quant calls the kernels for
every linear layer and stores only the quantised weights; GEMMs the kernels cannot take stay
GEMMs. On a GPU (`-m gpu`): the decode step's logits against eager on the same model with every
linear weight replaced by its dequantised value (bf16 and float32), prefill + decode generation
with device sampling gives that model's greedy tokens, and the KL report on CUDA."""

from __future__ import annotations

import copy
import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("transformers")

import kiln  # noqa: E402
from kiln.gemm import quant_gemv as QG  # noqa: E402
from kiln.models import hf_decoder  # noqa: E402
from kiln.options import Options  # noqa: E402

OPTS = Options(cuda_archs=(90,), autotune=False)
logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").setLevel(logging.ERROR)
ROOT = pathlib.Path(__file__).resolve().parents[3]


def fake_quant(model: torch.nn.Module, mode: str, group: int) -> torch.nn.Module:
    """A copy of `model` whose nn.Linear weights are their dequantised values: the reference
    of a package compiled with weight_quant=mode."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for mod in ref.modules():
            if isinstance(mod, torch.nn.Linear):
                w = mod.weight
                parts = QG.quantize_int8(w) if mode == "int8" else QG.quantize_int4(w, group)
                w.copy_(QG.dequantize(mode, parts, group).to(w.dtype))
    return ref


def test_packing_matches_definition():
    torch.manual_seed(0)
    w = torch.randn(6, 64)
    p8 = QG.quantize_int8(w)
    s = w.abs().amax(1) / 127
    assert torch.allclose(p8["s"], s) and p8["q"].dtype == torch.int8
    assert torch.equal(p8["q"], torch.round(w / s[:, None]).to(torch.int8))
    p4 = QG.quantize_int4(w, 32)
    assert p4["q"].shape == (6, 32) and p4["s"].shape == (6, 2)
    q = torch.round(w.reshape(6, 2, 32) / (w.reshape(6, 2, 32).abs().amax(2, keepdim=True) / 7))
    q = q.reshape(6, 64).to(torch.int16) + 8
    assert torch.equal(p4["q"].to(torch.int16), q[:, 0::2] | (q[:, 1::2] << 4))
    for mode, parts, g in (("int8", p8, 0), ("int4", p4, 32)):  # error within half a step
        err = (QG.dequantize(mode, parts, g) - w.double()).abs()
        step = parts["s"].double() if mode == "int8" else parts["s"].double().repeat_interleave(
            32, 1)
        assert (err <= step.reshape(6, -1) * 0.5 + 1e-6).all()
    assert QG.supported("int4", 128, 64) and not QG.supported("int4", 96, 64)
    assert not QG.supported("int4", 96, 48) and QG.supported("int8", 96, 0)


_KERNELS = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined
    import torch, triton
    from kiln.gemm import quant_gemv as QG
    torch.manual_seed(0)
    bad = []
    for mode, group in [("int8", 0), ("int4", 32), ("int4", 64)]:
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            for m, n, k in [(1, 40, 128), (5, 96, 256), (1, 33, 64), (17, 24, 192)]:
                if not QG.supported(mode, k, group) or (dt == torch.bfloat16 and m > 1):
                    continue
                w = torch.randn(n, k)
                parts = QG.quantize_int8(w) if mode == "int8" else QG.quantize_int4(w, group)
                x = torch.randn(m, k).to(dt)
                want = x.double() @ QG.dequantize(mode, parts, group).t()
                cfgs = QG.configs(mode, 1 if m == 1 else None, n, k, group)
                for consts, warps, stages in cfgs[:2] + cfgs[2::5]:  # a sample: each tile
                    out = torch.empty(m, n, dtype=dt)
                    grid = (triton.cdiv(n, consts["BLOCK_N"]), triton.cdiv(m, consts["BLOCK_M"]))
                    kw = dict(consts, PRECISION=QG.PRECISION[dt],
                              **({"G": group} if mode == "int4" else {}))
                    QG.KERNELS[mode][grid](x, parts["q"], parts["s"], out, m, n, k, **kw,
                                            num_warps=warps)
                    err = (out.double() - want).abs().max().item()
                    rel = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dt]
                    tol = rel * want.abs().max().item() * (1 if m == 1 else 4) + 1e-5
                    if not err <= tol:
                        bad.append(f"{mode} g{group} {dt} m={m} n={n} k={k} {consts}: "
                                   f"error {err:.3g} > {tol:.3g}")
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
""")


def _interpret(src: str, *args: str) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)  # the scripts switch it on themselves
    out = subprocess.run([sys.executable, "-c", src, *args], env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]


def test_quantised_linear_kernels_in_triton_interpreter():
    _interpret(_KERNELS)


@pytest.mark.slow  # (moved out of the default suite: it ran over 20 minutes)
def test_quantised_llama_step_compiles_to_the_kernels():
    """Every linear layer of a Llama step reads its weight stored quantised only: a GEMV of
    kiln's template at M = 1 (tests/targets/cuda/test_quant_gemv.py), or, without the Triton
    GEMM backend, a quantised kernel call (the numbers: test_quantised_step_on_gpu_matches_
    dequantised_eager; Triton's interpreter cannot run a package's user kernels)."""
    from dataclasses import replace
    for mode, group in (("int8", 0), ("int4", 32)):
        model = hf_decoder.llama(layers=1, hidden=64, vocab=96, inter=128)
        _, ep = hf_decoder.export_step(model, 16)
        opts = replace(OPTS, weight_quant=mode, weight_quant_group=group or 128)
        gemv = kiln.compile(ep, device="cuda", options=opts)
        gv = [k for k in gemv.manifest["kernels"] if k["kind"] == "triton_gemv"]
        assert len(gv) == 4 + 1 and not [k for k in gemv.manifest["kernels"]
                                         if k["kind"] == "user_triton"]
        assert all("mixed=b:" in k["gemm"]["problem"] for k in gv)
        cm = kiln.compile(ep, device="cuda", options=replace(opts, gemm_backends=("blas",)))
        kinds = [k.get("kernel") for k in cm.manifest["kernels"] if k["kind"] == "user_triton"]
        assert kinds == [f"qlinear_{mode}_kernel"] * 5, kinds
        names = {w["name"]: w for w in cm.manifest["weights"]}
        assert not any(n.endswith("proj_weight") or n == "p_model_lm_head_weight"
                       for n in names)  # every linear weight stored quantised only
        q = [w for n, w in names.items() if n.endswith("_q8" if mode == "int8" else "_q4")]
        assert len(q) == 5 and {w["dtype"] for w in q} == {"int8" if mode == "int8"
                                                            else "uint8"}
        info = cm.manifest["cuda"]["user_kernels"]
        assert all(v["constexprs"]["BLOCK_M"] == "1" for v in info.values())  # M = 1: GEMVs


def test_gemms_the_kernels_cannot_take_stay_gemms():
    from dataclasses import replace
    model = hf_decoder.llama(layers=1, hidden=96, heads=4, kv_heads=2, vocab=64, inter=192)
    _, ep = hf_decoder.export_step(model, 8)
    cm = kiln.compile(ep, device="cuda", options=replace(OPTS, weight_quant="int4",
                                                         weight_quant_group=64))
    kinds = [k for k in cm.manifest["kernels"] if "mixed=" in k.get("gemm", {}).get("problem",
                                                                                   "")]
    # K = 96 (q/k/v, gate/up, o, lm_head) is no multiple of 64: only down_proj (K = 192), a
    # GEMV of the int4 weight (M = 1)
    assert len(kinds) == 1 and "int4g64" in kinds[0]["gemm"]["problem"], kinds
    assert kinds[0]["kind"] == "triton_gemv" and " 1x96x192 " in kinds[0]["gemm"]["problem"], \
        kinds  # M x N x K


# ---------------------------------------------------------------- GPU


def _gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("mode,group,tc", [("int8", 64, "0"), ("int4", 64, "0"),
                                           ("int4", 128, "0"), ("int4", 128, "1")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantised_step_on_gpu_matches_dequantised_eager(tmp_path, mode, group, tc, dtype):
    """Each step's logits against the dequantised model in fp32 on the same token stream
    (kiln's own greedy tokens fed to every model): fp32 within 1e-3 of the logit scale with the
    same tokens; bf16 within twice eager bf16's own error plus 1% of the scale. (tc "1": bf16
    int4 in groups of 128 are the tensor-core GEMVs, test_int4_tc_gemv.py.)"""
    _gpu()
    model = hf_decoder.llama(layers=2, hidden=256, heads=8, kv_heads=4, vocab=512, inter=512)
    w, ep = hf_decoder.export_step(model, 32, device="cuda", dtype=dtype)
    # the reference quantises the weights kiln quantises: those of the package's dtype
    deq = fake_quant(copy.deepcopy(model).float(), mode, group)
    cm = kiln.compile(ep, device="cuda", options=Options(weight_quant=mode, autotune=False,
                                                         weight_quant_group=group,
                                                         cuda_int4_tensor_core=tc == "1"))
    r = cm.load(tmp_path / "q.kiln", device="cuda")
    prompt = [3, 17, 42, 5, 99]
    got_t, got = hf_decoder.greedy_steps(lambda i, c: r(input_ids=i, cache_position=c),
                                         prompt, 8, "cuda")
    fed = prompt + got_t[:-1]  # the token stream kiln was fed
    with torch.no_grad():
        ref = hf_decoder.greedy_steps(hf_decoder.eager_step(hf_decoder.static_cache_module(
            deq.to("cuda", torch.float32), 32)), fed, 1, "cuda")[1]
        mine = hf_decoder.greedy_steps(hf_decoder.eager_step(hf_decoder.static_cache_module(
            copy.deepcopy(deq).to("cuda", dtype), 32)), fed, 1, "cuda")[1]
    assert len(got) == len(ref) == len(mine)
    for step, (a, b, e) in enumerate(zip(got, ref, mine)):
        b = b.double()
        scale = b.abs().max().item()
        err, eager_err = (a.double() - b).abs().max().item(), (e.double() - b).abs().max().item()
        bound = 1e-3 * scale if dtype == torch.float32 else 2 * eager_err + 1e-2 * scale
        assert err <= bound, (step, err, eager_err, scale)
    if dtype == torch.float32:
        want_t = [int(x.argmax()) for x in ref[len(prompt) - 1:]]
        assert got_t == want_t


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantised_generation_on_gpu(tmp_path, mode):
    """prefill (tensor-core tiles) + decode (GEMV) + device sampling: greedy tokens of the
    dequantised model in eager."""
    _gpu()
    from kiln.models import device_sampler
    model = hf_decoder.llama(layers=2, hidden=256, heads=8, kv_heads=4, vocab=512, inter=512)
    ref = fake_quant(model, mode, 64).to("cuda")
    progs = hf_decoder.export_decoder(model, max_cache_len=64, max_prompt=16,
                                      sampler=device_sampler.export_sampler)
    path = kiln.compile(progs, device="cuda", options=Options(
        weight_quant=mode, weight_quant_group=64, autotune=False)).save(tmp_path / "g.kiln")
    r = kiln.load(path, device="cuda")
    prompt = [3, 17, 42, 5, 99, 7, 1, 2]
    want = hf_decoder.eager_generate(ref, prompt, 16, max_cache_len=64)
    assert kiln.runtime.generate(r, prompt, 16).tokens == want


@pytest.mark.gpu
def test_kl_report_on_cuda():
    _gpu()
    from kiln.models import quant_report as QR
    model = QR.small_llama(hidden_size=128, intermediate_size=256, vocab_size=256,
                           num_attention_heads=4, num_key_value_heads=2)
    tokens = QR.token_stream(256, 64)
    base = Options(autotune=False)
    rep = QR.kl_report(model, tokens, 32, QR.default_modes(32, base, device="cuda"), base,
                       device="cuda")
    assert set(rep) == {"int8", "int4_g32"} and rep["int8"]["positions"] == 64
    assert 0 < rep["int8"]["kl_mean"] < rep["int4_g32"]["kl_mean"]
    assert rep["int8"]["kl_max"] < 1e-2 and rep["int4_g32"]["kl_max"] < 0.5
