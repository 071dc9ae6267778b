"""Ops with Scalar arguments the ATen fallback cannot pass through torch's stable C interface
(issue 16, class 4): `histc(min=, max=)`, `linalg_vector_norm(ord=)`, a complex
`add / sub(..., alpha=)`. kiln rewrites them without Scalars (kiln/frontend/scalar_ops.py:
its own rewrites, else torch's decomposition) and compiles the result; checked against eager on
fresh inputs at several shapes, dtypes and argument values, values on bin edges, outside the
range, NaN and inf included."""

from __future__ import annotations

import torch

import kiln


class Fn(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


N = torch.export.Dim("n", min=2, max=4096)


def _load(tmp_path, fn, args, dynamic=None, name="m"):
    c = kiln.compile(Fn(fn), args, dynamic_shapes=(dynamic,) if dynamic else None)
    return c, kiln.load(c.save(tmp_path / f"{name}.kiln"))


def _histc_inputs(n, dt, lo, hi, g):
    x = (torch.rand(n, generator=g, dtype=torch.float64) * (hi - lo) * 1.4 + lo - 0.2 *
         (hi - lo)).to(dt)
    # values exactly on the bin edges (eager's edges: linspace in x's dtype)
    if lo != hi and n >= 10:
        edges = torch.linspace(lo, hi, 8, dtype=dt)
        x[: len(edges)] = edges
    x[-1] = float("nan")
    x[-2] = float("inf")
    return x


HISTC_CASES = [(bins, lo, hi, dt) for bins, lo, hi in [(7, -1.0, 2.0), (1, 0.0, 1.0),
                                                      (100, -3.0, 0.5), (7, 0.0, 0.0)]
               for dt in (torch.float32, torch.float64)]


def test_histc_matches_eager(tmp_path):
    """Every (bins, min, max, dtype) of HISTC_CASES in one program (each case its own input
    and dynamic size; a case's inputs drawn from its own generator in the order a program of
    its own drew them), at n = 4, 50 and 1000 (min == max: 2 fewer, no inf / nan), then
    (min == max only) all elements equal: edges widened by one."""

    def hist(bins, lo, hi):
        return lambda x: torch.histc(x, bins=bins, min=lo, max=hi)

    fns = [hist(bins, lo, hi) for bins, lo, hi, _ in HISTC_CASES]

    def fn(*xs):
        return tuple(f(x) for f, x in zip(fns, xs))

    per_case = []  # per_case[case][r]: the example, then n = 4, 50, 1000
    for bins, lo, hi, dt in HISTC_CASES:
        g = torch.Generator().manual_seed(bins)
        xs = [_histc_inputs(n, dt, lo, hi, g) for n in (50, 4, 50, 1000)]
        per_case.append([x[:-2].contiguous() if lo == hi else x for x in xs])
    runs = [list(r) for r in zip(*per_case)]  # runs[r][case]
    # all elements equal (min == max cases; the others rerun their n = 4 input)
    runs.append([torch.full((5,), 2.5, dtype=dt) if lo == hi else runs[1][k]
                 for k, (_, lo, hi, dt) in enumerate(HISTC_CASES)])
    dyn = tuple({0: torch.export.Dim(f"n{k}", min=2, max=4096)}
                for k in range(len(HISTC_CASES)))
    c, runner = _load(tmp_path, fn, tuple(runs[0]), dyn)
    assert "aten::histc" not in c.manifest["requires"]["aten_fallback_ops"]
    for r, xs in enumerate(runs[1:]):
        for case, got, want, x in zip(HISTC_CASES, runner(*xs), fn(*xs), xs):
            assert got.dtype == want.dtype and torch.equal(got, want), (case, len(x), r,
                                                                        got, want)


def test_linalg_vector_norm_matches_eager(tmp_path):
    """float32 and float64 in one program (each dtype its own input, dynamic rows and
    generator, drawn in the order a program of its own drew them), at 2, 5 and 33 rows."""
    cases = [(2, None, False), (3, 1, False), (0.5, (0, 1), True), (1, 0, True),
             (float("inf"), None, False), (float("-inf"), 1, True), (0, 1, False)]
    fns = [lambda x, o=o, d=d, k=k: torch.linalg.vector_norm(x, ord=o, dim=d, keepdim=k)
           for o, d, k in cases]

    def norms(x):
        return tuple(f(x) for f in fns) + (torch.linalg.vector_norm(x, 2.5, dtype=torch.float64),)

    def fn(*xs):
        return tuple(o for x in xs for o in norms(x))

    dts = (torch.float32, torch.float64)
    per_dt = []  # per_dt[dtype][run]: the example, then 2, 5 and 33 rows
    for dt in dts:
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(5, 7, generator=g, dtype=dt)]
        for rows in (2, 5, 33):
            x = torch.randn(rows, 7, generator=g, dtype=dt)
            x[0, 3] = 0.0
            xs.append(x)
        per_dt.append(xs)
    dyn = tuple({0: torch.export.Dim(f"n{k}", min=2, max=4096)} for k in range(len(dts)))
    _, runner = _load(tmp_path, fn, tuple(xs[0] for xs in per_dt), dyn)
    n_out = len(cases) + 1
    for r in range(1, 4):
        xs = [per_dt[k][r] for k in range(len(dts))]
        got, want, want64 = runner(*xs), fn(*xs), fn(*(x.double() for x in xs))
        assert len(got) == len(want) == n_out * len(dts)
        for j, (a, w, r64) in enumerate(zip(got, want, want64)):
            dt = dts[j // n_out]
            tol = 1e-5 if dt == torch.float32 else 1e-12
            assert a.dtype == w.dtype and a.shape == w.shape, (dt, j % n_out)
            torch.testing.assert_close(a.double(), r64.to(a.dtype).double(), rtol=tol, atol=tol,
                                       msg=lambda m: f"{dt}, output {j % n_out}: {m}")


def test_complex_add_and_sub_with_alpha(tmp_path):
    """complex64 and complex128 in one program (each dtype its own inputs, dynamic rows and
    generator, drawn in the order a program of its own drew them)."""
    def one(x, y, r):
        return (torch.add(x, y, alpha=2), torch.sub(x, y, alpha=-1.5), x + y, x - y,
                torch.add(x, r, alpha=3), torch.add(r, r, alpha=0.5))

    def fn(*args):
        return one(*args[:3]) + one(*args[3:])

    dts = (torch.complex64, torch.complex128)

    def make(n, g, dt):
        return (torch.randn(n, 4, generator=g, dtype=dt), torch.randn(4, generator=g, dtype=dt),
                torch.randn(n, 4, generator=g))

    gens = {dt: torch.Generator().manual_seed(2) for dt in dts}
    runs = [tuple(t for dt in dts for t in make(n, gens[dt], dt)) for n in (3, 2, 3, 17)]
    n0, n1 = (torch.export.Dim(f"n{k}", min=2, max=4096) for k in range(2))
    c, runner = _load(tmp_path, fn, runs[0], ({0: n0}, None, {0: n0}, {0: n1}, None, {0: n1}))
    # the real add keeps kiln's own kernel
    assert "aten::add" not in c.manifest["requires"]["aten_fallback_ops"] or any(
        o["dtype"].startswith("complex") for o in c.manifest["outputs"])
    for args in runs[1:]:
        for j, (a, w) in enumerate(zip(runner(*args), fn(*args))):
            assert a.dtype == w.dtype and a.shape == w.shape, j
            tol = 1e-12 if w.dtype == torch.complex128 else 1e-6
            torch.testing.assert_close(a, w, rtol=tol, atol=tol,
                                       msg=lambda m: f"{w.dtype}, output {j % 6}: {m}")


def test_scalar_rewrites_are_general(tmp_path):
    """Other Scalar-carrying ops reach the rewrite through torch's decompositions when the
    fallback gets them (complex values here)."""
    def fn(x):
        return torch.sub(x, x * 0.5, alpha=2), torch.linalg.vector_norm(x, ord=3)

    x = torch.randn(6, dtype=torch.complex64)
    _, runner = _load(tmp_path, fn, (x,))
    x = torch.randn(6, dtype=torch.complex64)
    for a, w in zip(runner(x), fn(x)):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-5)


def test_scalar_overloads_become_tensor_overloads(tmp_path):
    """An op taking a number where a sibling overload takes a tensor (special_zeta's
    other_scalar / self_scalar) calls the tensor overload with a 0-d tensor."""
    def fn(x):
        return torch.special.zeta(x, 2.0), torch.special.zeta(3.0, x)

    x = torch.rand(5) + 1
    c, runner = _load(tmp_path, fn, (x,), ({0: N},))
    assert "aten::special_zeta.default" in c.manifest["requires"]["aten_fallback_ops"]
    for n in (2, 9):
        x = torch.rand(n) + 1
        for a, w in zip(runner(x), fn(x)):
            assert a.dtype == w.dtype
            torch.testing.assert_close(a, w, rtol=1e-6, atol=1e-6)
