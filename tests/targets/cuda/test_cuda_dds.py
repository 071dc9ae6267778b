"""Data-dependent sizes on CUDA: nonzero, boolean-mask indexing and masked_select (kiln's own
Triton compaction since session 15: the count read as a size, then the coordinates), unique
(kiln's since session 18: a sort, nonzero's compaction) and unique over a dim with long rows
through the ATen fallback (the size u<k> bound when the call returns), `x.item()` used as a size
(read on the host, range-checked) and sizes derived from one (2*u0 + 1).

Without a GPU: each program compiles to a CUDA package (model.so built with the host compiler),
its wrapper declares the sizes before the run body, allocates data-dependent outputs at their
bounds and sets their shapes after the run, and never takes the CUDA-graph path; the Triton
kernels run in Triton's interpreter through the Python runner (kiln/targets/cuda/wrapper_py.py)
against eager, with empty (u0 = 0), partial and full masks. With a GPU (`-m gpu`): the packages
against eager on fresh inputs, bounds exceeded as clear errors, and later runs of one handle with
other sizes."""

from __future__ import annotations

import pickle
import textwrap

import pytest
import torch

import kiln
from kiln.ir import program as P
from kiln.errors import UnsupportedError
from kiln.options import Options
from tests.difftest import run_interpreted

OPTS = Options(cuda_archs=(90,))


class Nonzero(torch.nn.Module):
    def forward(self, x):
        idx = torch.nonzero(x > 0)  # [u0, 2] int64
        return idx * 2 + 1, idx.sum(0)


