"""Found by `kiln fuzz --seed 1` (programs 7 and 16, minimised to one op): kiln.compile crashes
on two common `torch.export.Dim` declarations. Not in the fuzzer's files to fix; reported.

* `Dim("B", min=2)` (no max): torch gives the range [2, int_oo]; `int_oo.is_finite` is True,
  so kiln/frontend/export.py `_symbol_ranges` calls int() on it -> AttributeError.
* `Dim("B", max=9)` (default min 0): kiln/memory/assign.py `sizes_tried` divides by the
  symbol's min -> ZeroDivisionError.
"""

import pytest
import torch

import kiln
from kiln.fuzz.runner import check


class Twice(torch.nn.Module):
    def forward(self, x):
        return (x * 2).sum(1)


@pytest.mark.parametrize("kw", [{"min": 2}, {"max": 9}, {}], ids=["no_max", "no_min", "none"])
def test_dim_declarations_compile(kw, tmp_path):
    dim = torch.export.Dim("B", **kw)
    c = kiln.compile(Twice(), (torch.randn(3, 4),), dynamic_shapes=({0: dim},))
    with c.load(tmp_path / "m.kiln") as run:
        x = torch.randn(7, 4)
        torch.testing.assert_close(run(x), (x * 2).sum(1))


SPEC = {"seed": 1000010, "dynamic": True, "dim": "no_max",
        "inputs": [{"shape": ["B", 1], "dtype": "float32", "high": None}],
        "params": {}, "ops": [["unary", [0], {"fn": "relu"}]], "outputs": [1]}


def test_fuzz_minimised_no_max(tmp_path):
    out = check(SPEC, tmp_path)
    assert out.status in ("ok", "error"), out.detail
