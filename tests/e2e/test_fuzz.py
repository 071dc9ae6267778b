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


@pytest.mark.parametrize("chunk", range(4))
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
