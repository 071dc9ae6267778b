"""One-token (and few-token) decode steps of Llama decoders on a GPU (skipped without CUDA;
issue 17): HF's static-cache module exported on the GPU (bf16 / fp16 programs carry cuDNN
attention, fp32 the efficient op) and compiled by kiln, stepped token by token from cache
position 0 to the last one next to eager; the logits at every position (0, the middle, the
last) against a float32 eager reference of the same weights, kiln's error at most twice eager's
own in that dtype plus a small fraction of the logits' scale; GQA (4 heads / 2 kv heads) and
MHA; steps of 1 and 4 tokens; Llama's attention geometry (32 / 4 heads of dim 64) over a
256-token cache (the attention's decode path). The package updates the cache in place (no
ATen call) and runs as one CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import kiln  # noqa: E402
from kiln.models.llm import eager_step, llama, static_cache_module  # noqa: E402
from transformers.integrations.executorch import (  # noqa: E402
    TorchExportableModuleForDecoderOnlyLM)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CACHE = 16


FAMILIES = {  # tiny configs of other decoder families (random weights, seed 0)
    "qwen2": "Qwen2Config", "mistral": "MistralConfig", "gemma": "GemmaConfig",
    "phi3": "Phi3Config"}


def _family(name: str, kv_heads: int):
    import transformers as tf
    cfg = getattr(tf, FAMILIES[name])(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
        pad_token_id=0, **({"head_dim": 32} if name == "gemma" else {}))
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = tf.AutoModelForCausalLM.from_config(cfg).eval()
    m.generation_config.cache_implementation = "static"
    return m


def _module(dtype, kv_heads, chunk, family="llama"):
    if family == "llama":
        m = llama(layers=2, hidden=128, heads=4, kv_heads=kv_heads, vocab=256, inter=256,
                  device="cuda").to(dtype)
    else:
        m = _family(family, kv_heads).to(dtype)
    w = TorchExportableModuleForDecoderOnlyLM(m, batch_size=1, max_cache_len=CACHE,
                                             device="cuda")
    ep = w.export(input_ids=torch.zeros(1, chunk, dtype=torch.long, device="cuda"),
                  cache_position=torch.arange(chunk, device="cuda"))
    return w, ep


@pytest.mark.parametrize("chunk", [1, 4])
@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
def test_decode_steps_match_eager(tmp_path, dtype, kv_heads, chunk):
    _check_steps(tmp_path, dtype, kv_heads, chunk, "llama")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_other_families_decode_steps_match_eager(tmp_path, family):
    """Qwen2 (q/k/v biases), Mistral, Gemma (its norm and scaled embedding, head dim 32 with
    hidden 128), Phi-3 (one fused qkv and gate/up projection), bf16, GQA, one token a step."""
    _check_steps(tmp_path, torch.bfloat16, 2, 1, family)


def _check_steps(tmp_path, dtype, kv_heads, chunk, family):
    w, ep = _module(dtype, kv_heads, chunk, family)
    cm = kiln.compile(ep, device="cuda")
    kinds = [k["kind"] for k in cm.manifest["kernels"]]
    assert "lib.put" in kinds or "triton_put" in kinds, kinds  # (fused: schedule/puts.py)
    assert cm.manifest["cuda"]["graphs"] is True  # no ATen call (which a graph cannot hold)
    runner = cm.load(tmp_path / "d.kiln", device="cuda:0")
    ref_w, _ = _module(torch.float32, kv_heads, chunk, family)  # same weights (seed 0), fp32
    _compare_steps(runner, eager_step(w), eager_step(ref_w), CACHE, chunk, dtype)


def _compare_steps(runner, eager, ref, cache, chunk, dtype, vocab=256):
    """Steps of `chunk` tokens from position 0 to the cache's end: kiln's logits against
    `ref`'s (float32) within twice `eager`'s own error (16-bit) plus 1e-2 of their scale."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (cache,), generator=g).cuda()
    with torch.no_grad():
        for start in range(0, cache, chunk):
            ids = tokens[start:start + chunk][None]
            pos = torch.arange(start, start + chunk, device="cuda")
            want = ref(ids, pos).double()
            mine = eager(ids, pos).double()
            got = runner(input_ids=ids, cache_position=pos).double().reshape(want.shape)
            scale = want.abs().max().item()
            err, eager_err = (got - want).abs().max().item(), (mine - want).abs().max().item()
            bound = 1e-4 * scale if dtype == torch.float32 else 2 * eager_err + 1e-2 * scale
            assert err <= bound, (start, err, eager_err, scale)


