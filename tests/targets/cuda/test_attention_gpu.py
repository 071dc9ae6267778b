"""kiln's flash-attention kernel on a GPU (skipped without CUDA): scaled_dot_product_attention
variants (causal, bool / float masks with broadcast dims, fully masked rows, L != S, explicit
scale, head dims 16..256 including non powers of two, q / k / v transposed out of a projection)
against eager; float32 to 1e-4, float16 / bfloat16 against a float64 reference (kiln's error
at most twice eager's in the same dtype plus 1e-3 of the output's scale: the products round
probabilities to 16 bits, as eager's flash kernels do); dynamic batch / heads / lengths from
one package; the gpt zoo model end to end through the fused kernel."""

from __future__ import annotations

import copy
import sys

import pytest
import torch

import kiln
from kiln.models import ALL_MODELS
from kiln.options import Options

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from test_attention import Sdpa  # noqa: E402

# the heuristic config (autotuning is tested below); float32 attention fused too
OPTS = Options(autotune=False, fused_attention=True)


def _inputs(b, h, lq, s, e, ev, dt, mask, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, lq, h, e, generator=g).to(dt)
    k = torch.randn(b, s, h, e, generator=g).to(dt)
    v = torch.randn(b, s, h, ev, generator=g).to(dt)
    out = [q, k, v]
    if mask == "bool":  # [L, S], broadcast over B and H; row 1 fully masked
        m = torch.rand(lq, s, generator=g) > 0.3
        m[1] = False
        out.append(m)
    elif mask == "float":  # [B, 1, L, S]: broadcast over H; -inf entries and a masked row
        m = torch.randn(b, 1, lq, s, generator=g)
        m[..., ::3] = float("-inf")
        m[:, :, 2] = float("-inf")
        out.append(m.to(dt))
    return out


def _compile(module, args, tmp_path, dynamic=None, opts=OPTS):
    cm = kiln.compile(torch.export.export(module, tuple(args), dynamic_shapes=dynamic),
                      device="cuda", options=opts)
    assert cm.manifest["cuda"]["attention"], "the fused kernel computes the attention"
    return cm, kiln.load(cm.save(tmp_path / "a.kiln"), device="cuda:0")


def _check(module, runner, args, dt):
    dev = [a.cuda() for a in args]
    got = runner(*dev)
    want = module(*dev)
    if dt == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)
        return
    ref = module(*[a.double() if a.is_floating_point() else a for a in dev])
    assert torch.equal(got.isnan(), ref.isnan())
    err = (got.double() - ref).nan_to_num(0).abs().max().item()
    eager_err = (want.double() - ref).nan_to_num(0).abs().max().item()
    scale = ref.nan_to_num(0).abs().max().item()
    print(f"{dt}: kiln err {err:.3g}, eager err {eager_err:.3g}, scale {scale:.3g}",
          file=sys.stderr)
    assert err <= 2 * eager_err + 1e-3 * scale, (err, eager_err, scale)


VARIANTS = [  # (dtype, E, Ev, L, S, causal, mask, scale)
    (torch.float32, 64, 64, 77, 77, False, None, None),
    (torch.float32, 64, 64, 77, 130, True, None, None),
    (torch.float32, 80, 80, 50, 33, True, "bool", None),
    (torch.float32, 32, 48, 40, 90, False, "float", 0.3),
    (torch.float16, 64, 64, 200, 200, True, None, None),
    (torch.float16, 128, 128, 100, 257, False, "bool", None),
    (torch.bfloat16, 64, 64, 300, 300, True, None, None),
    (torch.bfloat16, 80, 80, 129, 65, True, None, None),
    (torch.bfloat16, 128, 128, 64, 300, False, "float", None),
    (torch.bfloat16, 256, 256, 70, 70, True, None, 0.1),
    (torch.float16, 16, 16, 33, 17, False, None, None),
]


@pytest.mark.parametrize("dt,e,ev,lq,s,causal,mask,scale", VARIANTS,
                         ids=[f"{str(v[0])[6:]}-e{v[1]}-{v[3]}x{v[4]}-c{int(v[5])}-{v[6]}"
                              for v in VARIANTS])