class MaskRows(torch.nn.Module):
    """x[mask] with a row mask, then a GEMM over the u0 selected rows and a reduction."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(6, 8))

    def forward(self, x, mask):
        r = x[mask]
        return torch.relu(r @ self.w) + 1, r.sum(0)


class MaskedSelect(torch.nn.Module):
    def forward(self, x):
        v = torch.masked_select(x, x > 0.5)
        return v * 2, (v * v).sum()


class TakeFirst(torch.nn.Module):
    """`.item()` as a size, with the range torch._check gives it."""

    def forward(self, x, n):
        k = n.item()
        torch._check(k >= 1)
        torch._check(k <= 8)
        return x[:k] * 2, torch.ones(k, 3) + x.sum()


class Derived(torch.nn.Module):
    """Output sizes derived from a data-dependent size: 2*u0 + 1, u0 + 1, 2*u0."""

    def forward(self, x, c):
        n = c.item()
        torch._check(n >= 0)
        torch._check(n <= 10)
        return torch.ones(2 * n + 1) * x.sum(), x[: n + 1] * 3, torch.cat([x[:n], x[:n] * 2])


class CountPrefix(torch.nn.Module):
    """`.item()` of a value computed on the device (an int32 count)."""

    def forward(self, x):
        k = (x > 0).sum(dtype=torch.int32).item()
        torch._check(k >= 0)
        torch._check(k <= 20)
        return x.sort().values[:k] * 2


class Unique(torch.nn.Module):
    def forward(self, x):
        u, inv, counts = torch.unique(x, return_inverse=True, return_counts=True)
        return u * 2, inv + 1, counts


class UniqueDim(torch.nn.Module):  # (aten.unique_dim with rows of 17 elements: ATen's)
    def forward(self, x):
        u, inv, counts = torch.unique(x.unsqueeze(1).expand(-1, 17), dim=0, return_inverse=True,
                                      return_counts=True)
        return u * 2, inv + 1, counts


def _signed(shape, p):
    """Values > 0 (and > 0.5) with probability p: p = 0 gives an empty selection."""
    x = torch.rand(shape) + 0.6
    return torch.where(torch.rand(shape) < p, x, -x)


def _rows(p):
    return torch.randn(12, 6), torch.rand(12) < p


# name -> (module, export args, (density or value) -> call args, call values)
CASES = {
    # rows of x dynamic too: the bound 4*s0 is an expression of an input size
    "nonzero_dyn": (Nonzero, (torch.randn(5, 4),),
                    lambda p: (_signed((int(p * 20) % 17 + 1, 4), p),), (0.0, 0.3, 1.0)),
    "nonzero": (Nonzero, (torch.randn(5, 4),), lambda p: (_signed((5, 4), p),),
                (0.0, 0.3, 1.0)),
    "mask_rows": (MaskRows, _rows(0.5), _rows, (0.0, 0.5, 1.0)),
    "mask_rows_triton": (MaskRows, _rows(0.5), _rows, (0.0, 0.5, 1.0)),
    "masked_select": (MaskedSelect, (torch.randn(4, 6),), lambda p: (_signed((4, 6), p),),
                      (0.0, 0.5, 1.0)),
    "take_first": (TakeFirst, (torch.randn(8, 3), torch.tensor(3)),
                   lambda k: (torch.randn(8, 3), torch.tensor(k)), (1, 5, 8)),
    "derived": (Derived, (torch.randn(20), torch.tensor(3)),
                lambda k: (torch.randn(20), torch.tensor(k)), (0, 3, 10)),
    "count_prefix": (CountPrefix, (torch.randn(20),), lambda p: (_signed((20,), p),),
                     (0.0, 0.5, 1.0)),
    "unique": (Unique, (torch.randint(0, 5, (12,)).float(),),
               lambda k: (torch.randint(0, k, (12,)).float(),), (1, 4, 50)),
    "unique_dim": (UniqueDim, (torch.randint(0, 5, (12,)).float(),),
                   lambda k: (torch.randint(0, k, (12,)).float(),), (1, 4, 50)),
}


# options besides OPTS: the Triton GEMM template over the u0 selected rows (a persistent grid of
# min(tiles, SMs) programs; no launch when u0 = 0)
CASE_OPTS = {"mask_rows_triton": {"gemm_backends": ("triton",)}}


def _outs(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _module(name):
    torch.manual_seed(0)
    return CASES[name][0]()


def _export(name):
    dyn = ({0: torch.export.Dim("n", min=1, max=64)},) if name.endswith("_dyn") else None
    return torch.export.export(_module(name), CASES[name][1], dynamic_shapes=dyn)


_compiled: dict = {}


def _cuda(name):
    """The CUDA package of case `name` (compiled once per session)."""
    if name not in _compiled:
        _compiled[name] = kiln.compile(_export(name), device="cuda", options=Options(
            cuda_archs=OPTS.cuda_archs, **CASE_OPTS.get(name, {})))
    return _compiled[name]


@pytest.mark.parametrize("name", sorted(CASES))
def test_cuda_package_builds_without_graphs(name):
    cm = _cuda(name)
    assert cm.library.exists()  # model_cuda.cpp built by the host compiler
    assert cm.manifest["cuda"]["graphs"] is False
    src = cm.sources["model_cuda.cpp"]
    assert "kc::run_graph(" not in src and "if (body(stream, in_ptr, out_ptr)) goto fail;" in src
    prog = cm.built.program
    assert prog.unbacked
    for sym, bound in prog.unbacked:  # declared before the body that binds it
        decl = f"int64_t {sym} = 0;  // data-dependent size, at most {bound}"
        assert decl in src and src.index(decl) < src.index("auto body = [&]")
    after = src[src.index("if (body(stream, in_ptr, out_ptr))"):]
    for out in (x for x in prog.lines if isinstance(x, P.AllocOutput)):
        if out.capacity is None:
            continue
        assert f"// output {out.index} has data-dependent sizes" in src
        for d, size in enumerate(out.shape):  # the real size, once the run is over
            if size != out.capacity[d]:
                assert f"outs[{out.index}]->dl_tensor.shape[{d}] = " in after


def test_item_is_read_on_the_host_and_range_checked():
    src = _cuda("take_first").sources["model_cuda.cpp"]
    body = src[src.index("auto body = [&]"):]
    read = body.index("cuMemcpyDtoHAsync(&v, buf_n, 8, stream)")
    sync = body.index("cuStreamSynchronize(stream)", read)
    check = body.index("if (u0 < 1 || u0 > 8) { e.fail(\"n.item() is %lld, outside [1, 8]")
    launch = body.index("kc::launch(")
    assert read < sync < check < launch
    assert "(void*)&u0" in body  # the kernel gets the bound symbol as its size
    assert _cuda("take_first").manifest["requires"]["libtorch"] is False


def test_aten_bound_is_checked_before_the_copy():
    """(nonzero was the case until session 15, unique until session 18, when they became
    kiln's own Triton kernels: unique over a dim with rows of more than 16 elements is a
    data-dependent op still through ATen on CUDA; its bound is the input's element count.)"""
    src = _cuda("unique_dim").sources["model_cuda.cpp"]
    bind = src.index("u0 = c.result_size(0, 0);")
    check = src.index("data-dependent size u0 = %lld exceeds its bound 204")
    assert bind < check < src.index("c.copy_out(0", bind)


def test_capturable_says_no_for_data_dependent_sizes():
    from kiln.targets.cuda.wrapper import capturable
    for name in ("take_first", "nonzero"):
        assert not capturable(_cuda(name).built.program)


def test_gemm_problem_on_selected_rows():
    """The GEMM autotuner ranges u0 over [0, bound] and picks at the bound (CPU builds too)."""
    from kiln.gemm import choose_gemms
    from kiln.frontend.export import import_program
    from kiln.lowering import lower
    from kiln.passes.dce import dce
    from kiln.schedule import schedule

    graph = dce(import_program(_export("mask_rows"), aten_fallback=True).graph)
    steps = schedule(lower(graph))
    for device in ("cpu", "cuda"):
        (choice,) = choose_gemms(steps, graph.symbols, OPTS, device).values()
        # 12 mask elements: u0 <= 12 (torch's own bound, 12 x 6 = 72, was the ATen
        # fallback's until x[mask] became kiln's own in session 15)
        assert "[0..12]x8x6" in choice.problem, choice


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
                if g.shape != w.shape or not torch.allclose(g.double(), w.double(),
                                                            rtol=1e-5, atol=1e-5):
                    bad.append(f"{name} at {v}: got {g}, want {w}")
        print(name, "checked", flush=True)
    print("BAD" if bad else "ALL OK", *bad, sep="\\n")
    sys.exit(1 if bad else 0)
""")


def interpret_builds(tmp_path, script: str, cases, timeout: float = 1800) -> str:
    """Runs `script` (python -c, under TRITON_INTERPRET=1, with this folder on its path as
    argv[2]) over CUDA builds: `cases` are (name, compiled model, *rest), passed to the script
    pickled (argv[1]) as (name, program, kernels, kernels_triton.py's source, weights, *rest)."""
    import pathlib

    data = [(name, cm.built.program, triton_kernels_of(cm), cm.built.sources["kernels_triton.py"],
             cm.built.weights, *rest) for name, cm, *rest in cases]
    path = tmp_path / "cases.pkl"
    path.write_bytes(pickle.dumps(data))
    return run_interpreted(script, str(path), str(pathlib.Path(__file__).parent), timeout=timeout)


def triton_kernels_of(cm) -> dict:
    """The TritonKernels of a CUDA build by name, with the configs the pipeline chose."""
    from kiln.ir.sym import UNBOUNDED_NOMINAL, evaluate, unbounded
    from kiln.targets.cuda.build import triton_kernels

    b = cm.built
    hints = {s.name: s.example for s in b.graph.symbols}
    for name, bound in b.program.unbacked:  # as the pipeline picks configs
        hints[name] = UNBOUNDED_NOMINAL if unbounded(name, bound) else evaluate(bound, hints)
    return {k.name: k for k in triton_kernels(b.steps, {x.name: x for x in b.loop.buffers},
                                              hints)}


@pytest.mark.slow  # (moved out of the default suite: it ran over 20 minutes)
def test_triton_kernels_match_eager_in_interpreter(tmp_path):
    """Each build through the Python runner (kiln/targets/cuda/wrapper_py.py) in Triton's
    interpreter, in a subprocess (the interpreter is chosen when Triton is imported; the AOT
    compiler needs the normal mode, so the builds come from here, pickled)."""
    torch.manual_seed(1)
    cases = []
    for name, (_, _, make, values) in CASES.items():
        cm, m = _cuda(name), _module(name)
        calls = [(v, args, _outs(m(*args))) for v in values for args in [make(v)]]
        cases.append((name, cm.built.program, triton_kernels_of(cm),
                      cm.built.sources["kernels_triton.py"], cm.built.weights, calls))
    data = tmp_path / "cases.pkl"
    data.write_bytes(pickle.dumps(cases))
    run_interpreted(_INTERP, str(data))


def test_triton_runner_checks_the_item_range():
    from kiln.targets.cuda.wrapper_py import _read_size

    cm = _cuda("take_first")
    (node,) = [x.node for x in cm.built.program.lines
               if isinstance(x, P.ReadSizeLine)]
    bufs = {node.src: torch.tensor([9]), node.name: torch.zeros(1, dtype=torch.int64)}
    with pytest.raises(ValueError, match=r"\.item\(\) is 9, outside \[1, 8\].*size u0"):
        _read_size(node, bufs, {})


# -- on a GPU ---------------------------------------------------------------------------------

def _on_gpu(name, tmp_path, **opts):
    cm = kiln.compile(_export(name), device="cuda",
                      options=Options(**{**CASE_OPTS.get(name, {}), **opts}))
    return kiln.load(cm.save(tmp_path / f"{name}.kiln"), device="cuda:0")


def _check(runner, m, args):
    got, want = _outs(runner(*[a.cuda() for a in args])), _outs(m(*args))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.device == torch.device("cuda", 0)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape)
        torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_matches_eager(name, tmp_path):
    """Fresh inputs, each size value twice (empty, partial, full masks; u0 = 0 launches empty
    grids), in one handle: later runs with other sizes get their own shapes."""
    try:
        runner = _on_gpu(name, tmp_path)
    except UnsupportedError as e:  # torch 2.11 exports unique's int64 results as float32
        if "records wrong metadata" not in str(e):
            raise
        pytest.skip(str(e)[:300])
    _, _, make, values = CASES[name]
    m = _module(name)
    torch.manual_seed(2)
    for v in (*values, *reversed(values)):
        _check(runner, m, make(v))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_item_out_of_range_is_a_clear_error(tmp_path):
    runner = _on_gpu("take_first", tmp_path)
    m = _module("take_first")
    for k in (9, 0):
        with pytest.raises(kiln.errors.KilnError,
                           match=rf"\.item\(\) is {k}, outside \[1, 8\], the range the export "
                                 r"assumed for size u0"):
            runner(torch.randn(8, 3, device="cuda"), torch.tensor(k, device="cuda"))
    _check(runner, m, (torch.randn(8, 3), torch.tensor(4)))  # the handle still works


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_dynamic_rows_and_caller_stream(tmp_path):
    """A Dim on the input as well (the arena is planned per input size, for the bounds), run on
    a non-default stream: the ATen call and the host read follow it."""
    runner = _on_gpu("nonzero_dyn", tmp_path)
    m = _module("nonzero_dyn")
    s = torch.cuda.Stream()
    for rows, p in ((5, 0.5), (64, 1.0), (1, 0.0), (17, 0.3), (64, 0.0), (64, 1.0)):
        x = _signed((rows, 4), p)
        with torch.cuda.stream(s):
            got = runner(x.cuda())
        s.synchronize()
        for g, w in zip(got, m(x)):
            assert g.shape == w.shape
            torch.testing.assert_close(g.cpu(), w)
