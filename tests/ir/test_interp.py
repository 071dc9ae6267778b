"""The Loop IR reference interpreter agrees with torch eager on the bundled models and on
programs with views, reductions, indexing and convolution: lowering is checked independently of
code generation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.frontend.export import import_program
from kiln.ir.interp import InterpError, run_loop
from kiln.lowering import lower
from kiln.models import ALL_MODELS
from kiln.passes.dce import dce


def _interp(model, args, dynamic_shapes=None, call_args=None):
    ep = torch.export.export(model, args, dynamic_shapes=dynamic_shapes)
    imp = import_program(ep)
    graph = dce(imp.graph)
    prog = lower(graph)
    call_args = call_args or args
    feeds = {i.name: a.numpy() for i, a in zip(graph.user_inputs, call_args)}
    feeds.update({k: v.numpy() for k, v in imp.weights.items()})
    env = {}
    for inp, a in zip(graph.user_inputs, call_args):
        for d, e in zip(a.shape, inp.type.shape):
            if getattr(e, "is_Symbol", False):
                env[e.name] = int(d)
    return run_loop(prog, feeds, env)


@pytest.mark.parametrize("name", ["mlp", "gpt", "ln_softmax", "intermediates"])
def test_models_match_eager(name):
    spec = ALL_MODELS[name]()
    args = spec.example_args
    if name == "mlp":
        args = spec.make_inputs(seed=3, batch=5)
    if name == "gpt":
        args = spec.make_inputs(seed=3, batch=1, seq=9)
    got = _interp(spec.module, spec.example_args, spec.dynamic_shapes, args)
    with torch.no_grad():
        want = torch.utils._pytree.tree_leaves(spec.module(*args))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-4, atol=1e-4)


class Mixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.conv = torch.nn.Conv2d(2, 4, 3, stride=2, padding=1)

    def forward(self, ids, img):
        e = self.emb(ids).permute(1, 0)[:, ::2]
        p = torch.nn.functional.max_pool2d(torch.relu(self.conv(img)), 2)
        return e.amax(0), p.mean((2, 3)), e.argmax(1)


def test_views_indexing_conv_match_eager():
    torch.manual_seed(0)
    m = Mixed().eval()
    args = (torch.tensor([1, 4, 3, 9, 0]), torch.randn(1, 2, 9, 9))
    got = _interp(m, args)
    with torch.no_grad():
        want = m(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-5)


def test_out_of_range_index_is_reported():
    m = torch.nn.Embedding(4, 2)
    for bad in ([1, 7], [1, -1]):  # embedding does not wrap negative indices
        with pytest.raises(InterpError, match="out of range"):
            _interp(m, (torch.tensor([1, 2]),), call_args=(torch.tensor(bad),))
