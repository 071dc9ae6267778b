"""The KV-cache writes of a decode step in the decode attention's launch (issue 17.3,
targets/cuda/attention_decode.py `fuse_decode_puts`): the one-row kernel of the rotary queries and
keys, the mask and the two cache writes (a `PutKernel`) is absorbed by the attention after
it, which computes those members where it reads them, writes the new key / value rows itself
and uses them in place of the cache's rows. Checked without a GPU: which steps the fusion
takes (decode yes; prefill, batched decode and `KILN_DECODE_FUSED_PUTS=0` keep the old
kernels), the generated source, and whole decode steps run by Triton's interpreter against
eager (float32, float16; 1 and 4 key splits, merged by the combine kernel or by the last
split to arrive; positions 0 .. the cache's end and one past it).
On a GPU (-m gpu): bf16 / fp16 / fp32 against eager, filled lengths 1 .. the cache's size."""

from __future__ import annotations

import copy
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
from kiln.options import Options  # noqa: E402

OPTS = Options(cuda_archs=(90,), autotune=False)


def _model(hidden=64, heads=4, kv_heads=2, layers=2):
    from kiln.models.hf_decoder import llama
    torch.manual_seed(0)
    return llama(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, vocab=128,
                 inter=128)


def _kinds(ep, opts=OPTS):
    return [(k["kind"], k["name"], k["source_ops"])
            for k in kiln.compile(ep, device="cuda", options=opts).manifest["kernels"]]


def test_decode_step_attention_takes_the_cache_writes(monkeypatch):
    from kiln.models.hf_decoder import export_step
    _, ep = export_step(_model(), 64, dtype=torch.bfloat16)
    ks = _kinds(ep)
    kinds = [k for k, _, _ in ks]
    # per layer one launch: the attention, with the puts' and the rotary kernel's nodes
    fused = [k for k in ks if k[0] == "triton_put"]
    assert len(fused) == 2 and all(n.startswith("attn_") for _, n, _ in fused), ks
    assert all(sum(s.startswith("index_put") for s in src) == 2 and
               any("attention" in s for s in src) for _, _, src in fused), fused
    assert "lib.attention" not in kinds and "lib.put" not in kinds, kinds
    monkeypatch.setenv("KILN_DECODE_FUSED_PUTS", "0")
    old = [k for k, _, _ in _kinds(ep)]
    assert old.count("lib.attention") == 2 and old.count("triton_put") == 2, old
    assert len(old) == len(kinds) + 2


def test_fused_source_writes_the_rows_and_computes_the_members(monkeypatch):
    from kiln.models.hf_decoder import export_step
    _, ep = export_step(_model(layers=1), 256, dtype=torch.bfloat16)
    # the default: the key splits merged by the combine kernel, launched after
    src = kiln.compile(ep, device="cuda", options=OPTS).built.sources["kernels_triton.py"]
    assert "_combine(" in src and "atomic_add" not in src
    monkeypatch.setenv("KILN_DECODE_COMBINE", "last")
    b = kiln.compile(ep, device="cuda", options=OPTS).built
    src = b.sources["kernels_triton.py"]
    start = src.index("def attn_")
    body = src[start:src.index("\n@triton.jit", start)]
    assert "k_new" in body and "v_new" in body and "(split == 0)" in body, body
    assert "kt = tl.where(cols[None, :] == pos_k" in body
    assert "kiln_status" in body and "computed here" in body
    assert "def puts_" not in src  # no launch of its own left
    # cache 256: 4 key splits, merged by the last split to arrive (an arrival counter in
    # the status buffer), not by a combine kernel
    assert "_combine(" not in src and "arrived == XBLOCK - 1" in body, body


def test_prefill_keeps_its_kernels():
    from kiln.models.hf_decoder import export_decoder
    progs = export_decoder(_model(layers=1), max_cache_len=64, max_prompt=8)
    ks = _kinds(progs["prefill"])
    kinds = [k for k, _, _ in ks]
    # a prompt of several (dynamic) rows: the flash kernel and the scatters, as before
    assert "lib.attention" in kinds and not any(n.startswith("attn_") for _, n, _ in ks
                                                 if _ == "triton_put"), ks
    assert "lib.put" in kinds or "triton_put" in kinds, kinds


