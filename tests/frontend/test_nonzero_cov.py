"""nonzero in kiln's own code on the CPU (issue 16: it went to the ATen fallback, real and
complex): the element count of x != 0 (complex: either part nonzero; NaN counts) bound at run
time as the result's data-dependent row count, then kiln_lib.h's `nonzero` writes the
coordinates in row-major order. Results used by later kiln ops; strided (transposed, step-2)
inputs; 0-d, empty and all-zero inputs; dynamic input shapes. Compared with eager exactly;
the package calls no ATen op. CUDA programs run kiln's Triton nonzero since session 15."""

from __future__ import annotations

import math

import pytest
import torch
from torch.export import Dim

from difftest import Checker, Fn, gen

import kiln


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> Checker:
    return Checker(tmp_path_factory.mktemp("nonzero"))


def _nonzeros(x, i, m, c, z):
    nz = torch.nonzero(x)
    return {"x": nz, "x_used": nz.sum(1) * 2 + 1, "i_t": torch.nonzero(i.t()),
            "i_step": torch.nonzero(i[:, ::2]), "m": torch.nonzero(m), "c": torch.nonzero(c),
            "z": torch.nonzero(z), "x_tuple": torch.stack(torch.nonzero(x, as_tuple=True))}


def _inputs(seed: int, zero_all: bool = False, cdt=torch.complex64, shape=(3, 4, 5)):
    g = gen("nonzero", seed)
    x = torch.randn(*shape, generator=g)
    x[x < 0.4] = 0
    x.view(-1)[0] = math.nan
    x.view(-1)[1] = -0.0
    if zero_all:
        x.zero_()
    i = torch.randint(0, 3, (6, 4), generator=g)
    m = torch.rand(5, 2, 3, generator=g) < 0.3
    re, im = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    re[re > 0.5] = 0
    im[im > 0.0] = 0
    c = torch.complex(re, im).to(cdt)  # zeros in one part, the other, both
    c[0, 0] = complex(math.nan, 0)
    z = torch.tensor(seed % 2 == 0)
    return x, i, m, c, z


def _check(got, want):
    for k in want:
        assert got[k].dtype == want[k].dtype == torch.int64, k
        assert torch.equal(got[k], want[k]), (k, got[k].shape, want[k].shape)


@pytest.mark.parametrize("cdt", (torch.complex64, torch.complex128), ids=("c64", "c128"))
def test_nonzero_native(check, cdt):
    compiled, runner = check.compile(Fn(_nonzeros), _inputs(0, cdt=cdt))
    assert not any("nonzero" in op for op in compiled.manifest["requires"]["aten_fallback_ops"])
    for seed, zero_all in ((0, False), (1, False), (2, True)):
        args = _inputs(seed, zero_all, cdt)
        _check(runner(*args), _nonzeros(*args))


def test_nonzero_dynamic_shapes(check):
    def f(x):
        return {"nz": torch.nonzero(x), "half": torch.nonzero(x.to(torch.float16))}
    x = _inputs(0)[0]
    dims = ({0: Dim("a", min=1, max=16), 2: Dim("b", min=2, max=32)},)
    _, runner = check.compile(Fn(f), (x,), dynamic_shapes=dims)
    for shape in ((3, 4, 5), (1, 4, 2), (7, 4, 9)):
        x = _inputs(1, shape=shape)[0]
        _check(runner(x), f(x))


def test_nonzero_cuda_is_kiln_own_unique_dim_stays_on_aten():
    """A CUDA program lowers nonzero itself since session 15 (a Triton compaction:
    targets/cuda/scan.py, tests/targets/cuda/test_cuda_scan_cov.py), with or without the
    fallback; a data-dependent op kiln has no kernel for (unique over a dim with rows of more
    than 16 elements) still goes to ATen there,
    and without the fallback is refused naming it."""
    from kiln.frontend.export import import_program

    ep = torch.export.export(Fn(torch.nonzero), (torch.randn(3, 4),))
    for fallback in (True, False):
        ops = [n.op for n in import_program(ep, aten_fallback=fallback,
                                            library_routines=False).graph.nodes]
        assert "nonzero" in ops and "aten" not in ops, ops
    cpu = [n.op for n in import_program(ep, aten_fallback=True).graph.nodes]
    assert "nonzero" in cpu and "aten" not in cpu, cpu
    ep = torch.export.export(Fn(lambda x: torch.unique(x.unsqueeze(1).expand(-1, 17), dim=0) * 2),
                             (torch.randn(7),))
    ops = [n.op for n in import_program(ep, aten_fallback=True, library_routines=False)
           .graph.nodes]
    assert "aten" in ops, ops
    with pytest.raises(kiln.errors.UnsupportedError, match="unique"):
        import_program(ep, aten_fallback=False, library_routines=False)
