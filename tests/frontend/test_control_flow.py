"""torch.cond and while_loop compile to real branches and loops (C++ artifact and Python
printer), checked through kiln.load against eager on fresh inputs."""

from __future__ import annotations

import dataclasses
import resource

import numpy as np
import pytest
import sympy
import torch
from torch._higher_order_ops.while_loop import while_loop

import kiln
import kiln.backend
from kiln.errors import KilnError
from kiln.ir import dtypes
from kiln.ir import program as P
from kiln.memory.assign import intervals
from tests.difftest import Checker, compare, dim, rand


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    return Checker(tmp_path_factory.mktemp("control_flow"))


class CondWeights(torch.nn.Module):
    """Data-dependent predicate; both branches close over a parameter and a buffer and return
    two outputs."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        self.register_buffer("b", torch.randn(4))

    def forward(self, x):
        def then(x):
            return (x * self.w + self.b).sin(), x.cos().sum(0)

        def orelse(x):
            return x - self.b, (x * 2).amax(0)

        return torch.cond(x.sum() > 0, then, orelse, (x,))


def test_cond_both_branches_weights_multiple_outputs(check):
    x = rand((3, 4), g=torch.Generator().manual_seed(1))
    compiled = check(CondWeights(), (x.abs(),),
                     more=[(-x.abs(),), (rand((3, 4)).abs() + 1,), (-rand((3, 4)).abs() - 1,)])
    src = compiled.sources["model.cpp"]
    assert "if (flag_cond) {" in src and "} else {" in src
    # each branch has its own kernels: fusion does not cross the branch boundary
    assert "cond_then_k0" in src and "cond_else_k0" in src


def test_cond_pred_from_shape_dynamic(check):
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.cond(x.shape[0] > 4, lambda x: x.sin() * 2, lambda x: x.cos() + 1,
                              (x,))

    compiled = check(M(), (rand((6, 5)),), more=[(rand((3, 5)),), (rand((5, 5)),),
                                                 (rand((4, 5)),)],
                     dynamic_shapes=[{0: dim("n", 2, 32)}])
    assert "const bool flag_cond = (s0 > 4);" in compiled.sources["model.cpp"]


def test_cond_constant_predicate(check):
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.cond(False, lambda x: x.sin(), lambda x: x.cos(), (x,))

    check(M(), (rand((3, 4)),), more=[(rand((3, 4)) * 3,)])


def test_nested_cond_in_cond_with_closure(check):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, y):
            def inner_t(x, y):
                return self.lin(x) + y, x * y

            def inner_f(x, y):
                return x - y, self.lin(y).relu()

            def outer_t(x, y):
                return torch.cond(y.mean() > 0, inner_t, inner_f, (x, y))

            def outer_f(x, y):
                return x.exp(), y.tanh()

            return torch.cond(x.max() > 0.5, outer_t, outer_f, (x, y))

    g = torch.Generator().manual_seed(3)
    cases = [(torch.rand(5, 4, generator=g) + 1, torch.rand(5, 4, generator=g)),  # t, t
             (torch.rand(5, 4, generator=g) + 1, -torch.rand(5, 4, generator=g)),  # t, f
             (torch.rand(5, 4, generator=g) * 0.4, torch.randn(5, 4, generator=g))]  # f
    check(M(), cases[0], more=cases[1:] + cases[:1])


class Counter(torch.nn.Module):
    """while i < n: y = y * w + 1 (a counter loop over a weight)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(4) * 0.5)

    def forward(self, x, n):
        def cond_fn(i, y):
            return i < n.sum()

        def body_fn(i, y):
            return i + 1, y * self.w + 1

        return while_loop(cond_fn, body_fn, (torch.zeros((), dtype=torch.int64), x))


def test_while_counter_and_zero_iterations(check):
    x = rand((3, 4))
    compiled = check(Counter(), (x, torch.tensor([3])),
                     more=[(rand((3, 4)) * 2, torch.tensor([0])),  # zero iterations
                           (rand((3, 4)), torch.tensor([7])), (x, torch.tensor([-2]))])
    src = compiled.sources["model.cpp"]
    assert "while (true) {" in src and "if (!flag_while_loop) break;" in src


