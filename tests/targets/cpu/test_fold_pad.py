"""Zero pads folded into the convolutions they feed (kiln/passes/fold_pad.py, the CPU target's
`fold_pads` stage): TensorFlow-style "same" padding as written by Hugging Face's MobileNetV2
(an explicit F.pad before a convolution of padding 0). Checked against eager on fresh inputs at
several batch sizes (a dynamic batch), and on the Graph IR: which pads are folded, which stay."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import kiln
from kiln.passes.fold_pad import fold_pads


class TfPadded(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.c1 = torch.nn.Conv2d(3, 8, 3, 2)
        self.c2 = torch.nn.Conv2d(8, 8, 3, 1, groups=8)
        self.c3 = torch.nn.Conv2d(8, 16, 1)
        self.c4 = torch.nn.Conv2d(16, 16, 3, 1, padding=1)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=g) * 0.5

    def forward(self, x):
        x = self.c1(F.pad(x, (0, 1, 0, 1)))       # asymmetric ("same" at stride 2): stays
        y = F.pad(x, (1, 1, 1, 1))
        x = torch.relu(self.c2(y))                 # symmetric: the conv's padding
        x = self.c3(F.pad(x, (0, 0, 0, 0)))        # identity: dropped
        z = self.c4(F.pad(x, (2, 2, 1, 1)))        # added to the conv's own padding 1
        w = self.c4(F.pad(z, (1, 1, 1, 1), value=1.0))  # not zero: stays
        # y is also read by a mean (its pad stays for it); a -0.0 pad stays too
        return x + y.mean(), z, w, F.pad(z, (1, 1, 1, 1), value=-0.0)


def test_tf_style_pads_fold_and_match_eager(tmp_path):
    m = TfPadded().eval()
    x = torch.randn(2, 3, 31, 30)
    batch = torch.export.Dim("batch", min=1, max=8)
    ep = torch.export.export(m, (x,), dynamic_shapes=({0: batch},))
    cm = kiln.compile(ep)
    runner = cm.load(tmp_path / "pads.kiln")
    g = torch.Generator().manual_seed(1)
    for n in (1, 2, 5):
        x = torch.randn(n, 3, 31, 30, generator=g)
        with torch.no_grad():
            want = m(x)
        got = runner(x)
        for k, (a, b) in enumerate(zip(got, want)):
            assert a.shape == b.shape, (n, k)
            scale = float(b.abs().max())  # float32 sums of this magnitude: relative to it
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale,
                                       msg=f"batch {n} output {k}")
            if k == 3:  # the -0.0 border is eager's, sign included
                assert torch.equal(torch.signbit(a[..., 0, :]), torch.signbit(b[..., 0, :]))


def test_which_pads_fold_on_the_graph():
    from kiln.frontend.export import import_program

    m = TfPadded().eval()
    ep = torch.export.export(m, (torch.randn(2, 3, 31, 30),))
    g = import_program(ep).graph
    before = [n for n in g.nodes if n.op == "pad"]
    folded = fold_pads(g)
    convs = [n for n in folded.nodes if n.op == "conv"]
    producers = {n.name: n for n in folded.nodes}
    pad_inputs = [producers[c.inputs[0]].op if c.inputs[0] in producers else "input"
                  for c in convs]
    # c1 keeps its asymmetric pad and c4's second call its pad of 1.0; c2, c3 and c4's first
    # call read their inputs directly
    assert pad_inputs.count("pad") == 2, pad_inputs
    paddings = sorted(tuple(c.attr("padding")) for c in convs)
    assert paddings == [(0, 0), (0, 0), (1, 1), (1, 1), (2, 3)], paddings
    assert len(before) == 6