def test_llama_shaped_decode_steps_match_eager(tmp_path):
    """Llama's attention geometry (32 query heads, 4 kv heads of dim 64, hidden 2048; 2
    layers, a static cache of 256), bf16, stepped over the whole cache: the attention's decode
    path (a kv head's 8 query heads in one program, the cache's unfilled tiles skipped)
    against a float32 eager reference of the same weights, at every position."""
    def make(dtype):
        m = llama(layers=2, hidden=2048, heads=32, kv_heads=4, vocab=256, inter=1024,
                  init=0.02, device="cuda")
        return static_cache_module(m, 256, device="cuda", dtype=dtype)

    w, ep = make(torch.bfloat16)
    cm = kiln.compile(ep, device="cuda")
    src = cm.sources["kernels_triton.py"]
    assert "decode path" in src and "hk * 8 + r" in src
    assert cm.manifest["cuda"]["graphs"] is True
    runner = cm.load(tmp_path / "l.kiln", device="cuda:0")
    ref_w, _ = make(torch.float32)
    _compare_steps(runner, eager_step(w), eager_step(ref_w), 256, 1, torch.bfloat16)


def test_decode_package_has_no_whole_cache_copy(tmp_path):
    """The kernels a bf16 GQA step launches: no ATen call and no state copy (the caches are
    written in place), attention reading the kv heads (no repeat_kv copy)."""
    _, ep = _module(torch.bfloat16, 2, 1)
    cm = kiln.compile(ep, device="cuda")
    kinds = [k["kind"] for k in cm.manifest["kernels"]]
    # one launch per layer writes both caches and computes the attention (the rotary kernel
    # and the puts absorbed: targets/cuda/attention_decode.py fuse_decode_puts)
    puts = [k for k in cm.manifest["kernels"] if k["kind"] in ("lib.put", "triton_put")]
    assert sum(s.startswith("index_put") for k in puts for s in k["source_ops"]) == 2 * 2
    assert len(puts) == 2 and kinds.count("lib.attention") == 0, kinds
    assert all(k["name"].startswith("attn_") for k in puts), puts
    # 4 GEMMs a layer (merged qkv, o, merged gate/up, down) and the head: no ATen call (the
    # manifest lists one as a GEMM kind) and the package replays as one graph
    names = " ".join(f"{k['kind']}:{k['name']}" for k in cm.manifest["kernels"])
    assert sum(k.endswith(("_gemm", "_gemv")) for k in kinds) == 4 * 2 + 1, names
    # the GEMV template (M = 1) takes q/k/v, gate/up and the head with their RMSNorm as
    # prologue, down with silu(gate) * up (kiln/gemm/prologue.py); o and down add the
    # residual in their epilogue (passes/store_once.py)
    assert kinds.count("triton_gemv") == 4 * 2 + 1, names
    assert not [k for k in cm.manifest["kernels"] if k["kind"] == "triton" and
                any(s.startswith("mean") for s in k["source_ops"])], names
    assert cm.manifest["cuda"]["graphs"] is True
    src = cm.sources["kernels_triton.py"]
    assert src.count("def puts_index_put") == 0 and src.count("k_new = ") == 2  # per layer
    assert "hk * 2 + r" in src  # the decode path: a kv head's query heads in one program