def test_while_data_dependent_stop(check):
    class M(torch.nn.Module):
        def forward(self, x):
            def cond_fn(y, steps):
                return y.abs().sum() > 1.0

            def body_fn(y, steps):
                return y * 0.5 - 0.01, steps + 1

            return while_loop(cond_fn, body_fn, (x, torch.zeros((), dtype=torch.int32)))

    check(M(), (rand((4, 8)),), more=[(rand((4, 8)) * 100,), (rand((4, 8)) * 1e-3,)])


def test_cond_inside_while(check):
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("shift", torch.linspace(-1, 1, 6))

        def forward(self, x, limit):
            def cond_fn(i, y):
                return i < limit.sum()

            def body_fn(i, y):
                z = torch.cond(y.sum() > 0, lambda y, s: y * 0.5 - s, lambda y, s: y + s + 1,
                               (y, self.shift))
                return i + 1, z

            return while_loop(cond_fn, body_fn, (torch.zeros((), dtype=torch.int64), x))

    check(M(), (rand((2, 6)), torch.tensor([5])),
          more=[(rand((2, 6)) * 10, torch.tensor([9])), (rand((2, 6)), torch.tensor([0]))])


def test_while_inside_cond(check):
    class M(torch.nn.Module):
        def forward(self, x, n):
            def loop(x, n):
                return while_loop(lambda i, y: i < n.sum(), lambda i, y: (i + 1, y.sin() + y),
                                  (torch.zeros((), dtype=torch.int64), x))[1]

            return torch.cond(x.mean() > 0, loop, lambda x, n: x * 3, (x, n))

    x = rand((3, 3)).abs()
    check(M(), (x, torch.tensor([4])), more=[(-x, torch.tensor([4])),
                                             (x * 0.1, torch.tensor([2]))])


def test_while_dynamic_shape(check):
    class M(torch.nn.Module):
        def forward(self, x, n):
            return while_loop(lambda i, y: i < n.sum(),
                              lambda i, y: (i + 1, (y.softmax(-1) + y) * 0.5),
                              (torch.zeros((), dtype=torch.int64), x))

    check(M(), (rand((4, 6)), torch.tensor([3])),
          more=[(rand((9, 6)), torch.tensor([5])), (rand((2, 6)), torch.tensor([0]))],
          dynamic_shapes=[{0: dim("b", 2, 64)}, None])


def test_while_many_iterations_constant_memory(check, tmp_path):
    class M(torch.nn.Module):
        def forward(self, x, n):
            return while_loop(lambda i, y: i < n.sum(),
                              lambda i, y: (i + 1, (y * 0.999 + 0.001).tanh()),
                              (torch.zeros((), dtype=torch.int64), x))

    x = rand((16, 16))
    compiled, runner = check.compile(M(), (x, torch.tensor([3])))
    arena = compiled.built.program.arena_bytes  # static: the same bytes every iteration
    assert arena is not None and arena < 16 * 16 * 4 * 3  # the next value + the predicate
    runner(x, torch.tensor([10]))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    got = runner(x, torch.tensor([5000]))
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    want = M()(x, torch.tensor([5000]))
    compare(got, want, what="5000 iterations")
    assert grown_kb < 4 * 1024, f"max RSS grew by {grown_kb} KiB over 5000 iterations"


def test_bad_inputs_still_name_the_input(check):
    _, runner = check.compile(CondWeights(), (rand((3, 4)),))
    with pytest.raises(KilnError, match=r"x.*expected size 4 for dim 1, got 5"):
        runner(rand((3, 5)))
    with pytest.raises(KilnError, match=r"x"):
        runner(rand((3, 4), dtype=torch.float64))


