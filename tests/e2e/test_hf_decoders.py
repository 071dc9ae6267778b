"""Hugging Face decoders with a static KV cache through kiln on the CPU (issue 17): greedy
decoding gives eager's tokens, and the caches are updated in place.

Each family (Llama, Qwen2, Gemma, Mistral, Phi; tiny configs, random weights, no downloads:
tests/e2e/hf_decoders.py) is wrapped in transformers' own static-cache module and exported
for one decode step (input_ids [1, 1], cache_position [1]); the package keeps the caches as
state. In float32 a prompt is fed token by token and 10 tokens are decoded greedily, by eager
and by the package, from fresh caches: the tokens are equal and every step's logits close.
In bfloat16 and float16 (caches of that type) both are fed eager's token stream (teacher
forcing: a near tie may flip one argmax and every later token with it) and kiln's logits
must be as close to eager's as eager's are to the float32 model with the same weights. The
program updates every cache in place (memory/inplace.py `state_updates`): no CopyState of a
cache, a put into the state's own storage."""

from __future__ import annotations

import pytest
import torch

import kiln
from kiln.ir import program as P

import hf_decoders as H

pytest.importorskip("transformers")

PROMPT = [3, 17, 42, 5, 99]
CACHE = 32


def _compile(module):
    ep = H.export_decode(module)
    compiled = kiln.compile(ep, options=kiln.Options(num_threads=2))
    return compiled, compiled.load()


def _cache_updates(compiled) -> tuple[list[str], list[str]]:
    """(caches copied into after the run, caches updated in place) of the compiled program."""
    lines = list(P.walk(compiled.built.program.lines))
    copied = [x.dst for x in lines if isinstance(x, P.CopyState) and "cache" in x.dst]
    inplace = [x.state for x in lines if isinstance(x, P.Alloc) and x.state is not None
               and "cache" in x.state]  # (position counters may be written in place too)
    return copied, inplace


def _greedy_pair(module, runner, new_tokens=10):
    H.reset_caches(module)
    with torch.no_grad():
        want, want_logits = H.greedy(lambda i, p: module(input_ids=i, cache_position=p),
                                     PROMPT, new_tokens)
    got, got_logits = H.greedy(lambda i, p: runner(input_ids=i, cache_position=p), PROMPT,
                               new_tokens)
    return want, got, want_logits, got_logits


SLOW = {"gemma", "phi", "qwen2"}  # about 30 s each on a loaded 2-core box (compile time)


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW else f
                                    for f in H.FAMILIES])
def test_greedy_tokens_fp32(family):
    model = H.build_model(family, torch.float32, seed=1)
    module = H.static_module(model, CACHE)
    compiled, runner = _compile(module)
    want, got, want_logits, got_logits = _greedy_pair(module, runner)
    assert got == want
    for step, (a, b) in enumerate(zip(want_logits, got_logits)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4, msg=f"step {step}")
    copied, inplace = _cache_updates(compiled)
    layers = model.config.num_hidden_layers
    assert copied == [] and len(inplace) == 2 * layers, (copied, inplace)
    # a second sequence on the same runner (its caches hold the first one's entries: each
    # step overwrites its position, and the mask hides later ones) gives the same tokens
    again, _ = H.greedy(lambda i, p: runner(input_ids=i, cache_position=p), PROMPT, 10)
    assert again == want


def _forced(step, tokens):
    out = []
    for pos, tok in enumerate(tokens):
        logits = step(torch.tensor([[tok]], dtype=torch.long), torch.tensor([pos]))
        out.append(logits.reshape(-1).float().clone())
    return out


@pytest.mark.parametrize("family,dtype", [("llama", torch.bfloat16),
                                          pytest.param("qwen2", torch.float16,
                                                       marks=pytest.mark.slow),
                                          pytest.param("gemma", torch.bfloat16,
                                                       marks=pytest.mark.slow),
                                          pytest.param("phi", torch.float16,
                                                       marks=pytest.mark.slow)])