_INTERP = textwrap.dedent("""
    import copy, dataclasses, os, sys, torch
    import kiln
    from kiln.ir import program as P
    from kiln.models.hf_decoder import eager_step, export_step, llama
    from kiln.options import Options
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.build import triton_kernels

    bad = []
    for dtype, cache, positions, combine in (
            (torch.float32, 64, [0, 1, 2, 15, 16, 17, 62, 63], "launch"),
            (torch.float32, 256, [0, 1, 5, 63, 64, 65, 130, 255], "last"),
            (torch.float16, 256, [0, 3, 64, 200, 255], "launch"),
            (torch.float16, 256, [0, 3, 64, 200, 255], "last")):
        os.environ["KILN_DECODE_COMBINE"] = combine
        torch.manual_seed(0)
        model = llama(layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, inter=128)
        w, ep = export_step(copy.deepcopy(model), cache, dtype=dtype)
        b = kiln.compile(ep, device="cuda", options=Options(cuda_archs=(90,),
                                                            autotune=False)).built
        assert "def puts_" not in b.sources["kernels_triton.py"]
        mod = import_triton_module(b.sources["kernels_triton.py"])
        # run_program copies the weights and states: the program returns its states too,
        # copied back after each step (the caches carry over, as in a package)
        states = [x.state for x in b.program.lines if isinstance(x, P.Alloc) and x.state]
        assert "b_key_cache_0" in states and "b_value_cache_1" in states, states
        prog = dataclasses.replace(b.program, lines=tuple(
            P.Return(x.buffers + tuple(states)) if isinstance(x, P.Return) else x
            for x in b.program.lines))
        bufs = {x.name: x for x in b.loop.buffers}
        hints = {s.name: s.example for s in b.graph.symbols}
        ks = {k.name: k for k in triton_kernels(b.steps, bufs, hints)}
        ref = export_step(copy.deepcopy(model), cache, dtype=torch.float64)[0]
        same = export_step(copy.deepcopy(model), cache, dtype=dtype)[0]
        for tok, pos in zip([5, 77, 3, 100, 9, 41, 8, 120], positions):
            ids, cp = torch.tensor([[tok]]), torch.tensor([pos])
            outs = run_program(prog, ks, mod, b.weights, [ids, cp])
            for name, t in zip(states, outs[1:]):
                b.weights[name].reshape(-1).copy_(t.reshape(-1))
            got = outs[0].double()
            with torch.no_grad():
                want = eager_step(ref)(ids, cp).double()
                mine = eager_step(same)(ids, cp).double()
            got = got.reshape(want.shape)
            scale = want.abs().max().item()
            err, eager = (got - want).abs().max().item(), (mine - want).abs().max().item()
            bound = 1e-4 * scale if dtype == torch.float32 else 2 * eager + 1e-2 * scale
            print(dtype, cache, combine, pos, f"err {err:.3g} eager {eager:.3g} "
                  f"bound {bound:.3g}")
            if not err <= bound:
                bad.append(f"{dtype} cache {cache} {combine} position {pos}: {err} > {bound}")
        try:  # one past the cache: an index error, as the put raised
            run_program(prog, ks, mod, b.weights, [torch.tensor([[1]]),
                                                        torch.tensor([cache])])
            bad.append(f"position {cache} of a {cache}-long cache was accepted")
        except IndexError as e:
            print("out of range:", e)
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
""")


@pytest.mark.slow  # whole decode steps in Triton's interpreter (a few minutes)
def test_fused_decode_steps_match_eager_in_triton_interpreter(monkeypatch):
    from kiln.models.hf_decoder import export_step
    for dtype, cache, combine in ((torch.float32, 64, "launch"), (torch.float32, 256, "last"),
                                  (torch.float16, 256, "launch"), (torch.float16, 256, "last")):
        monkeypatch.setenv("KILN_DECODE_COMBINE", combine)
        torch.manual_seed(0)  # cubins first: the AOT compiler cannot run in interpreter mode
        kiln.compile(export_step(_model(), cache, dtype=dtype)[1], device="cuda",
                     options=OPTS)
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _INTERP], env=env, capture_output=True,
                         text=True, timeout=1200, cwd=pathlib.Path(__file__).parents[3])
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]


_FAMILIES = textwrap.dedent('''
    import copy, dataclasses, sys, torch
    import kiln
    import transformers as tf
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM
    from kiln.ir import program as P
    from kiln.models.llm import eager_step
    from kiln.options import Options
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.targets.cuda.build import triton_kernels

    bad = []
    for name in sys.argv[1:]:
        torch.manual_seed(0)
        m = family(name)
        mk = lambda mm: TorchExportableModuleForDecoderOnlyLM(mm, batch_size=1,
                                                              max_cache_len=16, device="cpu")
        ep = mk(copy.deepcopy(m)).export(input_ids=torch.zeros(1, 1, dtype=torch.long),
                                         cache_position=torch.arange(1))
        cm = kiln.compile(ep, device="cuda", options=Options(cuda_archs=(90,), autotune=False))
        fused = [k["name"] for k in cm.manifest["kernels"] if k["kind"] == "triton_put"]
        if len(fused) != 2 or not all(n.startswith("attn_") for n in fused):
            bad.append(f"{name}: not fused {fused}")
        b = cm.built
        mod = import_triton_module(b.sources["kernels_triton.py"])
        ks = {k.name: k for k in triton_kernels(b.steps, {x.name: x for x in b.loop.buffers},
                                                  {})}
        states = [x.state for x in b.program.lines if isinstance(x, P.Alloc) and x.state]
        prog = dataclasses.replace(b.program, lines=tuple(
            P.Return(x.buffers + tuple(states)) if isinstance(x, P.Return) else x
            for x in b.program.lines))
        ref = mk(copy.deepcopy(m).double())
        for pos in range(16):
            ids, cp = torch.tensor([[(pos * 37) % 256]]), torch.tensor([pos])
            outs = run_program(prog, ks, mod, b.weights, [ids, cp])
            for n, t in zip(states, outs[1:]):
                b.weights[n].reshape(-1).copy_(t.reshape(-1))
            with torch.no_grad():
                want = eager_step(ref)(ids, cp).double()
            got = outs[0].double().reshape(want.shape)
            err, scale = (got - want).abs().max().item(), want.abs().max().item()
            print(name, pos, f"err {err:.3g} scale {scale:.3g}")
            if not err <= 1e-4 * scale:
                bad.append(f"{name} position {pos}: {err} > 1e-4 * {scale}")
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
''')

