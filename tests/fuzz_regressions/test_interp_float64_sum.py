"""Fuzzer reproducer: mismatch:interpreter, B=3: output 0 (torch.float32): 1 of 1 elements differ, e.g

Found by `kiln fuzz` (--seed 30 --start 8895 --n 1); minimised to 5 op(s). Failure when found:
    interpreter, B=3: output 0 (torch.float32): 1 of 1 elements differ, e.g. at [] got -0.8138571977615356 want -0.8121513724327087
"""

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
