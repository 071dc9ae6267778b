"""Data-dependent sizes without an upper bound on CUDA (issue 16 class 3): `x.item()` used as
a size with only a lower bound, and ATen results whose length depends on data
(`repeat_interleave` with a repeats tensor). The buffers such a size sizes are allocated on the
device during the run once it is known (`kc::DeviceHeap`: stream-ordered
cuMemAllocFromPoolAsync / cuMemFreeAsync from the instance's pool, freed at their last use or
when the run returns), outputs at their exact shape once known; such a run reads the size on
the host mid-run, so it never replays as a CUDA graph (manifest `cuda.graphs` false, the reason
in `cuda.graphs_off`), and a run on a stream that is capturing fails with a clear error.

Without a GPU: each program compiles to a CUDA package (model_cuda.cpp built by the host
compiler), the wrapper's allocation order is checked, and the Triton kernels run in Triton's
interpreter through the Python runner against eager at 0, at the example size and far above
it. With a GPU (`-m gpu`): the packages against eager on fresh inputs at those sizes in one
handle, on a side stream, no device memory growth over repeated runs, and a clear error under
CUDA-graph capture."""

from __future__ import annotations

import pickle
import textwrap

import pytest
import torch

import kiln
from kiln.ir import program as P
from kiln.options import Options
from tests.difftest import Fn, run_interpreted

OPTS = Options(cuda_archs=(90,))


def item_rows(x, n):
    k = n.item()
    torch._check(k >= 0)  # a lower bound only
    y = torch.ones(k, 3) * x.sum()
    return y, torch.arange(k) * 2, torch.cat([y, y + 1]).sum(0), (y * 2).relu().sum()


def item_gemm(x, n, w):
    """A GEMM over k rows (k unbounded): its operand and result allocated mid-run."""
    k = n.item()
    torch._check(k >= 0)
    a = torch.arange(k * 8, dtype=torch.float32).reshape(k, 8).sin() + x
    return torch.relu(a @ w) * 2, (a @ w).sum(0)


def interleave(x, r):
    # the ATen call's own result (u0 elements) is allocated inside the call, once it returned
    y = torch.repeat_interleave(x, r)
    z = torch.repeat_interleave(r, r).float()
    return y * 2, z.mean(), y.cumsum(0), (z[:, None] * x).sum(0)


# name -> (function, export args, value -> call args, values)
CASES = {
    "item_rows": (item_rows, (torch.randn(4), torch.tensor(3)),
                  lambda k: (torch.randn(4), torch.tensor(k)), (0, 3, 1000)),
    "item_gemm": (item_gemm, (torch.randn(8), torch.tensor(5), torch.randn(8, 6)),
                  lambda k: (torch.randn(8), torch.tensor(k), torch.randn(8, 6)), (0, 5, 700)),
    "item_gemm_triton": (item_gemm, (torch.randn(8), torch.tensor(5), torch.randn(8, 6)),
                         lambda k: (torch.randn(8), torch.tensor(k), torch.randn(8, 6)),
                         (0, 5, 700)),
    "interleave": (interleave, (torch.randn(4), torch.tensor([1, 2, 0, 3])),
                   lambda r: (torch.randn(4), torch.tensor(r)),
                   ([0, 0, 0, 0], [1, 2, 0, 3], [40, 7, 100, 3])),
}
CASE_OPTS = {"item_gemm_triton": {"gemm_backends": ("triton",)}}

_compiled: dict = {}


def _export(name):
    fn, args = CASES[name][0], CASES[name][1]
    return torch.export.export(Fn(fn), args)


def _cuda(name):
    if name not in _compiled:
        _compiled[name] = kiln.compile(_export(name), device="cuda", options=Options(
            cuda_archs=OPTS.cuda_archs, **CASE_OPTS.get(name, {})))
    return _compiled[name]


