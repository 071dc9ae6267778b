"""In-place pointwise ops as torch.export leaves them (`h += residual`, ReLU(inplace=True),
eval-mode `dropout_`), `aten.pad`, `x.to(dtype)` and `torch.min(a, b)` are converted as
exported (in-place ones when the mutation cannot be seen through another name): the import
then skips torch's re-trace (run_decompositions). Where it
could be seen (the mutated tensor is an input, a view, or read after the op, or the operands'
dtypes differ), the converter declines and the program is decomposed as before."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kiln
from kiln.frontend import export as E
from kiln.frontend.aten_high import Fallback


class Block(torch.nn.Module):
    """A residual block as HF's ResNet writes it, plus the other in-place forms."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)
        self.short = torch.nn.Conv2d(4, 4, 1)
        self.act = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.bn(self.conv(x))
        h += self.short(x)  # aten.add_.Tensor on a fresh tensor
        h = self.act(h)  # relu_ on add_'s result
        h.mul_(0.5).sub_(0.25)  # chained in-place Scalar ops
        h = F.dropout(h, 0.3, training=False, inplace=True)
        t = torch.tanh_(h * 3.0)
        low = torch.min(t, (h * 0.5).to(torch.float64).to(torch.float32))  # to.dtype, min.other
        return F.pad(t, (1, 2, 0, 1), mode="constant", value=-1.5), h.sum(dim=(2, 3)), low


def _export(m, *args):
    return torch.export.export(m.eval(), args)


def test_block_imports_without_retrace_and_matches_eager(tmp_path, monkeypatch):
    torch.manual_seed(0)
    m = Block().eval()
    with torch.no_grad():
        m.bn.running_mean.uniform_(-1, 1)
        m.bn.running_var.uniform_(0.5, 2)
    ep = _export(m, torch.randn(2, 4, 6, 5))
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"aten.add_.Tensor", "aten.relu_.default", "aten.tanh_.default",
            "aten.dropout_.default", "aten.pad.default", "aten.to.dtype",
            "aten.min.other"} <= ops, ops

    def no_retrace(*a, **k):
        raise AssertionError("the import re-traced the program")
    monkeypatch.setattr(E, "_decompose", no_retrace)
    runner = kiln.compile(ep).load(tmp_path / "block.kiln")
    for shape in [(2, 4, 6, 5), (2, 4, 6, 5)]:
        x = torch.randn(*shape)
        got, want = runner(x), m(x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


class Masks(torch.nn.Module):
    """What HF's mask helpers leave as exported: `&` on bool masks, `torch.diff` of positions,
    `type_as`."""

    def forward(self, x, pos, m1, m2):
        return (torch.diff(x, dim=1), torch.diff(pos, prepend=pos[:, :1] - 1),
                torch.diff(pos, n=2, append=pos[:, -2:]), torch.diff(m1, dim=0), m1 & m2,
                (pos & 6) | 1, x.type_as(pos))


def test_masks_and_diff_import_without_retrace_and_match_eager(tmp_path, monkeypatch):
    from torch.export import Dim

    m = Masks()
    g = torch.Generator().manual_seed(1)

    def args(rows, cols):
        return (torch.randn(rows, cols, generator=g) * 4, torch.randint(-9, 9, (4, 6), generator=g),
                torch.rand(5, 3, generator=g) > 0.5, torch.rand(5, 3, generator=g) > 0.5)
    ep = torch.export.export(m, args(3, 5), dynamic_shapes=(
        {0: Dim("a"), 1: Dim("b", min=3)}, None, None, None))

    def no_retrace(*a, **k):
        raise AssertionError("the import re-traced the program")
    monkeypatch.setattr(E, "_decompose", no_retrace)
    runner = kiln.compile(ep).load(tmp_path / "masks.kiln")
    for rows, cols in [(3, 5), (6, 3), (2, 9)]:
        a = args(rows, cols)
        for got, want in zip(runner(*a), m(*a)):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=0, atol=0)


class ViewReadAfter(torch.nn.Module):  # a view made before the op is read after it
    def forward(self, x):
        a = x * 2
        v = a[:, :1]
        a.add_(1)
        return v * 1


class MutateView(torch.nn.Module):  # the mutated tensor is a view of another
    def forward(self, x):
        a = x * 2
        a[:, :1].mul_(3)
        return a


class MutateInput(torch.nn.Module):
    def forward(self, x):
        x.add_(1)
        return x * 2


class MutateBuffer(torch.nn.Module):  # BatchNorm's num_batches_tracked += 1
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.count.add_(1)
        return x + self.count


class OtherDtype(torch.nn.Module):  # eager adds in float64, then rounds to float32
    def forward(self, x, y):
        a = x * 1
        a += y
        return a


class TrainDropout(torch.nn.Module):
    def forward(self, x):
        return F.dropout(x * 1, 0.5, training=True, inplace=True)


class ReflectPad(torch.nn.Module):
    def forward(self, x):
        return F.pad(x * 1, (1, 1), mode="reflect")


CASES = {"view_read_after": (ViewReadAfter(), (torch.randn(3, 4),)),
         "view": (MutateView(), (torch.randn(3, 4),)),
         "input": (MutateInput(), (torch.randn(3, 4),)),
         "buffer": (MutateBuffer(), (torch.randn(3, 4),)),
         "dtype": (OtherDtype(), (torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64))),
         "train_dropout": (TrainDropout(), (torch.randn(3, 4),)),
         "reflect": (ReflectPad(), (torch.randn(2, 3, 4),))}


@pytest.mark.parametrize("name", sorted(CASES))
def test_visible_mutation_declines_the_direct_import(name):
    m, args = CASES[name]
    ep = torch.export.export(m, args)
    if not E._all_known(ep):  # torch functionalised it already, or an op kiln lacks
        return
    before = {k: v.clone() for k, v in ep.state_dict.items()}
    with pytest.raises(Fallback):
        E._import(ep, True)
    for k, v in before.items():  # the attempt evaluated nothing in place (constant folding)
        assert torch.equal(ep.state_dict[k], v), k


def test_visible_mutations_compile_through_the_retrace_and_match_eager(tmp_path):
    class All(torch.nn.Module):
        def forward(self, x, y):
            return (ViewReadAfter()(x), MutateView()(x), OtherDtype()(x, y),
                    ReflectPad()(x.unsqueeze(0)))
    m = All()
    x, y = torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64)
    runner = kiln.compile(torch.export.export(m, (x, y))).load(tmp_path / "all.kiln")
    for _ in range(2):
        x, y = torch.randn(3, 4), torch.randn(3, 4, dtype=torch.float64)
        for g, w in zip(runner(x, y), m(x, y)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
