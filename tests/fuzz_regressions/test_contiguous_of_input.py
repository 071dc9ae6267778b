"""`x.contiguous()` of an input returned (docs/reliability.md item 8): the export cannot tell
it from `return x` (a no-op on the compact example), and eager returns x itself when x is
contiguous and a compact copy otherwise. The fuzzer's runner checks values against eager and
float64 and storage sharing both ways, on contiguous inputs and in two other layouts
(transposed, then one by seed: kiln used to return the transposed input itself, sharing its
storage where eager's copy does not), static and dynamic; the generator makes such programs
again (it skipped them while kiln could not match)."""

import pytest

from kiln.fuzz.runner import check


def _spec(dynamic: bool, seed: int) -> dict:
    b = "B" if dynamic else 5
    return {"dim": "bounded", "dynamic": dynamic, "seed": seed, "params": {},
            "inputs": [{"dtype": "float32", "high": None, "shape": [b, 4]},
                       {"dtype": "int64", "high": 9, "shape": [b, 3, 2]}],
            "ops": [["contiguous", [0], {}],
                    ["contiguous", [1], {}],
                    ["transpose", [1], {"d0": 1, "d1": 2}],
                    ["contiguous", [4], {}],
                    ["slice", [0], {"dim": 1, "start": 1, "end": None, "step": 2}]],
            "outputs": [2, 3, 5, 6, 0]}


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("seed", [16000025, 16000026, 16000027])
def test_contiguous_of_input(tmp_path, dynamic, seed):
    out = check(_spec(dynamic, seed), tmp_path)
    assert out.status == "ok", out.detail


# found by `kiln fuzz --seed 61 --max-ops 8` (programs 176 and 329) once the generator made
# `contiguous()` of inputs: exported in another layout, `x.contiguous()` is a copy in the
# graph (a clone whose provenance is aten.contiguous), but eager returns x itself for a
# contiguous x at run time; kiln returned its copy (lost sharing on compact inputs)
SEED61_176 = {'dim': 'bounded', 'dynamic': True, 'export_layout': 'transposed',
              'inputs': [{'dtype': 'bool', 'high': None, 'shape': ['B']},
                         {'dtype': 'float32', 'high': None, 'shape': ['B', 1]}],
              'ops': [['contiguous', [0], {}]], 'outputs': [2, 2], 'params': {},
              'seed': 61000359}
SEED61_329 = {'dynamic': False, 'export_layout': 'channels_last',
              'inputs': [{'dtype': 'float64', 'high': None, 'shape': [6, 7, 7]},
                         {'dtype': 'float32', 'high': None, 'shape': [4]},
                         {'dtype': 'float32', 'high': None, 'shape': [1]},
                         {'dtype': 'float32', 'high': None, 'shape': []}],
              'ops': [['contiguous', [1], {}],
                      ['complex', [1, 2], {'fn': 'add_real'}],
                      ['reduce', [0], {'dims': [0, 1, 2], 'fn': 'sum', 'keep': False}],
                      ['contiguous', [5], {}],
                      ['binary', [3, 7], {'fn': 'mul'}],
                      ['cast', [6], {'dtype': 'float32'}]],
              'outputs': [9, 4, 8], 'params': {}, 'seed': 61000512}


@pytest.mark.parametrize("spec", [SEED61_176, SEED61_329], ids=["176", "329"])
def test_contiguous_of_input_exported_in_another_layout(tmp_path, spec):
    out = check(spec, tmp_path)
    assert out.status == "ok", out.detail
    # and of a view: x[1:] of an input exported as a step-2 slice is not contiguous then
    view = {**_spec(False, 16000031), "export_layout": "step",
            "ops": [["slice", [0], {"dim": 0, "start": 1, "end": None, "step": 1}],
                    ["contiguous", [2], {}], ["contiguous", [0], {}]],
            "outputs": [3, 4, 2]}
    out = check(view, tmp_path)
    assert out.status == "ok", out.detail
