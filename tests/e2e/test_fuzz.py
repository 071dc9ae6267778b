"""CI batch of the differential fuzzer: a fixed seed, 20 programs, no mismatch or crash
(`kiln fuzz --n 20 --seed 7 --bounded-dims` runs the same programs; bounded Dims
because unbounded ones hit a known compile crash, tests/fuzz_regressions/
test_dim_declarations.py). Also checks the command's last line and
that the minimiser's pruning keeps programs valid."""

from __future__ import annotations

import warnings

import pytest

from kiln.cli.fuzz_cmd import program_seed
from kiln.fuzz.generator import generate
from kiln.fuzz.minimise import _valid, prune
from kiln.fuzz.runner import check

SEED, N = 7, 20


@pytest.mark.parametrize("chunk", [0, *(pytest.param(c, marks=pytest.mark.slow)
                                       for c in (1, 2, 3))])
def test_fixed_seed_batch(tmp_path, chunk):
    warnings.filterwarnings("ignore")
    statuses = []
    for k in range(chunk * N // 4, (chunk + 1) * N // 4):
        spec = generate(program_seed(SEED, k), bounded_dims=True)
        out = check(spec, tmp_path)
        assert not out.failed, f"program {k} (kiln fuzz --seed {SEED} --start {k} --n 1 " \
                               f"--bounded-dims): " \
                               f"{out.detail}"
        statuses.append(out.status)
    assert statuses.count("ok") >= len(statuses) // 2, statuses


def test_generated_programs_are_valid_and_prunable():
    for k in range(100):
        spec = generate(program_seed(SEED, k))
        assert _valid(spec), spec
        one = prune({**spec, "outputs": spec["outputs"][:1]})
        assert _valid(one), one


def test_cli_summary_line(tmp_path, capsys):
    from kiln.cli.main import main

    assert main(["fuzz", "--n", "1", "--seed", str(SEED), "--out", str(tmp_path),
                 "--bounded-dims"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "1 programs, 0 mismatches, 0 errors"


# programs of seed 5 that carry the issue-16 families (kiln/fuzz/gen_coverage.py): an unbounded
# repeat_interleave, k = repeats.sum().item() rows, a complex output, an FFT of complex values
COVERAGE = {"repeat_interleave": 255, "item_rows": 55, "complex_output": 58, "fft": 344}


@pytest.mark.parametrize("family", sorted(COVERAGE))
def test_coverage_families(tmp_path, family):
    warnings.filterwarnings("ignore")
    k = COVERAGE[family]
    spec = generate(program_seed(5, k), bounded_dims=True)
    ops = {a.get("fn", op) if op == "complex" else op for op, _, a in spec["ops"]}
    assert {"complex_output": "keep", "fft": "fft_abs"}.get(family, family) in ops, ops
    out = check(spec, tmp_path)
    assert out.status == "ok", f"kiln fuzz --seed 5 --start {k} --n 1 --bounded-dims: " \
                               f"{out.detail}"


def test_relaid_layouts_keep_values():
    import torch

    from kiln.fuzz.runner import LAYOUTS, relaid

    args = (torch.randn(2, 3, 4, 5), torch.randn(7), torch.randint(0, 9, (3, 4)), torch.tensor(2.))
    for layout in LAYOUTS:
        got = relaid(args, layout)
        for a, g in zip(args, got):
            assert torch.equal(a, g)
        assert not got[1].is_contiguous() or layout == "offset"
        assert got[1].storage_offset() == (3 if layout == "offset" else 0)
    assert relaid(args, "channels_last")[0].is_contiguous(memory_format=torch.channels_last)


def test_lost_alias_is_reported():
    import torch

    from kiln.fuzz.runner import lost_alias

    x = torch.randn(4, 3)
    base = torch.randn(4, 3)
    want = (base, base[1:], x.t())  # eager: a view of an output, a view of an input
    assert lost_alias(want, want, (x,), "w") is None
    got = (base, base[1:].clone(), x.t())
    assert "output 0 shares storage with output 1 in eager" in lost_alias(got, want, (x,), "w")
    got = (base, base[1:], x.t().clone())
    assert "output 2 shares storage with input 0 in eager" in lost_alias(got, want, (x,), "w")
    # views of a value no output returns: kiln may copy (kiln/frontend/aliasing.py)
    tmp = torch.randn(4, 3)
    want = (tmp[1:], tmp[:2])
    assert lost_alias((tmp[1:].clone(), tmp[:2].clone()), want, (x,), "w") is None


def test_device_copies_keep_the_layout():
    """`--device cuda` hands kiln copies of the inputs on the device with the same sizes,
    strides and storage offset (checked on the meta device: no GPU needed)."""
    import torch
    from kiln.fuzz.program import LAYOUTS
    from kiln.fuzz.runner import relaid, to_device

    args = (torch.randn(4, 6), torch.randn(5), torch.randn(2, 3, 4, 5))
    for layout in LAYOUTS:
        for a in relaid(args, layout):
            d = to_device(a, "meta")
            assert d.device.type == "meta" and d.shape == a.shape
            assert d.stride() == a.stride() and d.storage_offset() == a.storage_offset()
            assert to_device(a, "cpu") is a


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_export_layout_family_and_cuda_compile_only(tmp_path, capsys):
    """One program in five is exported with inputs in another layout (its own random stream:
    the rest of every program is unchanged); `--device cuda --compile-only` compiles CUDA
    packages without a GPU, and without --compile-only a machine without one is refused."""
    import torch
    from kiln.cli.main import main
    from kiln.fuzz.program import LAYOUTS

    layouts = [generate(program_seed(SEED, k)).get("export_layout") for k in range(200)]
    assert 20 <= sum(x is not None for x in layouts) <= 60
    assert {x for x in layouts if x} == set(LAYOUTS)
    k = layouts.index("step")
    spec = generate(program_seed(SEED, k), bounded_dims=True)
    assert spec["export_layout"] == "step"
    out = check(spec, tmp_path)
    assert not out.failed, out.detail
    assert main(["fuzz", "--n", "2", "--seed", str(SEED), "--out", str(tmp_path),
                 "--bounded-dims", "--device", "cuda", "--compile-only"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == "2 programs, 0 mismatches, 0 errors"
    if not torch.cuda.is_available():
        assert main(["fuzz", "--n", "1", "--device", "cuda", "--out", str(tmp_path)]) != 0
        assert "torch sees no CUDA GPU" in capsys.readouterr().err
