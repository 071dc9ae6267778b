"""Prepacked constant B operands on the CPU (passes/pack_cpu.py, kr::gemm_cpp_packed): Linear
layers (B read transposed), `x @ W` (B read as stored), frozen weights and batched matmuls
with a constant B, against eager (float64 references) at M from 1 to 200 with N and K that
are no multiple of the panel width; the generated source calls the packed entry point;
update_weights packs new weights; builds for x86-64-v3 (AVX2, no AVX-512) and x86-64 (no AVX)
are correct too."""

from __future__ import annotations

import copy

import pytest
import torch

import kiln
from kiln.gemm import cpu
from kiln.ir.packing import pack_panels
from tests.difftest import Cases, Checker, rand

M_SIZES = (1, 2, 7, 16, 64, 200)  # 7: the example size the package is compiled at


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    return Checker(tmp_path_factory.mktemp("prepacked"))


class Layers(torch.nn.Module):
    """Every way a constant B reaches a GEMM: Linear with and without bias (B = W.t()),
    x @ W (B = W), a batched matmul with one W for the batch."""

    def __init__(self, k=1023, dtype=torch.float32):
        super().__init__()
        self.fc = torch.nn.Linear(k, 1000, dtype=dtype)
        self.narrow = torch.nn.Linear(k, 33, bias=False, dtype=dtype)
        self.w = torch.nn.Parameter(torch.randn(k, 70, dtype=dtype) / k ** 0.5)
        self.wb = torch.nn.Parameter(torch.randn(40, 65, dtype=dtype) / 40 ** 0.5)

    def forward(self, x, xb):
        return self.fc(x), self.narrow(x), x @ self.w, torch.matmul(xb, self.wb)


def _inputs(m, dtype, k=1023):
    return (rand((m, k), dtype), rand((3, m, 40), dtype))


def _dyn():
    m = torch.export.Dim("m", min=1, max=256)
    return ({0: m}, {1: m})


def _packed_gemms(compiled) -> list[str]:
    return [name for name, c in compiled.built.gemms.items()
            if getattr(c.config, "packed", False)]


def _cases_dyn(n: int, per_case: tuple) -> tuple:
    """dynamic_shapes of a Cases program of `n` cases with the same per-case specs (one
    tuple for forward(*args), the cases' inputs in order)."""
    return (per_case * n,)


