"""Fuzzer reproducer (`kiln fuzz --seed 30 --start 8895 --n 1`, minimised to 5 ops): cos of
the float32 sum of 1152 values near 3213. kiln summed them in one running float (the three
nested reduce loops into one accumulator): -0.81386 where float64 math gives -0.81218 and
eager -0.81215 (the interpreter reported it). Now each innermost run sums into a float
partial and the partials into a double: -0.81215."""

from kiln.fuzz.runner import check

SPEC = {'dynamic': False,
 'inputs': [{'dtype': 'float32', 'high': None, 'shape': [8, 3, 4, 12]},
            {'dtype': 'float32', 'high': None, 'shape': [4, 12]}],
 'ops': [['unary', [0], {'fn': 'floor'}],
         ['complex', [2, 2], {'fn': 'mul_abs'}],
         ['binary', [3, 1], {'fn': 'add'}],
         ['reduce', [4], {'dims': [0, 1, 2, 3], 'fn': 'sum', 'keep': False}],
         ['unary', [5], {'fn': 'cos'}]],
 'outputs': [6],
 'params': {},
 'seed': 30008985}


def test_interp_float64_sum_of_cos_input(tmp_path):
    out = check(SPEC, tmp_path)
    assert out.status in ("ok", "error"), out.detail
