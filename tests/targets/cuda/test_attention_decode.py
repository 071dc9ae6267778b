"""The attention template's decode path without a GPU (targets/cuda/attention.py: few query
rows, L <= 16): grouped-query heads packed into one program per kv head, the keys split
among programs (a float32 scratch planned as the call's second output, then a combine
kernel), key tiles that a bool / float mask or causality hides skipped. Checked: what the
lowering declares, the heuristic split and the candidates, the Loop IR interpreter's twin,
the generated source and wrapper, and the kernels themselves run by Triton's interpreter
(TRITON_INTERPRET=1, in a subprocess) against eager in float64 over L, S, groups, head dims,
dtypes, partly filled static-cache masks, fully masked rows, causal and float masks."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

import kiln  # noqa: E402
from kiln.errors import CompileError  # noqa: E402
from kiln.frontend.export import import_program  # noqa: E402
from kiln.ir.interp import run_loop  # noqa: E402
from kiln.lowering import lower  # noqa: E402
from kiln.options import Options  # noqa: E402
from kiln.passes.dce import dce  # noqa: E402
from kiln.passes.gqa_attention import fold_repeat_kv  # noqa: E402
from kiln.targets.cuda import tune_plan as TP  # noqa: E402
from kiln.targets.cuda.attention import (attention_candidates, attention_kernels,  # noqa: E402
                                         choose_attention_config, is_decode)
from kiln.targets.cuda.kernel import Config  # noqa: E402

DT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Gqa(torch.nn.Module):
    """scaled_dot_product_attention over Hugging Face's repeat_kv copies of Hkv key / value
    heads (group g); q as [B, L, H, E] transposed when `qt` (a projection's layout)."""

    def __init__(self, g: int, causal: bool = False, qt: bool = False):
        super().__init__()
        self.g, self.causal, self.qt = g, causal, qt

    def forward(self, q, k, v, *mask):
        if self.qt:
            q = q.transpose(1, 2)
        b, hkv, s, e = k.shape
        if self.g > 1:
            k = k[:, :, None].expand(b, hkv, self.g, s, e).reshape(b, hkv * self.g, s, e)
            ev = v.shape[-1]
            v = v[:, :, None].expand(b, hkv, self.g, s, ev).reshape(b, hkv * self.g, s, ev)
        return F.scaled_dot_product_attention(q, k, v, *mask, is_causal=self.causal)


def case_inputs(c: dict) -> list[torch.Tensor]:
    """Inputs of case `c` (keys b, hkv, g, lq, s, e, ev, dt, mask, pos, seed, qt): mask "bool"
    is a static cache's [B, 1, L, S] (query i at position pos + i keeps keys j <= pos + i;
    pos "first" / "middle" / "last" or a number), batch 1 (or query row 1) fully masked; "bool2d" a
    random [L, S] mask (query row 1 fully masked); "float" a [B, 1, L, S] float mask with -inf
    entries, batch 1 (or the last query row) fully masked."""
    g = torch.Generator().manual_seed(c.get("seed", 0))
    dt = DT[c["dt"]]
    b, h, lq, s, e, ev = c["b"], c["hkv"] * c["g"], c["lq"], c["s"], c["e"], c.get("ev", c["e"])
    q = torch.randn(b, lq, h, e, generator=g) if c.get("qt") else torch.randn(b, h, lq, e,
                                                                                generator=g)
    out = [q.to(dt), torch.randn(b, c["hkv"], s, e, generator=g).to(dt),
           torch.randn(b, c["hkv"], s, ev, generator=g).to(dt)]
    kind = c.get("mask")
    if kind == "bool":
        pos = c["pos"] if isinstance(c["pos"], int) else \
            {"first": 0, "middle": max(0, (s - lq) // 2), "last": max(0, s - lq)}[c["pos"]]
        j = torch.arange(s)
        keep = j[None, :] <= (pos + torch.arange(lq))[:, None]
        m = keep[None, None].expand(b, 1, lq, s).clone()
        if b > 1:
            m[1] = False  # a whole batch entry fully masked
        elif lq > 1:
            m[0, 0, 1] = False  # one query row fully masked
        out.append(m)
    elif kind == "bool2d":
        m = torch.rand(lq, s, generator=g) > 0.4
        if lq > 1:
            m[1] = False
        out.append(m)
    elif kind == "float":
        m = torch.randn(b, 1, lq, s, generator=g)
        m[..., ::3] = float("-inf")
        m[..., 1::7] = float("-inf")
        if b > 1:
            m[1] = float("-inf")  # a whole batch entry fully masked
        elif lq > 1:
            m[:, :, lq - 1] = float("-inf")  # the last query row fully masked
        out.append(m.to(dt))
    return out


def module(c: dict) -> Gqa:
    return Gqa(c["g"], bool(c.get("causal")), bool(c.get("qt")))


def want(c: dict, args) -> torch.Tensor:
    return module(c)(*[a.double() if a.is_floating_point() else a for a in args])


def tolerance(dt: str) -> float:
    """float32: 3xTF32 products; 16-bit: probabilities rounded to the input type for the
    second product (as flash-attention kernels do), outputs rounded once."""
    return {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}[dt]


def loop_of(c: dict, args):
    """(graph, Loop program, the attention Extern) of case `c`."""
    ep = torch.export.export(module(c), tuple(args))
    graph = dce(fold_repeat_kv(import_program(ep, fused_attention=True).graph))
    prog = lower(graph, attention_splits=True)
    (call,) = [n for n in prog.nodes if getattr(n, "routine", None) == "attention"]
    return graph, prog, call


def run_case(c: dict, configs: str = "heuristic") -> list[tuple[str, float, bool]]:
    """Runs case `c`'s attention kernels (`attention_kernels`, launched as the wrappers do:
    the attention kernel, then the combine) on the current Triton (the interpreter in the
    tests) for the heuristic config or every candidate; returns (config, max error against
    eager in float64, fully masked rows exactly zero)."""
    # deferred: only the interpreter subprocess launches kernels
    from kiln.targets.cuda.wrapper_py import import_triton_module, launch_kernel
    args = case_inputs(c)
    graph, prog, call = loop_of(c, args)
    buffers = {b.name: b for b in prog.buffers}
    ref = want(c, args)
    cands = ([choose_attention_config(call, buffers, {})] if configs == "heuristic" else
             attention_candidates(call, buffers, {}))
    if configs == "forced":
        cands = [Config(int(call.attr("splits", 1)), 16, 4, 2)]
    out = []
    for cfg in cands:
        ks = attention_kernels(call, buffers, {}, cfg)
        mod = import_triton_module("import triton\nimport triton.language as tl\n\n" +
                                   "\n\n".join(k.source for k in ks))
        bufs = {i.name: a.contiguous().reshape(-1) for i, a in zip(graph.user_inputs, args)}
        for name in call.outs:
            bb = buffers[name]
            n = 1
            for d in bb.shape:
                n *= int(d)
            # NaN-filled outputs and scratch: whatever the kernels do not write shows
            bufs[name] = torch.full((n,), float("nan"), dtype=DT[bb.dtype.name])
        for a in call.args:
            assert a.buf in bufs, f"operand {a.buf} is not an input of the case"
        status = torch.zeros(1, dtype=torch.int32)
        for k in ks:
            launch_kernel(mod, k, {}, bufs, status, "cpu")
        got = bufs[call.name].double().reshape(ref.shape)
        err = (got - ref).abs().max().item()
        dead = ref.abs().amax(-1) == 0  # eager's fully masked rows: zeros
        zeros = bool((got[dead] == 0).all())
        out.append((f"m{cfg.xblock}n{cfg.rblock}w{cfg.num_warps}s{cfg.num_stages}", err, zeros))
    return out


def compile_case(c: dict, opts: Options | None = None):
    """The CUDA package (cubins for sm_90) of case `c` compiled here, and its inputs."""
    args = case_inputs(c)
    return kiln.compile(torch.export.export(module(c), tuple(args)), device="cuda",
                        options=opts or Options(cuda_archs=(90,), autotune=False)), args


def run_package_case(c: dict) -> list[tuple[str, float, bool]]:
    """Case `c`'s whole package program run by the Python wrapper (`run_program`: the
    attention kernel, then the combine, the scratch allocated as planned), on the current
    Triton (the cubins must be cached: `compile_case` in a normal-mode process first)."""
    # deferred: only the interpreter subprocess launches kernels
    from kiln.targets.cuda.build import triton_kernels
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    cm, args = compile_case(c)
    b = cm.built
    mod = import_triton_module(b.sources["kernels_triton.py"])
    bufs = {x.name: x for x in b.loop.buffers}
    ks = {k.name: k for k in triton_kernels(b.steps, bufs, {})}
    (got,) = run_program(b.program, ks, mod, b.weights, args)
    ref = want(c, args)
    got = got.double().reshape(ref.shape)
    dead = ref.abs().amax(-1) == 0
    combine = any(n.endswith("_combine") for n in ks)
    return [(f"package{' +combine' if combine else ''}", (got - ref).abs().max().item(),
             bool((got[dead] == 0).all()))]


# -- without a GPU: lowering, configs, sources, the numpy twin -------------------------------

LLAMA = {"b": 1, "hkv": 4, "g": 8, "lq": 1, "s": 256, "e": 64, "dt": "bfloat16",
         "mask": "bool", "pos": "middle"}


def test_decode_call_declares_its_split_scratch():
    c = dict(LLAMA, s=2048)
    args = case_inputs(c)
    _, prog, call = loop_of(c, args)
    buffers = {b.name: b for b in prog.buffers}
    assert is_decode(call) and call.attr("group") == 8
    assert call.attr("splits") == 32  # S / 64, within 512 programs / (B x Hkv = 4)
    part = buffers[call.outs[1]]
    assert part.dtype.name == "float32" and [int(d) for d in part.shape] == [32, 32, 66]
    cfg = choose_attention_config(call, buffers, {})
    # every split the scratch holds: 2048 keys / 64 a split, one 64-key tile each, 4 x 32
    # programs (the twelfth session's 256 keys a split made 4 x 8 programs of 256 keys)
    assert cfg.xblock == 32 and cfg.rblock == 64
    main, comb = attention_kernels(call, buffers, {}, cfg)
    assert comb.name == main.name + "_combine"
    assert int(main.rows) == 4 * 32 * 32 and int(comb.rows) == 32  # programs x XBLOCK; rows
    assert "hk * 8 + r" in main.source and "tl.dot(q, kt" in main.source
    # masked tiles skipped; in a tile, only the keys some row keeps are loaded
    assert "col_live = tl.max(keep.to(tl.int32), 0) > 0" in main.source
    assert "if tl.max(col_live.to(tl.int32)) > 0:" in main.source
    assert "mask=col_live[None, :]" in main.source and "mask=col_live[:, None]" in main.source
    assert f"buf_{call.outs[1]}" in main.source and f"buf_{call.outs[1]}" in comb.source


def test_split_beyond_the_scratch_is_refused():
    c = dict(LLAMA, s=256)
    _, prog, call = loop_of(c, case_inputs(c))
    with pytest.raises(CompileError, match=r"8 key splits.*holds 4"):
        attention_kernels(call, {b.name: b for b in prog.buffers}, {}, Config(8, 64, 4, 2))


@pytest.mark.parametrize("s, b, hkv, split", [(256, 1, 4, 4), (1000, 1, 4, 16),
                                              (8192, 1, 4, 64), (8192, 16, 8, 4),
                                              (2048, 128, 4, 1), (37, 1, 1, 1)])
def test_heuristic_split_follows_the_sizes(s, b, hkv, split):
    c = dict(LLAMA, s=s, b=b, hkv=hkv, mask=None, e=16)
    _, prog, call = loop_of(c, case_inputs(c))
    buffers = {x.name: x for x in prog.buffers}
    cfg = choose_attention_config(call, buffers, {})
    assert cfg.xblock == split, cfg
    cands = attention_candidates(call, buffers, {})
    assert cands[0] == cfg and len(set(cands)) == len(cands)
    assert all(x.xblock <= call.attr("splits", 1) for x in cands)
    if call.attr("splits", 1) > 1:  # the split is a tuning dimension
        assert len({x.xblock for x in cands}) >= 2
    assert len(attention_kernels(call, buffers, {}, cfg)) == (2 if split > 1 else 1)


def test_prefill_keeps_the_flash_kernel():
    c = dict(LLAMA, lq=17, s=64, mask=None, dt="float16")
    _, prog, call = loop_of(c, case_inputs(c))
    assert not is_decode(call) and len(call.outs) == 1
    src = attention_kernels(call, {b.name: b for b in prog.buffers}, {})[0].source
    assert "decode path" not in src and "m_blk" in src


def test_dynamic_batch_has_no_scratch_but_packs_heads():
    c = dict(LLAMA, b=2, dt="float32")
    args = case_inputs(c)
    bd = {0: torch.export.Dim("B", min=1, max=64)}
    ep = torch.export.export(module(c), tuple(args), dynamic_shapes=(bd, bd, bd, (bd,)))
    prog = lower(dce(fold_repeat_kv(import_program(ep, fused_attention=True).graph)),
                 attention_splits=True)
    (call,) = [n for n in prog.nodes if getattr(n, "routine", None) == "attention"]
    buffers = {b.name: b for b in prog.buffers}
    assert is_decode(call) and len(call.outs) == 1 and call.attr("splits") is None
    cfg = choose_attention_config(call, buffers, {"s0": 3})
    (k,) = attention_kernels(call, buffers, {"s0": 3}, cfg)
    assert cfg.xblock == 1 and "hk * 8 + r" in k.source and "s0" in str(k.rows)


TWIN = [dict(LLAMA, dt="float32"), dict(LLAMA, dt="float16", lq=3, s=37, pos="last", b=2),
        dict(LLAMA, dt="float32", g=4, lq=16, s=1000, mask="float", e=80),
        dict(LLAMA, dt="float16", g=1, lq=3, s=37, mask=None, causal=True, qt=True)]


@pytest.mark.parametrize("c", TWIN, ids=[f"twin{i}" for i in range(len(TWIN))])
def test_loop_interpreter_twin_matches_eager(c):
    args = case_inputs(c)
    graph, prog, _ = loop_of(c, args)
    feeds = {i.name: a.numpy() for i, a in zip(graph.user_inputs, args)}
    (got,) = run_loop(prog, feeds, {})
    tol = 1e-5 if c["dt"] == "float32" else 2e-3
    torch.testing.assert_close(torch.from_numpy(got).double(), want(c, args), rtol=tol,
                               atol=tol)


def test_cuda_package_launches_the_combine(tmp_path):
    cm, _ = compile_case(dict(LLAMA, s=2048, dt="float16"))
    (name, info), = cm.manifest["cuda"]["attention"].items()
    assert info["block_m"] == 32  # the decode path's XBLOCK: its key splits
    cpp = cm.sources["model_cuda.cpp"]
    assert f'"{name}"' in cpp and f'"{name}_combine"' in cpp
    assert cpp.index(f'"{name}"') < cpp.index(f'"{name}_combine"')
    assert "_part" in cpp  # the scratch is an arena temp
    assert f"def {name}_combine(" in cm.sources["kernels_triton.py"]


def test_decode_cost_model_counts_kv_once_per_kv_head():
    full = TP.attention_us(32, 1, 8192, 128, 128, 2, False)
    packed = TP.attention_us(32, 1, 8192, 128, 128, 2, False, group=8, splits=32)
    serial = TP.attention_us(32, 1, 8192, 128, 128, 2, False, group=8, splits=1)
    assert packed < full and packed < serial


# -- Triton's interpreter (a subprocess: the AOT compiler needs the normal mode) -------------

_DRIVER = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, sys.argv[1])
    from triton.runtime import interpreter as ti
    import triton.language as tl
    _dot = ti.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        # Triton 3.6's interpreter multiplies bfloat16 operands' raw uint16 bits: widen them
        # to float32 first, as it already does for float8 operands
        if a.dtype.scalar == tl.bfloat16:
            a = ti.TensorHandle(ti._convert_float(a.data, tl.bfloat16, tl.float32, None)
                                .view(np.float32), tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = ti.TensorHandle(ti._convert_float(b.data, tl.bfloat16, tl.float32, None)
                                .view(np.float32), tl.float32)
        return _dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    ti.InterpreterBuilder.create_dot = create_dot
    from test_attention_decode import run_case, run_package_case, tolerance
    bad = []
    for c, configs in json.loads(sys.argv[2]):
        got = run_package_case(c) if configs == "package" else run_case(c, configs)
        for cfg, err, zeros in got:
            ok = err <= tolerance(c["dt"]) and zeros
            print(json.dumps(c), cfg, err, "zeros" if zeros else "NONZERO", flush=True)
            if not ok:
                bad.append(f"{json.dumps(c)} {cfg}: max error {err}, masked rows zero {zeros}")
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
    sys.exit(1 if bad else 0)
""")


def _interpret(cases: list[tuple[dict, str]]) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", _DRIVER, str(pathlib.Path(__file__).parent),
                          json.dumps(cases)], env=env, capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr[-3000:]


B = dict(b=1, hkv=2, g=4, lq=1, s=37, e=64, dt="float32", mask=None)
FAST = [  # (case, configs): a few of every dimension, in one subprocess
    (dict(LLAMA), "heuristic"),  # the Llama step: bf16, G 8, a half-filled 256-key cache
    (dict(LLAMA, s=1000, pos="last", dt="float16"), "heuristic"),  # 4 key splits
    (dict(LLAMA, s=1000, pos="middle", dt="float32", b=2, hkv=2), "heuristic"),  # batch 1 dead
    (dict(B, lq=3, g=8, s=256, mask="bool", pos="first", dt="bfloat16"), "forced"),
    (dict(B, lq=16, g=1, s=37, e=80, mask="float", dt="float16"), "forced"),
    (dict(B, lq=3, g=4, s=1, e=128, dt="float32", causal=True, qt=True), "heuristic"),
    (dict(B, lq=16, g=4, s=256, e=64, dt="float16", causal=True, mask="bool2d"), "forced"),
    (dict(B, lq=1, g=1, s=256, e=128, ev=80, dt="float32", mask="bool", pos="last"), "all"),
    # the live key range split among the programs: a float mask, a range inside one tile
    (dict(LLAMA, s=300, mask="float", dt="float32"), "heuristic"),
    (dict(LLAMA, hkv=2, s=1000, pos=70, dt="float16"), "all"),
]


PACKAGES = [(dict(LLAMA, s=1000, dt="float16", b=2, hkv=2), "package"),  # split: + combine
            (dict(B, lq=3, g=4, s=37, mask="float", dt="float32"), "package")]


@pytest.mark.slow  # (moved out of the default suite: it ran over 20 minutes)
def test_decode_kernels_match_eager_in_interpreter():
    for c, _ in PACKAGES:  # cubins first: the AOT compiler cannot run in interpreter mode
        compile_case(c)
    _interpret(FAST + PACKAGES)


def _grid() -> list[tuple[dict, str]]:
    out = []
    for lq in (1, 3, 16):
        for s in (1, 37, 256, 1000):
            for g in (1, 4, 8):
                for e in (64, 128, 80):
                    for dt in ("bfloat16", "float16", "float32"):
                        i = len(out)
                        mask = ("bool", "bool", "float", "bool2d", None)[i % 5]
                        c = dict(b=1 + i % 2, hkv=2, g=g, lq=lq, s=s, e=e, dt=dt, mask=mask,
                                 pos=("first", "middle", "last")[i % 3], causal=i % 7 == 0,
                                 seed=i)
                        out.append((c, "forced" if i % 4 == 0 else "heuristic"))
    return out


@pytest.mark.slow
def test_decode_kernels_match_eager_in_interpreter_grid():
    """L x S x groups x head dims x dtypes (324 cases), masks / causal / positions varied."""
    _interpret(_grid())