def test_variant_matches_eager(dt, e, ev, lq, s, causal, mask, scale, tmp_path):
    kw = {"is_causal": causal, **({"scale": scale} if scale is not None else {})}
    module = Sdpa(**kw)
    args = _inputs(2, 3, lq, s, e, ev, dt, mask)
    _, runner = _compile(module, args, tmp_path)
    for seed in (1, 2, 3):  # direct run, graph capture, replay
        _check(module, runner, _inputs(2, 3, lq, s, e, ev, dt, mask, seed), dt)


def test_dynamic_sizes(tmp_path):
    from torch.export import Dim
    module = Sdpa(is_causal=True)
    b, h, n = Dim("b", min=1, max=8), Dim("h", min=1, max=16), Dim("n", min=2, max=1024)
    dyn = ({0: b, 1: n, 2: h},) * 3
    args = _inputs(2, 4, 100, 100, 64, 64, torch.bfloat16, None)
    cm, runner = _compile(module, args, tmp_path, dyn)
    for bb, hh, nn in ((1, 1, 2), (3, 5, 17), (8, 16, 1024), (2, 4, 100), (1, 2, 513)):
        _check(module, runner, _inputs(bb, hh, nn, nn, 64, 64, torch.bfloat16, None, bb),
               torch.bfloat16)


def test_autotuned_attention(tmp_path):
    module = Sdpa(is_causal=True)
    args = _inputs(2, 8, 512, 512, 64, 64, torch.bfloat16, None)
    # tune_prune=False: this attention (about 3 us) is below the default plan's threshold
    cm, runner = _compile(module, args, tmp_path,
                          opts=Options(cache_dir=str(tmp_path / "cache"), tune_prune=False))
    tuned = cm.manifest["cuda"]["autotuned"]
    print("attention autotuned:", tuned, file=sys.stderr)
    assert any(k.startswith("attn_") and len(v) >= 2 for k, v in tuned.items())
    _check(module, runner, _inputs(2, 8, 512, 512, 64, 64, torch.bfloat16, None, 1),
           torch.bfloat16)


def test_fully_masked_rows_match_eager_on_gpu(tmp_path):
    module = Sdpa()
    args = _inputs(1, 2, 8, 12, 64, 64, torch.float32, "bool")
    _, runner = _compile(module, args, tmp_path)
    dev = [a.cuda() for a in args]
    got, want = runner(*dev), module(*dev)
    print("eager fully masked row:", want[0, 0, 1, :4].tolist(), file=sys.stderr)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_gpt_end_to_end(dt, tmp_path):
    from kiln.models.zoo import in_dtype
    spec = ALL_MODELS["gpt"]()
    if dt != torch.float32:
        spec = in_dtype(spec, dt)
    cm = kiln.compile(spec.export(), device="cuda", options=OPTS)
    assert len(cm.manifest["cuda"]["attention"]) == 2  # one fused kernel per block
    runner = kiln.load(cm.save(tmp_path / "gpt.kiln"), device="cuda:0")
    module = spec.module.cuda()
    for seed, (b, t) in enumerate([(2, 128), (1, 2), (3, 77), (4, 256), (4, 256)]):
        (idx,) = spec.make_inputs(seed, batch=b, seq=t)
        got = runner(idx.cuda())
        with torch.no_grad():
            want = module(idx.cuda())
        if dt == torch.float32:
            torch.testing.assert_close(got, want, rtol=spec.rtol, atol=spec.atol)
        else:
            with torch.no_grad():
                ref = copy.deepcopy(spec.module).double()(idx.cuda())
            err = (got.double() - ref).abs().max().item()
            eager_err = (want.double() - ref).abs().max().item()
            assert err <= 2 * eager_err + 1e-3 * ref.abs().max().item(), (err, eager_err)


# -- the decode path (few query rows: GQA packed, keys split, masked tiles skipped) ----------