def test_python_printer_runs_branches_and_loops(tmp_path):
    m = Counter().eval()
    x = rand((3, 4))
    compiled = kiln.compile(m, (x, torch.tensor([2])))
    src = compiled.sources["model.py"]
    assert "while True:" in src and "if not flag_while_loop:" in src
    model = kiln.backend._load_python_wrapper(src, tmp_path).Model(
        compiled.library, dict(compiled.built.weights))
    for n in (0, 1, 6):
        compare(list(model(x, torch.tensor([n]))), list(m(x, torch.tensor([n]))),
                what=f"python printer, n={n}")
    m2 = CondWeights().eval()
    c2 = kiln.compile(m2, (x,))
    (tmp_path / "c2").mkdir()
    model2 = kiln.backend._load_python_wrapper(c2.sources["model.py"], tmp_path / "c2").Model(
        c2.library, dict(c2.built.weights))
    for sign in (1, -1):
        xs = sign * x.abs()
        compare(list(model2(xs)), list(m2(xs)),
                what=f"python printer cond, sign {sign}")


def test_plan_keeps_branch_temps_apart_from_live_buffers():
    """The linear order (then, else, loop body once) gives loop-local buffers intervals inside
    the loop and buffers live across it intervals spanning it, so the proven plan never puts
    them on the same bytes."""
    class M(torch.nn.Module):
        def forward(self, x, n):
            y = x.exp() * 2  # live across the loop (a closure: an additional input)
            return while_loop(lambda i, z: i < n.sum(),
                              lambda i, z: (i + 1, (z * y).softmax(-1) + z.sin().cos()),
                              (torch.zeros((), dtype=torch.int64), x))[1]

    compiled = kiln.compile(M(), (rand((8, 16)), torch.tensor([2])))
    prog = compiled.built.program
    loop = next(x for x in prog.lines if isinstance(x, P.While))
    inside = {x.buf for x in P.walk(loop.body) if isinstance(x, P.Alloc)}
    outside = {x.buf for x in prog.lines if isinstance(x, P.Alloc)}
    assert inside and outside
    ivs = {iv.name: iv for iv in intervals(prog)}
    offs = {x.buf: (x.offset, x.offset + int(x.nbytes)) for x in P.walk(prog.lines)
            if isinstance(x, P.Alloc)}
    for a in inside:
        for b in outside:
            assert ivs[b].start <= ivs[a].start and ivs[a].end <= ivs[b].end or \
                ivs[b].end < ivs[a].start or ivs[a].end < ivs[b].start
            if not (ivs[b].end < ivs[a].start or ivs[a].end < ivs[b].start):
                assert offs[a][1] <= offs[b][0] or offs[b][1] <= offs[a][0], (a, b)


def test_verify_program_rejects_leaking_branch():
    f32 = dtypes.DTYPES["float32"]
    alloc = P.Alloc("t", f32, sympy.Integer(4))
    bad = P.Program((P.SetFlag("f", expr=sympy.true), P.If("f", (alloc,), ()), P.Return(())),
                    (), (), ())
    with pytest.raises(P.ProgramError, match="branch leaves"):
        P.verify_program(bad)
    loop = P.Program((P.While("w", (alloc, P.SetFlag("f", expr=sympy.false),
                                    P.BreakUnless("f"), P.Free("t"))), P.Return(())), (), (), ())
    with pytest.raises(P.ProgramError, match="leaving the loop"):
        P.verify_program(loop)
    ok = dataclasses.replace(loop, lines=(P.While("w", (
        alloc, P.SetFlag("f", expr=sympy.false), P.Free("t"), P.BreakUnless("f"))),
        P.Return(())))
    P.verify_program(ok)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_branches_and_loops(tmp_path):
    """On CUDA the predicate is read with a device->host copy on the stream."""
    class CondInWhile(torch.nn.Module):
        def forward(self, x, limit):
            def body_fn(i, y):
                z = torch.cond(y.sum() > 0, lambda y: y * 0.5 - 1, lambda y: y + 2, (y,))
                return i + 1, z

            return while_loop(lambda i, y: i < limit.sum(), body_fn,
                              (torch.zeros((), dtype=torch.int64), x))

    x = rand((8, 5))
    x4 = rand((8, 4))
    cases = [(CondWeights(), (x4,), [(x4.abs(),), (-x4.abs(),)]),
             (Counter(), (x[:3, :4].contiguous(), torch.tensor([3])),
              [(rand((3, 4)), torch.tensor([0])), (rand((3, 4)), torch.tensor([6]))]),
             (CondInWhile(), (x, torch.tensor([4])),
              [(x * 5, torch.tensor([7])), (x, torch.tensor([0]))])]
    for k, (m, example, runs) in enumerate(cases):
        m = m.eval()
        path = kiln.compile(m, example, device="cuda").save(tmp_path / f"m{k}.kiln")
        runner = kiln.load(path, device="cuda:0")
        for args in runs:
            got = [t.cpu() for t in torch.utils._pytree.tree_leaves(
                runner(*[a.cuda() for a in args]))]
            compare(got, list(torch.utils._pytree.tree_leaves(m(*args))),
                    what=f"cuda {type(m).__name__}")


