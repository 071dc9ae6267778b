"""Weights shared by the entry points of a package are stored once (issue 17): a weight that one
entry point reads whole and another reads as part of a larger tensor (decode's merged q/k/v
and gate/up weights, passes/merge_gemms.py, against prefill's separate ones; their int8 /
int4 forms) is stored once, the smaller as a view (kiln/package/entries.py): an offset into
the larger one that libkiln binds, on a device into the one upload of it.

Without a GPU: the views of a CPU package bind and run against eager, and CUDA packages of a
Llama whose prefill merges no GEMMs (prompts above merge_gemms.MAX_ROWS) store the model's
bytes once, float32 and int8. On a GPU (`-m gpu`): such a package gives eager's greedy tokens
and loads one copy of the weights."""

from __future__ import annotations

import collections
import zipfile

import pytest
import torch

import kiln
from device_memory import load_bytes
from kiln.package.entries import VIEW_ALIGNMENT
from kiln.passes.merge_gemms import MAX_ROWS


class _Add(torch.nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2.0 + self.w


def _stored(pkg) -> dict[str, int]:
    """Bytes per dtype of the package's stored tensors, state buffers left out."""
    recs = {r["name"]: r for r in pkg.manifest["weights"]}
    out: dict[str, int] = collections.Counter()
    for k, t in pkg.weights.items():
        if not recs[k].get("state"):
            out[str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
    return dict(out)


def test_a_row_range_of_another_entrys_weight_is_a_view(tmp_path):
    """Entry `a` reads rows 4..7 of `whole`'s weight (256 bytes in: a view), `unaligned` rows
    1..4 (64 bytes in: stored apart, a view keeps VIEW_ALIGNMENT); the package runs as eager."""
    torch.manual_seed(0)
    big = torch.randn(8, 16)
    models = {"a": _Add(big[4:8]), "whole": _Add(big), "unaligned": _Add(big[1:5])}
    x4, x8 = torch.randn(4, 16), torch.randn(8, 16)
    pkg = kiln.compile({"a": (models["a"], (x4,)), "whole": (models["whole"], (x8,)),
                        "unaligned": (models["unaligned"], (x4,))})
    (entry_a, entry_whole, entry_unaligned) = pkg.manifest["entries"]
    (view,) = entry_a["weights"].values()
    (key,) = entry_whole["weights"].values()
    assert view == {"key": key, "offset": 4 * 16 * 4, "dtype": "float32", "shape": [4, 16]}
    assert (4 * 16 * 4) % VIEW_ALIGNMENT == 0 and (16 * 4) % VIEW_ALIGNMENT != 0
    (apart,) = entry_unaligned["weights"].values()
    assert isinstance(apart, str) and apart != key
    assert sorted(pkg.weights) == sorted([key, apart])
    r = pkg.load(tmp_path / "views.kiln")
    for name, x in (("a", x4), ("whole", x8), ("unaligned", x4)):
        torch.testing.assert_close(getattr(r, name)(x), models[name](x).detach())


def _part(name: str, weights: dict[str, tuple[str, torch.Tensor]]):
    """An entry's (name, manifest, files, weights) for package.entries.merge: {weight name:
    (fqn, tensor)}."""
    man = {"weights": [{"name": w, "fqn": fqn, "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape)} for w, (fqn, t) in weights.items()]}
    return name, man, {}, {w: t for w, (_, t) in weights.items()}


def test_views_compose_and_need_the_fqn_words():
    """merge alone: a view of a view is a view of the stored tensor (offsets added); bytes
    equal under an FQN that does not name the contained one's words stay stored apart."""
    from kiln.package.entries import merge

    torch.manual_seed(0)
    big = torch.randn(16, 64)
    manifest, _, blob = merge([
        _part("a", {"wq": ("q", big[12:16].clone()), "other": ("z", big[0:4].clone())}),
        _part("b", {"half": ("<folded p, q>", big[8:16].clone())}),
        _part("c", {"whole": ("<folded o, p, q>", big.clone())})])
    a, b, c = manifest["entries"]
    assert sorted(blob) == ["other", "whole"]
    assert a["weights"]["wq"] == {"key": "whole", "offset": 12 * 64 * 4, "dtype": "float32",
                                  "shape": [4, 64]}
    assert b["weights"]["half"]["offset"] == 8 * 64 * 4 and a["weights"]["other"] == "other"
    assert [w["name"] for w in manifest["weights"]] == ["other", "whole"]


@pytest.fixture(scope="module")
def llama_programs():
    """A Llama and its prefill (prompts up to 2 * MAX_ROWS) and decode programs."""
    pytest.importorskip("transformers")
    from kiln.models import hf_decoder

    # q, k, v of 128, 64, 64 rows: every view's offset, scales' too, a multiple of 256 bytes
    model = hf_decoder.build("llama", 0, torch.float32, layers=1, hidden=128, heads=4,
                             kv_heads=2, intermediate=256, vocab=256)
    return model, hf_decoder.export_decoder(model, max_cache_len=4 * MAX_ROWS,
                                            max_prompt=2 * MAX_ROWS)


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_cuda_decoder_package_stores_the_weights_once(quant, llama_programs):
    """Compile only: prefill (prompts up to 2 * MAX_ROWS: its GEMMs stay apart) and decode (q/k/v
    and gate/up merged) of a Llama store the model's bytes once: float32, the parameters' bytes
    (and rotary's inv_freq); int8, what decode reads, prefill's weights views into it."""
    pytest.importorskip("triton")
    model, progs = llama_programs
    opts = kiln.Options(cuda_archs=(90,), autotune=False, weight_quant=quant)
    pkg = kiln.compile(progs, device="cuda", options=opts)
    prefill, decode = pkg.manifest["entries"]
    views = [v for v in prefill["weights"].values() if isinstance(v, dict)]
    # q, k, v, gate and up of each layer (int8: and their scales)
    assert len(views) == 5 * (2 if quant == "int8" else 1), prefill["weights"]
    assert all(isinstance(v, str) for v in decode["weights"].values())
    assert {v["key"] for v in views} <= set(decode["weights"].values())
    stored = _stored(pkg)
    if quant == "none":
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        inv_freq = model.model.rotary_emb.inv_freq
        assert stored == {"float32": params + inv_freq.numel() * 4}, (stored, params)
    else:  # every stored tensor is one decode reads
        recs = {r["name"]: r for r in pkg.manifest["weights"]}
        assert set(pkg.weights) == set(decode["weights"].values())
        assert sum(stored.values()) == sum(t.numel() * t.element_size()
                                           for k, t in pkg.weights.items()
                                           if not recs[k].get("state"))
        # int8 GEMM weights and their float32 scales; the embedding and norms float32
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        assert sum(stored.values()) < 0.6 * params, (stored, params)


@pytest.mark.gpu
@pytest.mark.parametrize("quant", ["none", "int8"])
def test_cuda_decoder_with_views_generates_as_eager(quant, tmp_path):
    """On a GPU: the package whose prefill reads views into decode's merged weights gives
    eager's greedy tokens (float32) and prefill logits near eager's (int8), and loading it
    takes one copy of the weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from kiln.models import hf_decoder

    model = hf_decoder.llama(layers=2, hidden=256, heads=4, kv_heads=2, vocab=1000, inter=512)
    progs = hf_decoder.export_decoder(model, max_cache_len=4 * MAX_ROWS,
                                      max_prompt=2 * MAX_ROWS)
    opts = kiln.Options(autotune=False, weight_quant=quant)
    path = kiln.compile(progs, device="cuda", options=opts).save(tmp_path / "llama.kiln")
    prompt = [(7 * i + 3) % 1000 for i in range(MAX_ROWS + 9)]  # prefill above MAX_ROWS
    r = kiln.load(path, device="cuda")
    if quant == "none":
        want = hf_decoder.eager_generate(model, prompt, 12, max_cache_len=4 * MAX_ROWS)
        assert kiln.runtime.generate(r, prompt, 12).tokens == want
    else:
        module = hf_decoder.static_cache_module(model, 4 * MAX_ROWS)
        ids = torch.tensor([prompt])
        with torch.no_grad():
            want = module(input_ids=ids, cache_position=torch.arange(len(prompt)))
        got = r.prefill(input_ids=ids.cuda(),
                        cache_position=torch.arange(len(prompt), device="cuda"))
        got = (got[0] if isinstance(got, (tuple, list)) else got).float().cpu()
        want = (want[0] if isinstance(want, (tuple, list)) else want).float()
        cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
        assert cos > 0.99, cos
    r.close()


@pytest.mark.gpu
def test_views_share_the_one_upload_of_the_merged_weights(tmp_path):
    """On a GPU: q/k/v and gate/up are 2/3 of this model's 480 MB; prefill reads them as views
    into decode's merged weights, so the package takes about decode's memory alone plus the
    other entries' arenas and modules (about 50 MiB each), not another 320 MB of weights."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from kiln.models import hf_decoder
    from kiln.models import device_sampler as S

    model = hf_decoder.llama(layers=8, hidden=1024, heads=8, kv_heads=4, vocab=1000,
                             inter=4096)
    progs = hf_decoder.export_decoder(model, max_cache_len=4 * MAX_ROWS,
                                      max_prompt=2 * MAX_ROWS, sampler=S.export_sampler)
    opts = kiln.Options(autotune=False)
    every = kiln.compile(progs, device="cuda", options=opts)
    assert any(isinstance(v, dict) for v in every.manifest["entries"][0]["weights"].values())
    every = every.save(tmp_path / "all.kiln")
    one = kiln.compile({"decode": progs["decode"]}, device="cuda", options=opts).save(
        tmp_path / "decode.kiln")
    with zipfile.ZipFile(every) as z:
        blob = z.getinfo("weights.safetensors").file_size
    used_every, used_one = load_bytes(every), load_bytes(one)
    assert used_one > 0.9 * blob, (used_one, blob)
    assert used_every - used_one < blob / 2, (used_every, used_one, blob)