def _outs(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


@pytest.mark.parametrize("name", sorted(CASES))
def test_package_allocates_at_run_time_without_graphs(name):
    cm = _cuda(name)
    assert cm.library.exists()  # model_cuda.cpp built by the host compiler
    info = cm.manifest["cuda"]
    assert info["graphs"] is False
    assert "without an upper bound" in info["graphs_off"] or "ATen" in info["graphs_off"]
    src = cm.sources["model_cuda.cpp"]
    assert "kc::run_graph(" not in src
    assert "int64_t u0 = 0;  // data-dependent size, no upper bound" in src
    # a run on a capturing stream is refused before anything runs
    assert src.index("kc::refuse_capture(e, stream,") < src.index("kc::check_tensor(")
    heap = [a for x in P.walk(cm.built.program.lines)
            for a in ((x,) if isinstance(x, P.Alloc) else getattr(x, "allocs", ()))
            if isinstance(a, P.Alloc) and a.heap]
    assert heap or name == "item_rows"  # item_rows: every buffer fused, only outputs late
    if not heap:
        return
    decl = src.index("kc::DeviceHeap heap(self->pool, stream);")
    for a in heap:  # allocated after the size is known, on the run's stream, and released
        at = src.index(f"buf_{a.buf} = heap.alloc(e, \"{a.buf}\", ")
        assert decl < at
        bind = src.index("u0 = ")
        assert bind < at
    released = [a.buf for a in heap if f"heap.release(buf_{a.buf}, stream);" in src]
    assert released or len(heap) == 1  # a buffer live to the end is released by the heap


def test_outputs_of_unknown_shape_are_allocated_once_known():
    src = _cuda("item_rows").sources["model_cuda.cpp"]
    read = src.index("u0 = static_cast<int64_t>(v);")
    alloc = src.index("// output 0: shape [u0, 3] known only now (no upper bound)")
    assert read < alloc < src.index("outs[0] = kc::new_output(e, self->pool, self->ctx, stream")
    assert "if (u0 < 0) { e.fail(\"args_1.item() is %lld, below 0" in src


_INTERP = textwrap.dedent("""
    import pickle, sys, torch
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    bad = []
    with open(sys.argv[1], "rb") as f:
        cases = pickle.load(f)
    for name, prog, kernels, module, weights, calls in cases:
        mod = import_triton_module(module)
        for v, args, want in calls:
            got = run_program(prog, kernels, mod, weights, list(args))
            for g, w in zip(got, want):
                if not isinstance(w, torch.Tensor):
                    g = g.item()
                    ok = abs(g - w) <= 1e-4 * (1 + abs(w))
                else:
                    big = float(w.abs().nan_to_num().max()) if w.numel() else 0.0
                    ok = g.shape == w.shape and torch.allclose(
                        g.double(), w.double(), rtol=1e-4, atol=1e-4 * (1 + big),
                        equal_nan=True)
                if not ok:
                    bad.append(f"{name} at {v}: got {g}, want {w}")
        print(name, "checked", flush=True)
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
    sys.exit(1 if bad else 0)
""")


def test_triton_kernels_match_eager_in_interpreter(tmp_path):
    """Each build through the Python runner in Triton's interpreter (a subprocess), at sizes
    0, the example and far above it (no bound was planned for)."""
    from test_cuda_dds import triton_kernels_of

    torch.manual_seed(1)
    cases = []
    for name, (fn, _, make, values) in CASES.items():
        cm = _cuda(name)
        calls = [(v, args, _outs(fn(*args))) for v in values for args in [make(v)]]
        cases.append((name, cm.built.program, triton_kernels_of(cm),
                      cm.built.sources["kernels_triton.py"], cm.built.weights, calls))
    data = tmp_path / "cases.pkl"
    data.write_bytes(pickle.dumps(cases))
    run_interpreted(_INTERP, str(data))


# -- on a GPU ---------------------------------------------------------------------------------

def _on_gpu(name, tmp_path):
    cm = kiln.compile(_export(name), device="cuda", options=Options(**CASE_OPTS.get(name, {})))
    return kiln.load(cm.save(tmp_path / f"{name}.kiln"), device="cuda:0")


def _check(runner, fn, args):
    got, want = _outs(runner(*[a.cuda() for a in args])), _outs(fn(*args))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if not isinstance(w, torch.Tensor):
            assert g == pytest.approx(w, rel=1e-4, abs=1e-4)
            continue
        assert g.device == torch.device("cuda", 0)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape)
        big = float(w.abs().nan_to_num().max()) if w.numel() else 0.0
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4 * (1 + big), equal_nan=True)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_matches_eager(name, tmp_path):
    """Each size value twice, in one handle (0, the example, far above it, and back)."""
    runner = _on_gpu(name, tmp_path)
    fn, _, make, values = CASES[name]
    torch.manual_seed(2)
    for v in (*values, *reversed(values)):
        _check(runner, fn, make(v))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_side_stream_and_no_memory_growth(tmp_path):
    """On a non-default stream; 200 runs with large sizes leave device memory where it was
    after the first few (stream-ordered frees return the buffers to the pool)."""
    runner = _on_gpu("item_gemm", tmp_path)
    s = torch.cuda.Stream()
    w = torch.randn(8, 6)
    with torch.cuda.stream(s):
        for k in (3, 50_000, 0):
            x = torch.randn(8)
            got = runner(x.cuda(), torch.tensor(k).cuda(), w.cuda())
            s.synchronize()
            for g, r in zip(got, item_gemm(x, torch.tensor(k), w)):
                big = float(r.abs().max()) if r.numel() else 0.0
                torch.testing.assert_close(g.cpu(), r, rtol=1e-4, atol=1e-3 * (1 + big))
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        for i in range(200):
            runner(torch.randn(8).cuda(), torch.tensor(50_000 - i).cuda(), w.cuda())
        s.synchronize()
    free1 = torch.cuda.mem_get_info()[0]
    assert free0 - free1 < 64 << 20, (free0, free1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_capture_is_refused_clearly(tmp_path):
    runner = _on_gpu("item_rows", tmp_path)
    x, n = torch.randn(4).cuda(), torch.tensor(3).cuda()
    runner(x, n)  # warm
    g = torch.cuda.CUDAGraph()
    with pytest.raises(kiln.errors.KilnError, match=r"capturing a CUDA graph.*data-dependent "
                       r"sizes u0"):
        with torch.cuda.graph(g):
            runner(x, n)
    _check(runner, item_rows, (torch.randn(4), torch.tensor(7)))  # the handle still works