def test_constant_b_packed_vs_eager(check):
    """float32 and float64 `Layers` in one program (difftest.Cases: one package; each case its
    own weights and kernels, outputs named "<dtype>__<k>"; the same M for both at each run)."""
    cases = {}
    for dtype in (torch.float32, torch.float64):
        torch.manual_seed(0)  # each dtype's model and inputs as when compiled alone
        cases[str(dtype).removeprefix("torch.")] = (Layers(dtype=dtype), dtype)
    model = Cases({k: (m, 2) for k, (m, _) in cases.items()})
    opts = kiln.Options(gemm_backends=("cpp",))  # every constant B packed, also N = 33

    def inputs(m):
        return tuple(t for _, dtype in cases.values() for t in _inputs(m, dtype))

    compiled = check(model, inputs(7), dynamic_shapes=_cases_dyn(len(cases), _dyn()),
                     options=opts, more=[inputs(m) for m in M_SIZES if m != 7])
    assert len(_packed_gemms(compiled)) == 4 * len(cases), compiled.built.gemms
    src = compiled.built.sources["gemm.cpp"]
    assert src.count("kr::gemm_cpp_packed<") == 4 * len(cases), src
    model_cpp = compiled.built.sources["model.cpp"]
    assert "prepacked" in model_cpp
    shapes = {w["fqn"]: w for w in compiled.manifest["weights"]}
    for name in cases:
        nr = cpu.packed_nr(name, "native")
        fc = shapes[f"mods.{name}.fc.weight"]
        assert fc["shape"] == [-(-1000 // nr), 1023, nr], (name, fc)
        assert fc["packed"]["shape"] == [1000, 1023], (name, fc)
        assert "packed" not in shapes[f"mods.{name}.fc.bias"], name


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_frozen_weights_pack_alike(check):
    torch.manual_seed(1)
    model = Layers()
    opts = kiln.Options(freeze=True, gemm_backends=("cpp",))
    compiled = check(model, _inputs(7, torch.float32), dynamic_shapes=_dyn(), options=opts,
                     more=[_inputs(1, torch.float32), _inputs(64, torch.float32)])
    assert len(_packed_gemms(compiled)) == 4


def test_default_heuristic_packs_wide_weights(check):
    """Without options the packed kernel takes the wide Linear (N = 1000); the narrow one
    (N = 33, one panel and a bit) stays with BLAS."""
    torch.manual_seed(2)
    model = Layers()
    compiled = check(model, _inputs(7, torch.float32), dynamic_shapes=_dyn(),
                     more=[_inputs(1, torch.float32), _inputs(200, torch.float32)])
    choices = {c.problem.split(" ")[1]: c for c in compiled.built.gemms.values()}
    assert [c.config.packed for p, c in choices.items() if "x1000x" in p] == [True]
    assert all(not getattr(c.config, "packed", False) for p, c in choices.items()
               if "x33x" in p)


def test_weight_read_twice_is_not_packed(check):
    """A weight another step reads too (here: added to the output) ships as it is."""
    torch.manual_seed(3)

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(96, 96) / 10)

        def forward(self, x):
            return x @ self.w + self.w.sum(0)

    compiled = check(Tied(), (rand((5, 96)),),
                     options=kiln.Options(gemm_backends=("cpp",), fold_constants=False))
    assert _packed_gemms(compiled) == []


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_update_weights_packs_new_weights(check, tmp_path):
    torch.manual_seed(4)
    model = Layers(k=130).eval()
    opts = kiln.Options(gemm_backends=("cpp",))
    compiled, runner = check.compile(model, _inputs(9, torch.float32, 130), options=opts)
    assert len(_packed_gemms(compiled)) == 4
    fresh = Layers(k=130).eval()
    runner.update_weights(fresh.state_dict())
    x = _inputs(9, torch.float32, 130)
    with torch.no_grad():
        want = copy.deepcopy(fresh).double()(*(t.double() for t in x))
    for got, w in zip(runner(*x), want):
        torch.testing.assert_close(got.double(), w, rtol=1e-4, atol=1e-4)
    bad = {**fresh.state_dict(), "fc.weight": torch.randn(1000, 129)}
    with pytest.raises(kiln.errors.InputError, match=r"expected shape \[1000, 130\]"):
        runner.update_weights(bad)


def test_pack_panels_layout():
    """The layout itself: panel p, row k, column c holds B[k, p * nr + c], zero past N."""
    w = torch.arange(5 * 7, dtype=torch.float32).reshape(5, 7)  # a Linear weight [N=5, K=7]
    rec = {"nr": 4, "k": 7, "n": 5, "offset": 0, "rows": 1, "cols": 7, "shape": [5, 7]}
    p = pack_panels(w, rec)
    assert p.shape == (2, 7, 4)
    b = w.t()
    torch.testing.assert_close(p[0], b[:, :4])
    torch.testing.assert_close(p[1, :, 0], b[:, 4])
    assert (p[1, :, 1:] == 0).all()


def test_pack_panels_of_a_view_reads_the_view():
    """A weight that is a view into a larger tensor (a tensor-parallel row shard,
    w.chunk(n, 0)[r], contiguous with a storage offset) packs its own elements, not those at
    the start of the storage (test_tp.py's 2-rank Llama got rank 0's gate/up weights)."""
    torch.manual_seed(6)
    full = torch.randn(2 * 40, 24)
    rec = {"nr": 16, "k": 24, "n": 40, "offset": 0, "rows": 1, "cols": 24, "shape": [40, 24]}
    for r in range(2):
        view = full.chunk(2, 0)[r]
        assert view.is_contiguous() and view.storage_offset() == r * 40 * 24
        torch.testing.assert_close(pack_panels(view, rec), pack_panels(view.clone(), rec),
                                   rtol=0, atol=0)
    # a nonzero record offset counts from the view's first element too
    rec1 = {**rec, "n": 39, "offset": 24}
    torch.testing.assert_close(pack_panels(full[40:], rec1), pack_panels(full[41:].clone(),
                                                                          {**rec1, "offset": 0}),
                               rtol=0, atol=0)


def test_update_weights_packs_views(check, tmp_path):
    """New weights given as views into larger tensors (shards) are packed from their own
    elements."""
    torch.manual_seed(7)
    model = Layers(k=130).eval()
    compiled, runner = check.compile(model, _inputs(9, torch.float32, 130),
                                     options=kiln.Options(gemm_backends=("cpp",)))
    assert _packed_gemms(compiled)
    fresh = Layers(k=130).eval()
    state = {}
    for name, t in fresh.state_dict().items():  # each tensor the second half of a bigger one
        big = torch.cat([torch.randn_like(t), t], 0)
        state[name] = big[t.shape[0]:] if t.dim() else t
        assert state[name].dim() == 0 or state[name].storage_offset() > 0
    runner.update_weights(state)
    x = _inputs(9, torch.float32, 130)
    with torch.no_grad():
        want = copy.deepcopy(fresh).double()(*(t.double() for t in x))
    for got, w in zip(runner(*x), want):
        torch.testing.assert_close(got.double(), w, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64"])
def test_other_targets(check, march):
    """AVX2 (16 vector registers) and SSE2 (no AVX, narrower vectors than the panels)."""
    torch.manual_seed(5)
    model = Layers()
    opts = kiln.Options(march=march, gemm_backends=("cpp",))
    compiled = check(model, _inputs(7, torch.float32), dynamic_shapes=_dyn(), options=opts,
                     more=[_inputs(m, torch.float32) for m in (1, 2, 16, 200)])
    assert len(_packed_gemms(compiled)) == 4


@pytest.mark.slow
def test_max_autotune_times_packed_candidates(check, tmp_path):
    """Profiling a constant-B GEMM times the packed candidates (B packed once, shared by the
    batch, as in the package) beside BLAS and the unpacked tiles; the winner is correct."""
    torch.manual_seed(6)
    model = torch.nn.Linear(300, 200)
    opts = kiln.Options(max_autotune=True, cache_dir=str(tmp_path))
    compiled = check(model, (rand((4, 300)),), options=opts)
    (choice,) = compiled.built.gemms.values()
    assert choice.how == "profiled" and "const_b" in choice.problem
    assert any(n.startswith("cpp_packed_") for n, _ in choice.timings["cpp"]), choice.timings


class ReadA(torch.nn.Module):
    """A packed GEMM's A in the layouts kr::packed_row_block meets: a compact input (row
    stride K), the left half of a computed [M, 2K] buffer (row stride 2K, a view at offset 0)
    and its right half (an offset view), and a transposed computed buffer (k strided)."""

    def __init__(self, k, dtype):
        super().__init__()
        self.fcs = torch.nn.ModuleList(torch.nn.Linear(k, 96, dtype=dtype) for _ in range(4))
        self.k = k

    def forward(self, x):
        wide = torch.cat([x, 2 * x], dim=1)  # [M, 2K], computed
        xt = (x + 1).t().contiguous().t()  # [M, K] with strides (1, M)
        a, b, c, d = self.fcs
        return a(x), b(wide[:, :self.k]), c(wide[:, self.k:]), d(xt)


# the default suite: one K whose float rows share L1 sets (512) and one whose double rows do
# not (384), in one program (test_packed_a_read_in_place_or_packed_default); the other eight
# cases (about 1 min each on 2 cores) with -m slow
PACKED_A_DEFAULT = [(512, torch.float32), (384, torch.float64)]


def _check_packed_a(check, cases):
    """`ReadA` at each (K, dtype) of `cases` in one program (one case: the module itself),
    each case's model and inputs as when compiled alone (seeded by K); dynamic M."""
    models, xs = {}, {}
    for k, dtype in cases:
        torch.manual_seed(k)
        xs[k, dtype] = rand((37, k), dtype)
        models[f"{k}_{str(dtype).removeprefix('torch.')}"] = (ReadA(k, dtype), 1)
    m = torch.export.Dim("m", min=1, max=256)
    if len(cases) == 1:
        model, dyn = next(iter(models.values()))[0], ({0: m},)
    else:
        model, dyn = Cases(models), _cases_dyn(len(cases), ({0: m},))

    def more(rows):
        return tuple(rand((rows, k), dtype) for k, dtype in cases)

    opts = kiln.Options(gemm_backends=("cpp",))
    compiled = check(model, tuple(xs.values()), dynamic_shapes=dyn, options=opts,
                     more=[more(rows) for rows in (12, 24, 200, 1)])
    assert len(_packed_gemms(compiled)) == 4 * len(cases), compiled.built.gemms


def test_packed_a_read_in_place_or_packed_default(check):
    """Full row tiles read A in place unless its rows share L1 sets (row strides of 2 KiB or a
    multiple of 4 KiB: K = 512, 1024 floats, 256, 512, 768, 1024 doubles, and every 2K view
    of those), else packed; row counts with and without a partial last tile (M = 12, 24: none
    at MR 12; 37, 200: one), at dynamic M: K = 512 float32 and 384 float64 in one program."""
    _check_packed_a(check, PACKED_A_DEFAULT)


@pytest.mark.slow
@pytest.mark.parametrize("k,dtype", [
    pytest.param(k, d, id=f"{k}-{str(d).removeprefix('torch.')}")
    for d in (torch.float32, torch.float64) for k in (256, 384, 512, 768, 1024)
    if (k, d) not in PACKED_A_DEFAULT])
def test_packed_a_read_in_place_or_packed(check, dtype, k):
    """The same at the other (K, dtype) pairs, one program each."""
    _check_packed_a(check, [(k, dtype)])


@pytest.mark.parametrize("k", [pytest.param(256, marks=pytest.mark.slow),
                               pytest.param(1024, marks=pytest.mark.slow)])
def test_packed_a_direct_single_thread_and_split(check, k):
    """The same at 1 and 2 threads (the split by row blocks hands each thread whole tiles)."""
    torch.manual_seed(k + 1)
    for threads in (1, 2):
        x = rand((200, k), torch.float32)
        check(ReadA(k, torch.float32), (x,), options=kiln.Options(gemm_backends=("cpp",),
                                                                     num_threads=threads))