def test_half_caches(family, dtype):
    model = H.build_model(family, dtype, seed=2)
    module = H.static_module(model, CACHE)
    compiled, runner = _compile(module)
    H.reset_caches(module)
    with torch.no_grad():
        want, _ = H.greedy(lambda i, p: module(input_ids=i, cache_position=p), PROMPT, 8)
        tokens = PROMPT + want[:-1]
        eager = _forced(lambda i, p: module(input_ids=i, cache_position=p), tokens)
        ref_model = H.build_model(family, torch.float32, seed=2)
        ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        ref = H.static_module(ref_model, CACHE)
        f32 = _forced(lambda i, p: ref(input_ids=i, cache_position=p), tokens)
    got = _forced(lambda i, p: runner(input_ids=i, cache_position=p), tokens)
    for step, (e, k, f) in enumerate(zip(eager, got, f32)):
        rounding = (e - f).abs().max().item()  # eager's own distance from float32
        assert (k - e).abs().max().item() <= 3 * rounding + 1e-2, f"step {step}"
        top = e.topk(2).values
        if top[0] - top[1] > 4 * rounding + 1e-2:  # a clear winner: the same token
            assert int(k.argmax()) == int(e.argmax()), f"step {step}"
    copied, inplace = _cache_updates(compiled)
    assert copied == [] and len(inplace) == 2 * model.config.num_hidden_layers


class Gqa(torch.nn.Module):
    """repeat_kv + scaled scores as sdpa's math decomposition exports them: the key cache
    expanded over the heads of its group and reshaped to one batch dim, times a constant."""

    def __init__(self, rep: int, scale: float) -> None:
        super().__init__()
        self.rep, self.scale = rep, scale

    def forward(self, q, k, v):
        b, kv, s, e = k.shape
        kk = k[:, :, None].expand(b, kv, self.rep, s, e).reshape(b * kv * self.rep, s, e)
        vv = v[:, :, None].expand(b, kv, self.rep, s, e).reshape(b * kv * self.rep, s, e)
        scores = torch.bmm(q, (kk * self.scale).transpose(1, 2))
        return torch.bmm(scores.softmax(-1), vv)


GQA_CASES = [(2, 4, 16, 8), (3, 2, 7, 4), (1, 5, 9, 16)]  # (kv, rep, s, e)