def test_loop_ir_interpreter_runs_regions():
    """The numpy Loop IR oracle runs Branch / Loop nodes too (no C++ involved)."""
    from test_interp import _interp

    m, x = CondWeights().eval(), rand((3, 4))
    for xs in (x.abs(), -x.abs()):
        got = _interp(m, (x.abs(),), call_args=(xs,))
        for g, w in zip(got, m(xs)):
            np.testing.assert_allclose(g, w.detach().numpy(), rtol=1e-5, atol=1e-5)
    c = Counter().eval()
    for n in (0, 4):
        args = (x, torch.tensor([n]))
        got = _interp(c, (x, torch.tensor([2])), call_args=args)
        for g, w in zip(got, c(*args)):
            np.testing.assert_allclose(g, w.detach().numpy(), rtol=1e-5, atol=1e-5)


def test_cond_on_a_bool_input_returning_a_copy(check):
    """The predicate is a user input; one branch returns a copy of its operand (the region
    copies it into the result buffer)."""
    class M(torch.nn.Module):
        def forward(self, flag, x):
            return torch.cond(flag, lambda x: x.clone(), lambda x: x * 2 - 1, (x,))

    x = rand((4, 3))
    check(M(), (torch.tensor(True), x), more=[(torch.tensor(False), x),
                                              (torch.tensor(True), rand((4, 3)) + 1)])


def test_results_feed_later_ops_dynamic(check):
    """cond results feed a while_loop and ordinary ops after it; a GEMM before; dynamic batch;
    a compound loop condition; an int carried value as an output."""
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)

        def forward(self, x):
            h = self.lin(x).relu()
            y, z = torch.cond(h.mean() > 0.2, lambda h, x: (h * 2, x.sum(-1)),
                              lambda h, x: (h - x, x.amax(-1)), (h, x))
            i, w = while_loop(lambda i, w: (i < 3) & (w.sum() < 100),
                              lambda i, w: (i + 1, w * 1.5 + 1),
                              (torch.zeros((), dtype=torch.int64), y))
            return (w + 1).softmax(-1), z * 2, i

    check(M(), (rand((5, 6)),), more=[(rand((3, 6)) * 3,), (rand((7, 6)) - 2,),
                                      (rand((2, 6)) + 2,)],
          dynamic_shapes=[{0: dim("b", 2, 64)}])


class LibInBranches(torch.nn.Module):
    """Library routines (sort, cumsum, scatter_add) and an ATen fallback op (special.i1)
    inside both branches of a cond."""

    def forward(self, x, idx):
        def then(x, idx):
            s, _ = torch.sort(x, dim=-1)
            return s.cumsum(-1) + torch.special.i1(x)

        def orelse(x, idx):
            return x.scatter_add(1, idx, torch.ones_like(x)) - 1

        return torch.cond(x.sum() > 0, then, orelse, (x, idx))


class SortInLoop(torch.nn.Module):
    def forward(self, x, n):
        def body(i, x):
            return i + 1, torch.sort(x, dim=0, descending=True)[0].cumsum(0) * 0.5

        return while_loop(lambda i, x: i < n.sum(), body, (torch.zeros((), dtype=torch.int64), x))


