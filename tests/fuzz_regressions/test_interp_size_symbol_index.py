"""Found by `kiln fuzz` (seed 0, programs 55 and 91): the Loop IR interpreter crashes on an
index expression that is exactly a size symbol (e.g. the divisor of a mean over a dynamic dim):
`_Eval.index` xreplaces the symbol by a Python int and then asks it for `free_symbols`
(kiln/ir/interp.py, `_Eval.index`). Not in the fuzzer's files to fix: reported to the lead; the
fuzzer passes sizes as sympy Integers meanwhile."""

import torch

from kiln.frontend.export import import_program
from kiln.ir.interp import run_loop
from kiln.lowering import lower
from kiln.passes.dce import dce


class Mean0(torch.nn.Module):
    def forward(self, x):
        return x.mean(0)


def test_interp_mean_over_dynamic_dim():
    dim = torch.export.Dim("B", min=2, max=9)
    ep = torch.export.export(Mean0(), (torch.randn(3, 4),), dynamic_shapes=({0: dim},))
    graph = dce(import_program(ep).graph)
    x = torch.randn(5, 4)
    (got,) = run_loop(lower(graph), {graph.user_inputs[0].name: x.numpy()}, {"s0": 5})
    torch.testing.assert_close(torch.from_numpy(got), x.mean(0))