from test_attention_decode import case_inputs, module as decode_module  # noqa: E402

DECODE = [  # cases of test_attention_decode.case_inputs: Llama's 32 / 4 heads, head dim 64
    dict(b=1, hkv=4, g=8, lq=1, s=256, e=64, dt="bfloat16", mask="bool", pos="middle"),
    dict(b=1, hkv=4, g=8, lq=1, s=256, e=64, dt="bfloat16", mask="bool", pos="first"),
    dict(b=1, hkv=4, g=8, lq=1, s=2048, e=128, dt="bfloat16", mask="bool", pos="last"),
    dict(b=1, hkv=4, g=8, lq=1, s=8192, e=64, dt="float16", mask="bool", pos="middle"),
    dict(b=2, hkv=4, g=8, lq=1, s=1000, e=64, dt="bfloat16", mask="bool", pos="middle"),
    dict(b=1, hkv=4, g=8, lq=4, s=256, e=64, dt="bfloat16", mask="bool", pos="middle"),
    dict(b=1, hkv=2, g=4, lq=16, s=1000, e=80, dt="float16", mask="bool", pos="last"),
    dict(b=1, hkv=32, g=1, lq=1, s=2048, e=64, dt="float32", mask="bool", pos="middle"),
    dict(b=1, hkv=2, g=8, lq=3, s=37, e=128, dt="float32", mask=None, causal=True),
    dict(b=1, hkv=4, g=8, lq=1, s=4096, e=64, dt="bfloat16", mask="float"),
    dict(b=1, hkv=4, g=8, lq=1, s=8192, e=128, dt="bfloat16", mask=None),
    # Llama-3-8B's attention (32 / 8 heads, head dim 128): 32, 512 and 4096 filled positions
    # of an 8192-key cache (64 splits of 128 keys), a 512-key cache (8 splits of 64), MHA
    dict(b=1, hkv=8, g=4, lq=1, s=8192, e=128, dt="bfloat16", mask="bool", pos=31),
    dict(b=1, hkv=8, g=4, lq=1, s=8192, e=128, dt="bfloat16", mask="bool", pos=511),
    dict(b=1, hkv=8, g=4, lq=1, s=8192, e=128, dt="bfloat16", mask="bool", pos=4095),
    dict(b=1, hkv=8, g=4, lq=1, s=8192, e=128, dt="float16", mask="bool", pos=4095),
    dict(b=1, hkv=8, g=4, lq=1, s=8192, e=128, dt="float32", mask="bool", pos=4095),
    dict(b=1, hkv=8, g=4, lq=1, s=512, e=128, dt="bfloat16", mask="bool", pos=12),
    dict(b=1, hkv=8, g=4, lq=1, s=512, e=128, dt="float32", mask="bool", pos=300),
    dict(b=1, hkv=32, g=1, lq=1, s=8192, e=128, dt="bfloat16", mask="bool", pos=4095),
    dict(b=1, hkv=32, g=1, lq=1, s=512, e=128, dt="float16", mask="bool", pos=64),
]


def _decode_id(c):
    return (f"{c['dt'][:4]}-b{c['b']}-h{c['hkv'] * c['g']}/{c['hkv']}-L{c['lq']}-S{c['s']}-"
            f"e{c['e']}-{c.get('mask')}-{c.get('pos', '')}{'-causal' if c.get('causal') else ''}")