@pytest.mark.slow  # (moved out of the default suite: it ran over 20 minutes)
def test_library_and_fallback_calls_inside_regions(check, tmp_path):
    x, idx = rand((4, 5)), torch.randint(0, 5, (4, 5))
    c = check(LibInBranches(), (x.abs() + 0.1, idx),
              more=[(-x.abs() - 0.1, idx), (x.abs() + 1, torch.randint(0, 5, (4, 5)))])
    assert c.manifest["requires"]["aten_fallback_ops"] == ["aten::special_i1.default"]
    src = c.sources["model.cpp"]
    assert "kl::sort" in src and "kl::put" in src and '#include "kiln_lib.h"' in src
    check(SortInLoop(), (x, torch.tensor([3])),
          more=[(rand((4, 5)), torch.tensor([0])), (rand((4, 5)), torch.tensor([5]))])
    # the Python printer runs the same nested calls
    m = SortInLoop()
    cm = kiln.compile(m, (x, torch.tensor([3])))
    model = kiln.backend._load_python_wrapper(cm.sources["model.py"], tmp_path).Model(
        cm.library, dict(cm.built.weights))
    compare(list(model(x, torch.tensor([2]))), list(m(x, torch.tensor([2]))),
            what="python printer, sort in a loop")


def test_data_dependent_sizes_inside_regions_are_refused():
    class M(torch.nn.Module):
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda x: x.nonzero().sum(0).float(),
                              lambda x: x.sum(0).float() * 0, (x,))

    with pytest.raises(KilnError, match="data-dependent sizes inside torch.cond"):
        kiln.compile(M(), (rand((4, 2)),))


class IntCounter(torch.nn.Module):
    """A Python int carried by while_loop, used as a value in the body and returned."""

    def forward(self, x):
        def cond_fn(i, y):
            return i < 5

        def body_fn(i, y):
            return i + 1, y * 2 + i

        return while_loop(cond_fn, body_fn, (0, x))


class IntsAndShapes(torch.nn.Module):
    """Two carried ints, one starting from a size; a bound from a dynamic dim; floor division
    and modulo; int results used after the loop and returned."""

    def forward(self, x):
        def cond_fn(i, j, y):
            return i < y.shape[0]

        def body_fn(i, j, y):
            return i + 2, j * 3 % 7, y + i // 2

        i, j, y = while_loop(cond_fn, body_fn, (1, x.shape[0] - 1, x))
        return i * 10, y, j


def _same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w)
        else:  # carried ints come back as Python ints
            assert type(g) is int and g == w, (g, w)


def test_while_carries_python_ints(tmp_path):
    d = torch.export.Dim("d", min=2, max=64)
    cases = [(IntCounter(), [(rand((3,)),)], None),
             (IntsAndShapes(), [(rand((6, 2)),), (rand((9, 2)),), (rand((2, 2)),)],
              ({0: d},))]
    for k, (m, calls, ds) in enumerate(cases):
        cm = kiln.compile(torch.export.export(m, calls[0], dynamic_shapes=ds))
        runner = kiln.load(cm.save(tmp_path / f"m{k}.kiln"))
        (tmp_path / f"py{k}").mkdir()
        model = kiln.backend._load_python_wrapper(cm.sources["model.py"],
                                                  tmp_path / f"py{k}").Model(
            cm.library, dict(cm.built.weights))
        for args in calls:
            _same(runner(*args), m(*args))
            got = list(model(*args))  # the Python printer (0-d tensors for the ints)
            compare([g for g in got if g.dim()], [w for w in m(*args)
                                                   if isinstance(w, torch.Tensor)],
                    what=f"python printer, case {k}")


def test_unsupported_int_arithmetic_in_a_loop_is_refused():
    class M(torch.nn.Module):
        def forward(self, x):
            return while_loop(lambda i, y: i < 3, lambda i, y: (i ** 2 + 1, y + 1), (0, x))

    with pytest.raises(KilnError, match=r"pow.*on an int carried by a while_loop"):
        kiln.compile(M(), (rand((3,)),))