def test_gqa_operands_in_place():
    """The repeated key and value are read in place (a GEMM with batch dims (kv, rep), the
    repeat a stride of 0; the constant applied to the scores), not copied per head; the
    result matches eager in float64. The GQA_CASES in one program (difftest.Cases: each case
    its own static shapes and GEMMs, outputs named by the case)."""
    from difftest import Cases

    mods, args = {}, []
    for kv, rep, s, e in GQA_CASES:
        g = torch.Generator().manual_seed(kv * 100 + rep)
        q = torch.randn(kv * rep, 3, e, generator=g)
        k, v = (torch.randn(1, kv, s, e, generator=g) for _ in range(2))
        mods[f"kv{kv}_rep{rep}_s{s}_e{e}"] = (Gqa(rep, 0.37), 3)
        args += [q, k, v]
    module = Cases(mods)
    compiled = kiln.compile(module, tuple(args), options=kiln.Options(num_threads=2))
    got = compiled.load()(*args)
    want = module(*(a.double() for a in args))
    assert got.keys() == want.keys()
    for name, w in want.items():
        torch.testing.assert_close(got[name], w.float(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"case {name}: {m}")
    gemms = [x.gemm for x in P.walk(compiled.built.program.lines) if isinstance(x, P.CallGemm)]
    names = [i.name for i in compiled.built.graph.user_inputs]  # q, k, v of each case in order
    per_case = [0] * len(GQA_CASES)
    for gm in gemms:  # B is the key / value input itself: batch dims (kv, rep), or (rep,)
        assert gm.b.buf in names and gm.b.batch_strides[-1] == 0, gm
        case = names.index(gm.b.buf) // 3
        per_case[case] += 1
        kv = GQA_CASES[case][0]
        assert len(gm.batch) == (2 if kv > 1 else 1), (GQA_CASES[case], gm)
    assert per_case == [2] * len(GQA_CASES), per_case


def _dequantised_copy(model, compiled, group: int):
    """A copy of `model` whose Linear weights are the ones the package stores, dequantised
    (ir/quant.py's float64 twin, rounded to float32): eager's reference for a quantised
    package. Each stored form names its Linear in its FQN `<quantised MODE of FQN>`."""
    from kiln.ir import quant as Q  # deferred: only the quantised tests read stored forms

    ref = H.build_model("llama", torch.float32, seed=3)
    ref.load_state_dict(model.state_dict())
    parts: dict[tuple[str, str], dict] = {}
    for w in compiled.manifest["weights"]:
        if w["fqn"].startswith("<quantised "):
            mode, fqn = w["fqn"][len("<quantised "):-1].split(" of ")
            part = w["name"].rsplit("_", 1)[-1]
            key = "s" if part == "s" else "wsum" if part == "wsum" else "q"
            parts.setdefault((mode, fqn), {})[key] = compiled.built.weights[w["name"]]
    assert parts
    for (mode, fqn), p in parts.items():
        lin = ref.get_submodule(fqn.removeprefix("model.").removesuffix(".weight"))
        n, k = lin.weight.shape
        base = "int4" if mode.startswith("int4") else "int8"
        lin.weight.data = Q.dequantize(base, p, k, n, group).t().float().contiguous()
    return ref


# the default suite: each mode and each kernel once on the decoder (int4 weight-only, int8
# VNNI); int8 weight-only and int4 VNNI with -m slow (their kernels' own checks stay in the
# default suite: tests/targets/cpu/test_qgemm.py, weight-only int8 and VNNI int4 at native and
# x86-64-v4, and int4 VNNI at each portable level)
@pytest.mark.parametrize("quant,kernel", [pytest.param("int8", "dequant", marks=pytest.mark.slow),
                                          ("int4", "dequant"), ("int8", "vnni"),
                                          pytest.param("int4", "vnni", marks=pytest.mark.slow)])
def test_quantised_weights(quant, kernel):
    """Options(weight_quant=int8 / int4, weight_quant_kernel=dequant / vnni) on a Llama
    decoder: every Linear (lm_head included) runs a qgemm. Fed the same tokens (teacher
    forcing), kiln's logits match eager running the model with the package's dequantised
    weights: within float32 error for the weight-only kernels, within the activations' int8
    grid for the VNNI kernels; greedy decoding gives that model's tokens (weight-only)."""
    group = 32
    model = H.build_model("llama", torch.float32, seed=3)
    module = H.static_module(model, CACHE)
    compiled = kiln.compile(H.export_decode(module), options=kiln.Options(
        num_threads=2, weight_quant=quant, weight_quant_kernel=kernel,
        weight_quant_group=group))
    runner = compiled.load()
    mode = f"{quant}_vnni" if kernel == "vnni" else quant
    layers = model.config.num_hidden_layers
    assert compiled.sources["model.cpp"].count(f"// {mode} weight GEMM") == 7 * layers + 1
    ref = H.static_module(_dequantised_copy(model, compiled, group), CACHE)
    H.reset_caches(ref)
    with torch.no_grad():
        want, _ = H.greedy(lambda i, p: ref(input_ids=i, cache_position=p), PROMPT, 8)
        tokens = PROMPT + want[:-1]
        H.reset_caches(ref)
        eager = _forced(lambda i, p: ref(input_ids=i, cache_position=p), tokens)
    got = _forced(lambda i, p: runner(input_ids=i, cache_position=p), tokens)
    tol = 1e-4 if kernel == "dequant" else 0.05  # vnni: x on a 255-level grid per row
    for step, (e, k) in enumerate(zip(eager, got)):
        assert (k - e).abs().max().item() <= tol * e.abs().max().item() + tol, f"step {step}"
    if kernel == "dequant":
        g, _ = H.greedy(lambda i, p: runner(input_ids=i, cache_position=p), PROMPT, 8)
        assert g == want