FAMILIES = {"qwen2": "Qwen2Config", "mistral": "MistralConfig", "gemma": "GemmaConfig",
            "phi3": "Phi3Config"}


def family(name: str):
    """A tiny decoder of another family (q/k/v biases, Gemma's head dim 32, Phi-3's fused
    qkv projection), float32, random weights, static cache."""
    import transformers as tf
    cfg = getattr(tf, FAMILIES[name])(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        pad_token_id=0, **({"head_dim": 32} if name == "gemma" else {}))
    m = tf.AutoModelForCausalLM.from_config(cfg).eval()
    m.generation_config.cache_implementation = "static"
    return m


@pytest.mark.slow  # 4 decoders x 16 steps in Triton's interpreter (about 4 minutes)
def test_other_families_fused_decode_in_triton_interpreter():
    """Qwen2, Mistral, Gemma, Phi-3 (float32, 2 layers, GQA, cache 16): every layer fused,
    positions 0 .. 15 in order (the caches carried over) against eager float64, 1e-4."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM
    script = "from test_decode_puts import family\n" + _FAMILIES
    for name in FAMILIES:  # cubins first: the AOT compiler cannot run in interpreter mode
        torch.manual_seed(0)
        w = TorchExportableModuleForDecoderOnlyLM(family(name), batch_size=1, max_cache_len=16,
                                                  device="cpu")
        ep = w.export(input_ids=torch.zeros(1, 1, dtype=torch.long),
                      cache_position=torch.arange(1))
        kiln.compile(ep, device="cuda", options=OPTS)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(pathlib.Path(__file__).parents[3]), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", script, *FAMILIES], env=env,
                         capture_output=True, text=True, timeout=1500,
                         cwd=pathlib.Path(__file__).parent)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]


# -- on a GPU (-m gpu) --------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype,combine", [(torch.bfloat16, "last"), (torch.float16, "last"),
                                           (torch.float32, "last"), (torch.bfloat16, "launch")])
def test_fused_decode_matches_eager_on_gpu(dtype, combine, tmp_path, monkeypatch):
    """One package per dtype (the 8B layout's head dim 128, GQA 4, cache 512: 8 key splits,
    merged by the last split to arrive, or by the combine kernel with `launch`), decoded at
    every filled length 1 .. 512 (position 0 .. 511: each step reads the rows the earlier
    ones wrote) against eager float64 of the same weights and eager in `dtype`."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("KILN_DECODE_COMBINE", combine)
    from kiln.models.hf_decoder import eager_step, export_step, llama
    torch.manual_seed(0)
    model = llama(layers=2, hidden=512, heads=4, kv_heads=1, vocab=256, inter=256)
    cache = 512
    w, ep = export_step(copy.deepcopy(model), cache, device="cuda", dtype=dtype)
    cm = kiln.compile(ep, device="cuda", options=Options(autotune=False))
    assert [k for k in cm.manifest["kernels"] if k["kind"] == "triton_put" and
            k["name"].startswith("attn_")], cm.manifest["kernels"]
    src = cm.built.sources["kernels_triton.py"]
    assert ("_combine(" in src) == (combine == "launch") and ("atomic_add" in src) == (
        combine == "last")
    r = cm.load(tmp_path / "d.kiln", device="cuda:0")
    ref = export_step(copy.deepcopy(model), cache, device="cuda", dtype=torch.float64)[0]
    same = export_step(copy.deepcopy(model), cache, device="cuda", dtype=dtype)[0]
    g = torch.Generator().manual_seed(1)
    worst = 0.0
    for pos in range(cache):
        tok = int(torch.randint(0, 256, (1,), generator=g))
        ids = torch.tensor([[tok]], device="cuda")
        cp = torch.tensor([pos], device="cuda")
        out = r(input_ids=ids, cache_position=cp)
        got = (out[0] if isinstance(out, (tuple, list)) else out).double()
        with torch.no_grad():
            want = eager_step(ref)(ids, cp).double()
            mine = eager_step(same)(ids, cp).double()
        got = got.reshape(want.shape)
        scale = want.abs().max().item()
        err, eager = (got - want).abs().max().item(), (mine - want).abs().max().item()
        bound = 1e-4 * scale if dtype == torch.float32 else 2 * eager + 1e-2 * scale
        worst = max(worst, err / bound)
        assert err <= bound, (dtype, pos, err, eager, scale)
    print(dtype, "worst err / bound", worst)
