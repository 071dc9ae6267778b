"""Fuzzer reproducer (fixed): `kiln fuzz --seed 16 --start 6565 --n 1` (issue 16's device run):
atan2(layer_norm(ceil(x)), x) came out -pi where eager gives +pi. A row of equal values
normalises to exactly 0: eager's CPU kernel computes (x * rstd - mean * rstd) * w + b with a
bias of 0 when there is none, so that zero is +0 whatever the weight's sign; kiln computed
(x - mean) * rstd * w, -0 for a negative weight, and atan2 tells the two apart. The norm
without a bias now adds +0 too (kiln/lowering/reductions.py; batch norm likewise, whose eager
x * alpha + beta gives +0 as well)."""

import torch

import kiln
from kiln.fuzz.runner import check

SPEC = {'dynamic': False,
        'inputs': [{'dtype': 'float32', 'high': None, 'shape': [5, 12, 2]},
                   {'dtype': 'float32', 'high': None, 'shape': [5, 1, 2]}],
        'ops': [['unary', [0], {'fn': 'floor'}],
                ['unary', [0], {'fn': 'ceil'}],
                ['layer_norm', [3], {'b': None, 'rank': 1, 'w': 'p0'}],
                ['binary', [4, 0], {'fn': 'atan2'}],
                ['cat', [5, 1], {'dim': 1}]],
        'outputs': [6],
        'params': {'p0': {'init': 'ln', 'shape': [2]}},
        'seed': 16006613}


def test_fuzz_6565(tmp_path):
    out = check(SPEC, tmp_path)
    assert out.status == "ok", out.detail


class Norms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([-1.5, 0.7, -0.2]))
        self.bn = torch.nn.BatchNorm1d(3, affine=True).eval()
        self.bn.bias = None
        with torch.no_grad():
            self.bn.weight.copy_(torch.tensor([-2.0, 1.0, -0.5]))
            self.bn.running_mean.copy_(torch.tensor([0.0, 1.0, -0.0]))

    def forward(self, x):
        return (torch.nn.functional.layer_norm(x, (3,), self.w),
                torch.nn.functional.layer_norm(x, (3,)), self.bn(x))


def test_exact_zeros_have_eager_sign(tmp_path):
    # rows of equal values (+0, -0, mixed, non-zero): layer norm gives exact zeros; batch
    # norm gives them where x equals the running mean
    x = torch.tensor([[-0.0, -0.0, -0.0], [0.0, -0.0, 0.0], [2.0, 2.0, 2.0],
                      [0.0, 1.0, -0.0], [-0.0, 1.0, 0.0]])
    c = kiln.compile(Norms(), (x,))
    with c.load(tmp_path / "m.kiln") as run:
        got = run(x)
    with torch.no_grad():
        want = Norms()(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
        assert torch.equal(torch.signbit(g), torch.signbit(w)), (g, w)
