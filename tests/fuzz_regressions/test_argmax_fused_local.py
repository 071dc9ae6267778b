"""Fuzzer reproducer (fixed): an argmax whose only reader is fused into the same kernel
becomes a kernel-local value, but the argmax printer stored its result to the buffer
`buf_argmax`, which is not a kernel parameter: "'buf_argmax' was not declared" from the C++
compiler (kiln/targets/cpu/kernel.py). Found by `kiln fuzz --seed 11 --start 26 --n 1
--max-ops 12` (7 ops), minimised to 3 ops by kiln/fuzz/minimise.py.
"""

from kiln.fuzz.runner import check

SPEC = {'dynamic': False,
 'inputs': [{'dtype': 'float32', 'high': None, 'shape': [1, 1, 1]}],
 'ops': [['argmax', [0], {'dim': 2, 'keep': True, 'max': True}],
         ['cast', [1], {'dtype': 'float32'}],
         ['linear', [2], {'b': None, 'w': 'p0'}]],
 'outputs': [3],
 'params': {'p0': {'init': 'w', 'shape': [1, 1]}},
 'seed': 11000059}


# the same at real sizes (argmin over 5 values, 6 rows), so the local's value is checked too
SPEC_WIDE = {**SPEC, "inputs": [{"dtype": "float32", "high": None, "shape": [2, 3, 5]}],
             "ops": [["argmax", [0], {"dim": 2, "keep": True, "max": False}]] + SPEC["ops"][1:]}


def test_fuzz_89fb41c698(tmp_path):
    out = check(SPEC, tmp_path)
    assert out.status in ("ok", "error"), out.detail


def test_argmin_fused_local_values(tmp_path):
    out = check(SPEC_WIDE, tmp_path)
    assert out.status == "ok", out.detail