@pytest.mark.parametrize("c", DECODE, ids=[_decode_id(c) for c in DECODE])
def test_decode_path_matches_eager(c, tmp_path):
    """The decode kernel (and its combine where the keys are split) against a float64
    reference: float32 to 1e-4, 16-bit within twice eager's error plus 1e-3 of the scale;
    fully masked rows exactly zero."""
    mod = decode_module(c)
    args = case_inputs(c)
    cm, runner = _compile(mod, args, tmp_path)
    src = cm.sources["kernels_triton.py"]
    assert "decode path" in src
    (name, info), = cm.manifest["cuda"]["attention"].items()
    print(_decode_id(c), "splits", info["block_m"], "keys/step", info["block_n"],
          "combine" if f"def {name}_combine" in src else "", file=sys.stderr)
    for seed in (1, 2, 3):  # direct run, graph capture, replay
        dev = [a.cuda() for a in case_inputs(dict(c, seed=seed))]
        got, want = runner(*dev), mod(*dev)
        ref = mod(*[a.double() if a.is_floating_point() else a for a in dev])
        assert not got.isnan().any()
        dead = ref.abs().amax(-1) == 0
        assert (got[dead] == 0).all()
        err = (got.double() - ref).abs().max().item()
        eager_err = (want.double() - ref).nan_to_num(0).abs().max().item()
        scale = ref.abs().max().item()
        print(f"  kiln err {err:.3g}, eager err {eager_err:.3g}, scale {scale:.3g}",
              file=sys.stderr)
        bound = 1e-4 if c["dt"] == "float32" else 2 * eager_err + 1e-3 * scale
        assert err <= bound, (err, eager_err, scale)


def test_decode_path_autotuned_splits(tmp_path):
    """The tuner times the split candidates (tune_prune=False: a decode step is below the
    plan's threshold); the tuned package still matches eager."""
    c = dict(b=1, hkv=4, g=8, lq=1, s=8192, e=64, dt="bfloat16", mask="bool", pos="middle")
    mod = decode_module(c)
    cm, runner = _compile(mod, case_inputs(c), tmp_path,
                          opts=Options(cache_dir=str(tmp_path / "cache"), tune_prune=False))
    tuned = cm.manifest["cuda"]["autotuned"]
    print("decode attention autotuned:", tuned, file=sys.stderr)
    (ms,) = [v for k, v in tuned.items() if k.startswith("attn_")]
    # several split counts timed (config texts m<splits>n<keys a step>w<warps>s<stages>)
    assert len({k.split("n")[0] for k in ms if k.startswith("m")}) >= 2, ms
    dev = [a.cuda() for a in case_inputs(dict(c, seed=4))]
    ref = mod(*[a.double() if a.is_floating_point() else a for a in dev])
    err = (runner(*dev).double() - ref).abs().max().item()
    eager_err = (mod(*dev).double() - ref).abs().max().item()
    assert err <= 2 * eager_err + 1e-3 * ref.abs().max().item(), (err, eager_err)


@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("g", [4, 1])
def test_decode_path_follows_the_cache_position(dt, g, tmp_path):
    """One package, the cache position changed at run time (the mask is data): filled
    lengths 1 .. 8192 of an 8192-key cache, tile and split edges included, against float64;
    keys and values past the filled part are NaN, so a kernel that read them would show."""
    c = dict(b=1, hkv=32 // g, g=g, lq=1, s=8192, e=128, dt=dt, mask="bool", pos=0)
    mod = decode_module(c)
    cm, runner = _compile(mod, case_inputs(c), tmp_path)
    (_, info), = cm.manifest["cuda"]["attention"].items()
    print(f"{dt} G{g}: splits {info['block_m']}, keys a tile {info['block_n']}", file=sys.stderr)
    for pos in (0, 31, 63, 64, 127, 128, 511, 4095, 4096, 8190, 8191):
        q, k, v, m = (a.cuda() for a in case_inputs(dict(c, pos=pos, seed=pos)))
        k[:, :, pos + 1:] = float("nan")
        v[:, :, pos + 1:] = float("nan")
        got = runner(q, k, v, m)
        ref = mod(q.double(), k[:, :, :pos + 1].double(), v[:, :, :pos + 1].double(),
                  m[..., :pos + 1])
        want = mod(q, k[:, :, :pos + 1], v[:, :, :pos + 1], m[..., :pos + 1])
        assert not got.isnan().any(), pos
        err = (got.double() - ref).abs().max().item()
        eager_err = (want.double() - ref).abs().max().item()
        scale = ref.abs().max().item()
        bound = 1e-4 if dt == "float32" else 2 * eager_err + 1e-3 * scale
        assert err <= bound, (pos, err, eager_err, scale)
