"""Fuzzer reproducer (fixed): `kiln fuzz --seed 16 --start 2661 --n 1` (issue 16's device run)
failed at run time with "bmm_2: operand layout not supported by BLAS": a Linear applied to an
expanded value ([2, 2, 1, 4] -> [2, 2, 3, 4]: row stride 0) passed the operand to BLAS as a
view, since lowering accepted any view with a unit stride, while the run time's
`kr::blas_layout` also needs a leading dimension covering the other dim. Lowering
(kiln/lowering/extern.py `_blas_ok`) now applies the run time's rule at compile time and
copies an operand that fails it (where a size is symbolic, unless the rule holds for every
size)."""

import pytest
import torch

import kiln
from kiln.fuzz.runner import check

SPEC = {'dynamic': False,
        'inputs': [{'dtype': 'float32', 'high': None, 'shape': [6, 2]},
                   {'dtype': 'float32', 'high': None, 'shape': [5, 64]},
                   {'dtype': 'float32', 'high': None, 'shape': [2, 2, 1, 4]},
                   {'dtype': 'float32', 'high': None, 'shape': [2, 2, 3, 4]},
                   {'dtype': 'float32', 'high': None, 'shape': [2, 2, 3, 4]}],
        'ops': [['layer_norm', [0], {'b': 'p1', 'rank': 1, 'w': 'p0'}],
                ['attention', [2, 3, 4], {'causal': False, 'empty_row': True, 'mask': 'none'}],
                ['expand', [6], {'shape': [2, 2, 3, 4]}],
                ['linear', [7], {'b': 'p2', 'w': 'p3'}],
                ['cast', [8], {'dtype': 'float64'}],
                ['reduce', [7], {'dims': [2, 3], 'fn': 'sum', 'keep': True}],
                ['linear', [2], {'b': 'p4', 'w': 'p5'}]],
        'outputs': [11, 5, 9],
        'params': {'p0': {'init': 'ln', 'shape': [2]},
                   'p1': {'init': 'w', 'shape': [2]},
                   'p2': {'init': 'w', 'shape': [3]},
                   'p3': {'init': 'w', 'shape': [3, 4]},
                   'p4': {'init': 'w', 'shape': [4]},
                   'p5': {'init': 'w', 'shape': [4, 4]}},
        'seed': 16002709}


def test_fuzz_2661(tmp_path):
    out = check(SPEC, tmp_path)
    assert out.status == "ok", out.detail


class Broadcast(torch.nn.Module):
    """matmuls whose operand repeats a row (stride 0 along rows) or a column (stride 0
    along columns), static and dynamic."""

    def forward(self, a, b, w):
        rows = a.expand(-1, 3, -1) @ w  # [n, 1, k] -> [n, 3, k]: row stride 0
        cols = b @ a.expand(-1, 3, -1).transpose(1, 2)  # [n, k, 3]: column stride 0
        return rows, cols


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_broadcast_operands(dynamic, tmp_path):
    a, b, w = torch.randn(4, 1, 5), torch.randn(4, 2, 5), torch.randn(5, 6)
    dyn = ({0: torch.export.Dim("n", min=2, max=16)}, {0: torch.export.Dim("n", min=2,
                                                                            max=16)}, None)
    ep = torch.export.export(Broadcast(), (a, b, w), dynamic_shapes=dyn if dynamic else None)
    with kiln.compile(ep).load(tmp_path / "m.kiln") as run:
        for n in ((4, 7) if dynamic else (4,)):
            a, b = torch.randn(n, 1, 5), torch.randn(n, 2, 5)
            for g, want in zip(run(a, b, w), Broadcast()(a, b, w)):
                torch.testing.assert_close(g, want)
