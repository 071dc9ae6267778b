"""Tests of kiln.memory: validity, bounds, optimality of the exact search, the verifier, the C++
twin of the greedy planner, speed, baselines and reports."""
from __future__ import annotations

import itertools
import json
import math
import random
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.errors import KilnError, PlanError
from kiln.memory import (Interval, Plan, exact_size_reuse_bytes, greedy_by_size_offsets,
                         lower_bound, naive_bytes, plan_memory, plan_summary,
                         verify_plan)
from kiln.memory.exact import exact_place
from kiln.memory.greedy import breadth_order, place, size_order
from kiln.memory.intervals import items

ROOT = Path(__file__).resolve().parents[2]


@st.composite
def instances(draw, max_n: int = 40, max_step: int = 30) -> list[Interval]:
    n = draw(st.integers(0, max_n))
    out = []
    for i in range(n):
        start = draw(st.integers(0, max_step))
        length = draw(st.integers(0, max_step // 2))
        size = draw(st.one_of(st.sampled_from([0, 1, 63, 64, 65, 4096]),
                              st.integers(0, 1 << 20)))
        out.append(Interval(f"t{i}", size, start, start + length))
    return out


def realistic_instance(rng: random.Random, steps: int) -> list[Interval]:
    """Chain-like lifetimes of a network: most buffers die within a few steps, some live long
    (skip connections, saved activations); sizes drawn from a handful of tensor shapes."""
    shapes = [rng.choice([1, 2, 4, 8]) * rng.choice([64, 128, 256, 512]) * rng.choice([1, 7, 14,
              28, 56]) ** 2 * 4 for _ in range(6)] + [rng.randrange(1, 1 << 16) for _ in range(2)]
    out = []
    for step in range(steps):
        for k in range(1 if rng.random() < 0.8 else 2):
            roll = rng.random()
            if roll < 0.08:
                end = rng.randrange(step, steps)  # long-lived
            elif roll < 0.6:
                end = step + 1
            else:
                end = step + rng.randrange(0, 4)
            out.append(Interval(f"s{step}_{k}", rng.choice(shapes), step, min(end, steps - 1)))
    return out


def first_fit_arena(its, order) -> int:
    """Arena of placing `order` one by one at the lowest feasible offset (the reference)."""
    placed: list[tuple[int, int, int, int]] = []
    arena = 0
    for it in order:
        spans = sorted((o, o + s) for o, s, a, b in placed if a <= it.end and it.start <= b)
        top = 0
        for lo, hi in spans:
            if lo - top >= it.size:
                break
            top = max(top, hi)
        placed.append((top, it.size, it.start, it.end))
        arena = max(arena, top + it.size)
    return arena


@settings(max_examples=150, deadline=None)
@given(instances(), st.sampled_from([1, 8, 64, 256]))
def test_plans_are_valid_and_bounded(intervals, alignment):
    plan = plan_memory(intervals, alignment=alignment)
    verify_plan(intervals, plan, alignment=alignment)
    assert plan.lower_bound_bytes == lower_bound(intervals, alignment)
    assert plan.lower_bound_bytes <= plan.arena_bytes <= naive_bytes(intervals, alignment)
    assert plan.arena_bytes % alignment == 0
    assert all(off % alignment == 0 for off in plan.offsets.values())
    assert plan.arena_bytes == min(plan.candidates.values())
    assert plan.candidates[plan.algorithm] == plan.arena_bytes
    assert set(plan.offsets) == {iv.name for iv in intervals}
    assert all(plan.offsets[iv.name] == 0 for iv in intervals if iv.size == 0)
    assert plan_memory(intervals, alignment=alignment).offsets == plan.offsets  # deterministic


@settings(max_examples=120, deadline=None)
@given(instances(max_n=6, max_step=8))
def test_exact_equals_brute_force_over_permutations(intervals):
    its = [it for it in items(intervals, 64) if it.size > 0]
    brute = min((first_fit_arena(its, p) for p in itertools.permutations(its)), default=0)
    result = exact_place(its)
    assert result.proven and result.arena == brute
    plan = plan_memory(intervals)
    verify_plan(intervals, plan)
    assert plan.arena_bytes == brute
    assert "exact" in plan.candidates


def test_exact_beats_greedy_somewhere():
    rng = random.Random(7)
    wins = 0
    for _ in range(60):
        ivs = [Interval(f"b{i}", rng.randrange(1, 20) * 64, s, s + rng.randrange(0, 6))
               for i, s in enumerate(rng.randrange(0, 8) for _ in range(10))]
        plan = plan_memory(ivs, budget_s=5.0)
        verify_plan(ivs, plan)
        wins += plan.algorithm == "exact"
    assert wins > 0


def _overlapping_plan() -> tuple[list[Interval], Plan]:
    ivs = [Interval("a", 100, 0, 3), Interval("b", 64, 2, 5), Interval("c", 64, 4, 6)]
    plan = Plan({"a": 0, "b": 64, "c": 0}, 256, 192, "hand", 0.0, {})
    return ivs, plan


def test_verify_catches_overlap():
    ivs, plan = _overlapping_plan()
    with pytest.raises(PlanError) as err:
        verify_plan(ivs, plan)
    msg = str(err.value)
    for needle in ("'a'", "'b'", "steps 0..3", "steps 2..5", "[0, 100)", "[64, 128)"):
        assert needle in msg
    assert isinstance(err.value, KilnError)


@pytest.mark.parametrize("offsets,arena,needle", [
    ({"a": 0, "b": 128, "c": 32}, 256, "multiple of the alignment"),
    ({"a": 0, "b": 128}, 256, "no offset"),
    ({"a": 0, "b": 128, "c": 0, "zz": 0}, 256, "not among"),
    ({"a": 0, "b": 128, "c": 0}, 128, "past the arena"),
    ({"a": 0, "b": 128, "c": 0}, 250, "multiple of 64"),
])
def test_verify_catches_malformed_plans(offsets, arena, needle):
    ivs, _ = _overlapping_plan()
    with pytest.raises(PlanError, match=needle):
        verify_plan(ivs, Plan(offsets, arena, 0, "hand", 0.0, {}))
    verify_plan(ivs, Plan({"a": 0, "b": 128, "c": 0}, 192, 0, "hand", 0.0, {}))


def test_zero_size_and_invalid_inputs():
    ivs = [Interval("z", 0, 0, 9), Interval("x", 10, 0, 9), Interval("y", 10, 0, 9)]
    plan = plan_memory(ivs)
    verify_plan(ivs, plan)
    assert plan.offsets["z"] == 0 and plan.arena_bytes == 128
    assert plan_memory([]).arena_bytes == 0
    with pytest.raises(PlanError, match="more than once"):
        plan_memory([Interval("x", 1, 0, 0), Interval("x", 1, 1, 1)])
    with pytest.raises(PlanError, match="before start"):
        plan_memory([Interval("x", 1, 3, 2)])
    with pytest.raises(PlanError, match="must be an integer"):
        plan_memory([Interval("x", 1.5, 0, 1)])  # type: ignore[arg-type]
    s0 = sympy.Symbol("s0", integer=True, positive=True)
    with pytest.raises(PlanError, match="symbolic"):
        plan_memory([Interval("x", 4 * s0, 0, 1)])  # type: ignore[arg-type]
    concrete = [Interval("x", (4 * s0).subs(s0, 3), 0, 1)]  # a sympy Integer is fine
    assert plan_memory(concrete).arena_bytes == 64


def test_baselines_on_a_known_instance():
    # a(0..1) 100B, b(1..2) 64B, c(2..3) 100B, d(3..4) 64B, e(4..4) 200B
    ivs = [Interval("a", 100, 0, 1), Interval("b", 64, 1, 2), Interval("c", 100, 2, 3),
           Interval("d", 64, 3, 4), Interval("e", 200, 4, 4)]
    assert naive_bytes(ivs) == 128 + 64 + 128 + 64 + 256
    assert lower_bound(ivs) == 256 + 64
    assert exact_size_reuse_bytes(ivs) == 128 + 64 + 256  # c reuses a's slot, d reuses b's
    assert naive_bytes(ivs, alignment=1) == 528
    plan = plan_memory(ivs)
    verify_plan(ivs, plan)
    assert plan.arena_bytes == 320


@pytest.fixture(scope="module")
def cpp_planner(tmp_path_factory) -> Path:
    compiler = shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    tmp = tmp_path_factory.mktemp("kiln_plan")
    (tmp / "driver.cc").write_text(r"""
#include <cstdio>
#include <vector>
#include "kiln_plan.h"
int main() {
  long long t;
  if (std::scanf("%lld", &t) != 1) return 1;
  while (t--) {
    long long n, a;
    std::scanf("%lld %lld", &n, &a);
    std::vector<int64_t> sz(n), off(n);
    std::vector<int32_t> s(n), e(n);
    for (long long i = 0; i < n; ++i) {
      long long x; int y, z;
      std::scanf("%lld %d %d", &x, &y, &z);
      sz[i] = x; s[i] = y; e[i] = z;
    }
    long long arena = kiln_rt::plan_greedy(n, sz.data(), s.data(), e.data(), a, off.data());
    std::printf("%lld", arena);
    for (long long i = 0; i < n; ++i) std::printf(" %lld", (long long)off[i]);
    std::printf("\n");
  }
  return 0;
}
""")
    exe = tmp / "driver"
    subprocess.run([compiler, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror",
                    "-I", str(ROOT / "kiln/runtime/src"), str(tmp / "driver.cc"), "-o", str(exe)],
                   check=True)
    return exe


def test_cpp_planner_matches_python(cpp_planner):
    rng = random.Random(1234)
    cases = []
    for k in range(300):
        n = rng.randrange(0, 60) if k < 250 else rng.randrange(100, 400)
        alignment = rng.choice([1, 16, 64, 256])
        if k % 3 == 0:
            ivs = realistic_instance(rng, max(n, 1))
        else:
            ivs = []
            for i in range(n):
                s = rng.randrange(0, 40)
                size = rng.choice([0, 1, 64, 64, 128, rng.randrange(0, 5000)])
                ivs.append(Interval("", size, s, s + rng.randrange(0, 10)))
        ivs = [Interval(f"b{i:06d}", iv.size, iv.start, iv.end) for i, iv in enumerate(ivs)]
        cases.append((ivs, alignment))
    text = [str(len(cases))]
    for ivs, alignment in cases:
        text.append(f"{len(ivs)} {alignment}")
        text.extend(f"{iv.size} {iv.start} {iv.end}" for iv in ivs)
    out = subprocess.run([str(cpp_planner)], input="\n".join(text) + "\n", capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert len(out) == len(cases)
    for (ivs, alignment), line in zip(cases, out):
        arena, *offsets = map(int, line.split())
        py_offsets, py_arena = greedy_by_size_offsets(ivs, alignment)
        assert arena == py_arena
        assert offsets == [py_offsets[iv.name] for iv in ivs]


def test_two_thousand_intervals_plan_fast():
    rng = random.Random(99)
    ivs = realistic_instance(rng, 1700)[:2000]
    assert len(ivs) >= 1900
    t0 = time.perf_counter()
    plan = plan_memory(ivs)
    seconds = time.perf_counter() - t0
    print(f"\n{len(ivs)} intervals planned in {seconds:.3f} s "
          f"({plan.algorithm}, arena/lower bound {plan.arena_bytes / plan.lower_bound_bytes:.4f})")
    verify_plan(ivs, plan)
    assert seconds < 5.0


def test_realistic_ratios_and_baselines():
    rng = random.Random(2024)
    logs = {"greedy_by_size": 0.0, "greedy_by_breadth": 0.0, "best": 0.0}
    count = 20
    for _ in range(count):
        ivs = realistic_instance(rng, rng.randrange(20, 300))
        its = [it for it in items(ivs, 64) if it.size > 0]
        lb = lower_bound(ivs)
        plan = plan_memory(ivs)
        verify_plan(ivs, plan)
        assert plan.arena_bytes <= exact_size_reuse_bytes(ivs) <= naive_bytes(ivs)
        logs["greedy_by_size"] += math.log(place(size_order(its))[1] / lb)
        logs["greedy_by_breadth"] += math.log(place(breadth_order(its))[1] / lb)
        logs["best"] += math.log(plan.arena_bytes / lb)
    means = {k: math.exp(v / count) for k, v in logs.items()}
    print("\ngeomean arena/lower bound:", {k: round(v, 4) for k, v in means.items()})
    assert means["best"] < 1.25


def test_report_summary():
    rng = random.Random(5)
    ivs = realistic_instance(rng, 60)
    plan = plan_memory(ivs)
    summary = plan_summary(ivs, plan)
    json.loads(json.dumps(summary))
    assert summary["arena_bytes"] == plan.arena_bytes
    assert summary["ratio"] >= 1.0
    assert summary["naive_bytes"] >= summary["exact_size_reuse_bytes"] >= summary["arena_bytes"]
    assert summary["top_buffers"][0]["size"] == max(iv.size for iv in ivs)


# ------------------------------------------------------------------ in-place legality (units)

def _inplace_case(src_index=None, *, src_kind="temp", src_dtype=None, n=8, m=16,
                  earlier=None, later=None, indirect=False):
    """A kernel over outer (n,) whose member `o` [n, m] reads `x` at `src_index`; optional
    earlier / later members reading `x` at the given index (a row sum / a copy)."""
    from kiln.ir import loop as L
    from kiln.ir.sym import ivars, rvars
    from kiln.schedule import Kernel

    i0, i1 = ivars(2)
    (r0,) = rvars(1)
    f32 = _f32()
    src_dtype = src_dtype or f32
    idx = i0 * m + i1 if src_index is None else src_index(i0, i1)
    ind = ()
    if indirect:
        ind = (L.Indirect(sympy.Symbol("j0", integer=True), L.Const(0, _i64()), sympy.Integer(n)),)
    load = L.Load("x", idx, src_dtype, ind)
    members = []
    if earlier is not None:
        members.append(L.Compute("s", f32, (n, 1), L.Load("x", earlier(i0, r0), f32),
                                 L.Reduce("sum", (m,))))
    members.append(L.Compute("o", f32, (n, m), L.Op("add", (load, L.Const(1.0, f32)), f32)))
    if later is not None:
        members.append(L.Compute("c", f32, (n, m), L.Load("x", later(i0, i1), f32)))
    buffers = {"x": L.Buffer("x", src_dtype, (n, m), src_kind),
               "o": L.Buffer("o", f32, (n, m), "temp"),
               "s": L.Buffer("s", f32, (n, 1), "temp"),
               "c": L.Buffer("c", f32, (n, m), "temp")}
    return Kernel("k", (sympy.Integer(n),), tuple(members), frozenset()), buffers


def _f32():
    from kiln.ir.dtypes import dtype
    return dtype("float32")


def _i64():
    from kiln.ir.dtypes import dtype
    return dtype("int64")


@pytest.mark.parametrize("case, legal", [
    (dict(), True),  # same element: read then write
    (dict(src_index=lambda i0, i1: i0 * 16 + 15 - i1), False),  # reversed row
    (dict(src_index=lambda i0, i1: i1 * 8 + i0), False),  # transposed
    (dict(src_index=lambda i0, i1: i0 * 16 + i1 + 1), False),  # next element
    (dict(src_kind="input"), False),
    (dict(src_kind="weight"), False),
    (dict(indirect=True), False),
    (dict(earlier=lambda i0, r0: i0 * 16 + r0), True),  # a row reduction first (layer norm)
    (dict(earlier=lambda i0, r0: r0), False),  # reads row 0 whatever the outer index
    (dict(earlier=lambda i0, r0: i0 * 16 + r0 + 16), False),  # the next row
    (dict(later=lambda i0, i1: i0 * 16 + i1), False),  # a later member still reads it
])
def test_inplace_legality_rule(case, legal):
    from kiln.memory.inplace import kernel_candidates

    kernel, buffers = _inplace_case(**case)
    assert (("o", "x") in kernel_candidates(kernel, buffers)) is legal


def test_inplace_needs_same_dtype_and_size():
    from kiln.memory.inplace import kernel_candidates

    kernel, buffers = _inplace_case(src_dtype=_i64())
    assert ("o", "x") not in kernel_candidates(kernel, buffers)
    from kiln.ir import loop as L
    kernel, buffers = _inplace_case()
    buffers["x"] = L.Buffer("x", _f32(), (8, 17), "temp")
    assert ("o", "x") not in kernel_candidates(kernel, buffers)


def test_program_verifier_checks_inplace_allocs():
    from kiln.ir import program as P

    f32 = _f32()
    kargs = (("out", "b"), ("in", "a"))
    good = [P.Alloc("a", f32, sympy.Integer(16)),
            P.CallKernel("k0", (("out", "a"),), False, ("a",), ()),
            P.Alloc("b", f32, sympy.Integer(16), reuse="a"),
            P.CallKernel("k1", kargs, False, ("b",), ()),
            P.Free("a"),
            P.CallKernel("k2", (("in", "b"),), False, (), ()),
            P.Free("b"), P.Return(())]
    prog = P.Program(tuple(good), (), (), ())
    P.verify_program(prog)
    bad_late = good[:5] + [P.CallKernel("k2", (("in", "a"),), False, (), ())] + good[5:]
    bad_late[4], bad_late[5] = bad_late[5], bad_late[4]  # a read after b took its bytes
    bad_size = list(good)
    bad_size[2] = P.Alloc("b", f32, sympy.Integer(32), reuse="a")
    bad_src = list(good)
    bad_src[2] = P.Alloc("b", f32, sympy.Integer(16), reuse="zz")
    for lines, needle in ((bad_late, "not freed right after"), (bad_size, "different"),
                          (bad_src, "not a live arena temp")):
        with pytest.raises(Exception, match=needle):
            P.verify_program(P.Program(tuple(lines), (), (), ()))
    from kiln.memory.assign import assign_offsets, intervals
    planned, plan, ivs = assign_offsets(prog)
    assert [iv.name for iv in ivs] == ["a"] and ivs[0].end == 2  # one storage for the chain
    offsets = {x.buf: x.offset for x in planned.lines if isinstance(x, P.Alloc)}
    assert offsets["a"] == offsets["b"]
    P.verify_program(planned, planned=True)
    assert len(intervals(prog, inplace=False)) == 2


def _zoo_program(name):
    sys_path = str(ROOT / "bench")
    import sys
    if sys_path not in sys.path:
        sys.path.insert(0, sys_path)
    from memory import program_of  # bench/memory.py

    from kiln.models import get
    return program_of(get(name).export())[1]


@pytest.mark.parametrize("name", ["mlp", "gpt", "intermediates"])
def test_cpp_planner_matches_python_on_model_intervals(cpp_planner, name):
    from kiln.memory.assign import intervals, runtime_plan, sizes_tried

    prog = _zoo_program(name)
    envs = sizes_tried(prog, between=6)
    cases = [intervals(prog, env) for env in envs]
    text = [str(len(cases))]
    for ivs in cases:
        text.append(f"{len(ivs)} {prog.alignment}")
        text.extend(f"{iv.size} {iv.start} {iv.end}" for iv in ivs)
    out = subprocess.run([str(cpp_planner)], input="\n".join(text) + "\n", capture_output=True,
                         text=True, check=True).stdout.splitlines()
    for env, ivs, line in zip(envs, cases, out):
        arena, *offsets = map(int, line.split())
        py_offsets, py_arena = greedy_by_size_offsets(ivs, prog.alignment)
        assert (arena, offsets) == (py_arena, [py_offsets[iv.name] for iv in ivs])
        assert runtime_plan(prog, env)["arena_bytes"] == arena  # and it is proven valid
