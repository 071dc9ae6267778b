"""Fuzzer reproducer (fixed): with a `Dim` without an upper bound, the run-time memory plan
was evaluated for the report at the range maximum (2^63 - 1), where an `x @ x.T` buffer of
B x B elements has more bytes than an int64 holds: OverflowError from
kiln/memory/greedy.py `place` during `kiln.compile`. kiln/memory/assign.py `plan_sizes` now
skips sizes whose storages cannot fit in a 64-bit address space. Found by `kiln fuzz --seed 11
--start 62 --n 1 --max-ops 12` (12 ops), minimised to 2 ops by kiln/fuzz/minimise.py.
"""

from kiln.fuzz.runner import check

SPEC = {'dim': 'no_max',
        'dynamic': True,
        'inputs': [{'dtype': 'float32', 'high': None, 'shape': ['B', 1]}],
        'ops': [['self_mm', [0], {}], ['reduce', [1], {'dims': [1], 'fn': 'sum', 'keep': False}]],
        'outputs': [2],
        'params': {},
        'seed': 11000095}


def test_fuzz_8806507039(tmp_path):
    out = check(SPEC, tmp_path)
    assert out.status == "ok", out.detail
