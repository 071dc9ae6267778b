"""float8_e4m3fnuz / float8_e5m2fnuz in CUDA packages (issue 16, class 5). Triton 3.6 has
their types (fp8e4b8 / fp8e5b16) only for AMD, so kiln stores them as bytes and converts them in
its own Triton helpers (`_kl_fnuz_f32` / `_kl_f32_fnuz` in targets/cuda/ops.py PRELUDE: bit
arithmetic, nearest-even, overflow from the halfway point past the largest finite value, +-inf
and NaN -> 0x80, no negative zero, eager's NaN payload). Checked bit for bit against torch's CPU
casts in Triton's interpreter (a child process with TRITON_INTERPRET=1): all 256 bytes, the
sweep of tests/ops/test_float8_fnuz.py and 400k more float32 values per type; whole programs
(the CPU tests' programs: math, moves, a weight, an input and an output of the type) compiled
for CUDA and run through the Python printer in the interpreter; on a GPU (`gpu`), the packages
themselves."""

from __future__ import annotations

import textwrap

import pytest
import torch

pytest.importorskip("triton")

import kiln  # noqa: E402
from difftest import Fn, run_interpreted  # noqa: E402
from kiln.errors import UnsupportedError  # noqa: E402

FNUZ = [torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
OPTS = kiln.Options(cuda_archs=(90,), autotune=False)


def _ids(v) -> str:
    return str(v).removeprefix("torch.")


_HELPERS = textwrap.dedent('''
    import importlib.util, os, sys, tempfile
    import torch
    from kiln.targets.cuda.ops import PRELUDE
    sys.path[:0] = [os.path.join(os.getcwd(), "tests"), os.path.join(os.getcwd(), "tests", "ops")]
    from test_float8_fnuz import _sweep
    KERNELS = """

    @triton.jit
    def dec_kernel(b_ptr, out_ptr, n, E5: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        b = tl.load(b_ptr + offs, mask=m, other=0)
        if E5:
            v = _kl_e5m2fnuz_f32(b)
        else:
            v = _kl_e4m3fnuz_f32(b)
        tl.store(out_ptr + offs, v, mask=m)


    @triton.jit
    def enc_kernel(x_ptr, out_ptr, n, E5: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0.0)
        if E5:
            v = _kl_f32_e5m2fnuz(x)
        else:
            v = _kl_f32_e4m3fnuz(x)
        tl.store(out_ptr + offs, v, mask=m)
    """
    path = os.path.join(tempfile.mkdtemp(), "fnuz_kernels.py")
    with open(path, "w") as f:  # Triton reads a kernel's source back from its file
        f.write(PRELUDE + KERNELS)
    spec = importlib.util.spec_from_file_location("fnuz_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    bad = []
    for dt in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):
        e5 = dt == torch.float8_e5m2fnuz
        every = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        up = torch.empty(256, dtype=torch.float32)
        mod.dec_kernel[(2,)](every, up, 256, E5=e5, BLOCK=128)
        want = every.view(dt).float()  # NaN payload included: compared as bits
        if not torch.equal(up.view(torch.int32), want.view(torch.int32)):
            k = (up.view(torch.int32) != want.view(torch.int32)).nonzero().flatten()[:5]
            bad.append(f"{dt} -> float32: bytes {k.tolist()} got {up[k].tolist()}")
        g = torch.Generator().manual_seed(int(sys.argv[1]))
        n = 200_000
        anybits = torch.randint(-2**31, 2**31 - 1, (n,), generator=g).to(torch.int32)
        near = torch.randn(n, generator=g) * torch.exp2(
            torch.randint(-24, 8, (n,), generator=g).float()) * torch.finfo(dt).max / 64
        x = torch.cat([_sweep(dt), anybits.view(torch.float32), near, want])
        got = torch.empty(x.numel(), dtype=torch.uint8)
        mod.enc_kernel[(-(-x.numel() // 1024),)](x, got, x.numel(), E5=e5, BLOCK=1024)
        ref = x.to(dt).view(torch.uint8)
        if not torch.equal(got, ref):
            k = (got != ref).nonzero().flatten()[:8]
            bad.append(f"float32 -> {dt}: {int((got != ref).sum())} of {x.numel()} differ: "
                       f"{x[k].tolist()} got {got[k].tolist()} want {ref[k].tolist()}")
        print(dt, "checked", x.numel(), "values", flush=True)
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
''')


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_fnuz_helpers_bit_exact_in_the_interpreter():
    """All 256 bytes -> float32 and ~734k float32 values -> fnuz (both types), bit for bit
    against torch's CPU casts."""
    out = run_interpreted(_HELPERS, "0", timeout=300)
    assert out.count("checked") == 2


INTERP_OPTS = kiln.Options(cuda_archs=(90,), autotune=False, fold_constants=False)


def interp_cases():
    """(dtype, module, export args, dynamic shapes, calls: argument tuples): the CPU tests'
    fnuz programs, exported here and (cubins cached) again in the interpreted child."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[2] / "ops"))
    from test_float8_fnuz import FnuzNet, fnuz_program  # noqa: E402

    out = []
    for dt in FNUZ:
        g = torch.Generator().manual_seed(0)

        def args(n, dt=dt, g=g):
            a = (torch.randn(n, 6, generator=g) * 4).to(dt)
            b = (torch.randn(6, n, generator=g) * 4).to(dt)
            return a, b.t().contiguous(), torch.randint(0, n, (5,), generator=g)

        n = torch.export.Dim("n", min=1, max=64)
        out.append((dt, Fn(fnuz_program), args(4), (({0: n}, {0: n}, None),),
                    [args(4), args(37), args(1)]))
        torch.manual_seed(0)
        x, q, s = torch.randn(3, 8), (torch.randn(4, 5) * 8).to(dt), torch.tensor(0.25)
        out.append((dt, FnuzNet(dt), (x, q, s), None, [(x, q, s)]))
    return out


_PROGRAMS = textwrap.dedent('''
    import os, sys, torch, kiln
    sys.path[:0] = [os.path.join(os.getcwd(), "tests"), os.path.join(os.getcwd(), "tests", "ops"),
                    os.path.join(os.getcwd(), "tests", "targets", "cuda")]
    from test_float8_fnuz import _bits_equal
    from test_float8_fnuz_cuda import INTERP_OPTS, interp_cases
    from kiln.targets.cuda.build import triton_kernels
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program

    checked = 0
    for dt, module, export_args, dyn, calls in interp_cases():
        b = kiln.compile(torch.export.export(module, export_args, dynamic_shapes=dyn),
                         device="cuda", options=INTERP_OPTS).built  # cubins: the parent's
        mod = import_triton_module(b.sources["kernels_triton.py"])
        hints = {s.name: s.example for s in b.graph.symbols}
        bufs = {x.name: x for x in b.loop.buffers}
        ks = {k.name: k for k in triton_kernels(b.steps, bufs, hints)}
        for call in calls:
            outs = run_program(b.program, ks, mod, b.weights, list(call))
            for k, (o, w) in enumerate(zip(outs, module(*call))):
                o = o.reshape(w.shape)
                if w.dtype == torch.float32:  # a GEMM's float32 result: rounding order
                    torch.testing.assert_close(o, w, rtol=1e-5, atol=1e-5)
                else:
                    _bits_equal(o, w, f"{dt} {type(module).__name__} output {k}")
            checked += 1
    print(checked, "calls checked")
    print("ALL OK")
''')


@pytest.mark.slow  # ~16 s in the Triton interpreter; the GPU tests run the same programs
def test_fnuz_programs_through_the_interpreter():
    """The CPU tests' fnuz programs compiled for CUDA, their Triton run in the interpreter by
    the Python printer: bit for bit as eager (math in float32 rounded once, moves, a fnuz
    weight, input and output)."""
    for _, module, args, dyn, _ in interp_cases():  # builds the cubins the child then reuses
        kiln.compile(torch.export.export(module, args, dynamic_shapes=dyn), device="cuda",
                     options=INTERP_OPTS)
    out = run_interpreted(_PROGRAMS, timeout=600)
    assert "8 calls checked" in out


@pytest.mark.parametrize("dtype", FNUZ, ids=_ids)
def test_fnuz_cuda_package_stores_bytes(dtype):
    """A CUDA compile takes fnuz inputs, values and outputs: pointers as *u8, loads decoded
    and stores encoded by kiln's helpers, the cubins built for sm_90."""
    name = _ids(dtype).replace("float8_", "")
    cm = kiln.compile(Fn(lambda x, y: ((x.float() * 2 + y).to(dtype), x[1:])),
                      ((torch.randn(4, 3) * 4).to(dtype), torch.randn(4, 3)), device="cuda",
                      options=OPTS)
    src = cm.sources["kernels_triton.py"]
    assert f"_kl_{name}_f32(tl.load(buf_" in src and f"_kl_f32_{name}(" in src
    assert "fp8e4b8" not in src and "fp8e5b16" not in src
    assert [o["dtype"] for o in cm.manifest["outputs"]] == [_ids(dtype)] * 2
    assert cm.library.exists()


def test_fnuz_other_overflow_rule_is_refused_on_cuda(monkeypatch):
    from kiln.targets import float8
    monkeypatch.setattr(float8, "fnuz_rule_matches", lambda name: False)
    with pytest.raises(UnsupportedError, match=r"converts float32 to float8_e4m3fnuz with "
                                               r"another overflow rule"):
        kiln.compile(Fn(lambda x: (x * 2).to(torch.float8_e4m3fnuz)), (torch.randn(4, 3),),
                     device="cuda", options=OPTS)


def _bits(t: torch.Tensor) -> torch.Tensor:
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(view)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", FNUZ, ids=_ids)
def test_fnuz_packages_on_the_gpu(dtype, tmp_path):
    """Whole programs on the GPU, bit for bit against eager on the CPU: every byte up to
    float32, a dense sweep down, the CPU tests' math-and-moves program at several sizes."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parents[2] / "ops"))
    from test_float8_fnuz import _sweep, fnuz_program  # noqa: E402

    def casts(v, x):
        return v.float(), x.to(dtype), v.float().to(dtype), x.double().to(dtype)

    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    wide = _sweep(dtype)
    cm = kiln.compile(Fn(casts), (every, wide), device="cuda")
    runner = kiln.load(cm.save(tmp_path / "casts.kiln"), device="cuda:0")
    for k, (g, w) in enumerate(zip(runner(every.cuda(), wide.cuda()), casts(every, wide))):
        assert torch.equal(_bits(g.cpu()), _bits(w)), k
    gen = torch.Generator().manual_seed(3)

    def args(n):
        a = (torch.randn(n, 6, generator=gen) * 4).to(dtype)
        b = (torch.randn(6, n, generator=gen) * 4).to(dtype)
        return a, b.t().contiguous(), torch.randint(0, n, (5,), generator=gen)

    n = torch.export.Dim("n", min=1, max=64)
    cm = kiln.compile(torch.export.export(Fn(fnuz_program), args(4),
                                          dynamic_shapes=(({0: n}, {0: n}, None),)), device="cuda")
    runner = kiln.load(cm.save(tmp_path / "prog.kiln"), device="cuda:0")
    for size in (4, 1, 37, 64):
        x = args(size)
        got = runner(*[t.cuda() for t in x])
        for k, (g, w) in enumerate(zip(got, fnuz_program(*x))):
            assert g.dtype == w.dtype and g.shape == w.shape, (size, k)
            assert torch.equal(_bits(g.cpu()), _bits(w)), (size, k)
