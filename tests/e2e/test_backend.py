"""torch.compile(model, backend="kiln") runs compiled kernels through the Python printer and
matches eager; graphs kiln cannot compile still run."""

from __future__ import annotations

import torch

import kiln.backend


def test_torch_compile_backend_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32)).eval()
    x = torch.randn(8, 16)
    made = []

    def backend(gm, inputs):
        made.append(kiln.backend.kiln_backend(gm, inputs))
        return made[-1]

    fn = torch.compile(m, backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(fn(x), m(x), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(fn(x + 1), m(x + 1), rtol=1e-4, atol=1e-4)
    assert made and all(hasattr(f, "kiln_compiled") for f in made)
    assert torch.compile(m, backend="kiln")(x).shape == (8, 32)  # the registered name works


def test_backend_falls_back_on_unsupported_graph():
    torch._dynamo.reset()

    def f(x):  # a Scalar argument: neither lowered nor passable to the ATen fallback
        return torch.special.zeta(x, 2.0) * 2

    x = torch.rand(5) + 1
    made = []

    def backend(gm, inputs):
        made.append(kiln.backend.kiln_backend(gm, inputs))
        return made[-1]

    fn = torch.compile(f, backend=backend)
    torch.testing.assert_close(fn(x), f(x))
    assert made and not hasattr(made[0], "kiln_compiled")
