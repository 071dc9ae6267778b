"""torch.compile(model, backend="kiln") runs compiled kernels through the Python printer and
matches eager: at the first shape, after Dynamo's recompile with symbolic sizes (still kiln,
not eager: the backend's counters say so), and in training (AOTAutograd's forward and backward
graphs both compiled by kiln, gradients equal to eager's). Graphs kiln cannot compile still run,
with a warning naming the reason and a count."""

from __future__ import annotations

import warnings

import pytest
import torch

import kiln.backend


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    kiln.backend.reset_stats()
    yield
    torch._dynamo.reset()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32))


def test_torch_compile_backend_matches_eager():
    m = _model().eval()
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


def test_dynamic_second_shape_is_compiled_by_kiln():
    m = _model().eval()
    fn = torch.compile(m, backend="kiln")
    with warnings.catch_warnings():
        warnings.simplefilter("error", kiln.backend.KilnFallbackWarning)
        with torch.no_grad():
            for b in (8, 5, 13, 3):  # 8: static graph; 5: Dynamo's symbolic recompile
                x = torch.randn(b, 16, dtype=torch.float32)
                torch.testing.assert_close(fn(x), m(x), rtol=1e-4, atol=1e-4)
    s = kiln.backend.stats()
    assert s["compiled"] == 2 and s["dynamic"] == 1 and s["eager"] == 0, s


def test_dynamic_graph_with_size_arithmetic():
    def f(x, y):  # the symbolic size reaches the graph as an input the view uses
        return (x.reshape(x.shape[0] * 2, -1) + 1).sum(1) * y[: x.shape[0] * 2]

    fn = torch.compile(f, backend="kiln")
    for n in (4, 6, 9):
        x, y = torch.randn(n, 8), torch.randn(40)
        torch.testing.assert_close(fn(x, y), f(x, y), rtol=1e-5, atol=1e-5)
    s = kiln.backend.stats()
    assert s["dynamic"] >= 1 and s["eager"] == 0, s


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_training_step_gradients_equal_eager(dtype):
    m = _model().to(dtype)
    ref = _model().to(dtype)
    fn = torch.compile(m, backend="kiln")
    for b in (8, 5):  # a static then a dynamic training graph
        x = torch.randn(b, 16, dtype=dtype)
        target = torch.randn(b, 32, dtype=dtype)
        y = fn(x)
        assert y.requires_grad
        ((y - target) ** 2).mean().backward()
        ((ref(x) - target) ** 2).mean().backward()
        for (name, p), q in zip(m.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
        m.zero_grad()
        ref.zero_grad()
    s = kiln.backend.stats()
    assert s["forward"] == 2 and s["backward"] == 2 and s["eager"] == 0, s


def test_input_gradient_flows_through_kiln():
    def f(x):
        return torch.tanh(x) * x.sum()

    x = torch.randn(6, 5, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    torch.compile(f, backend="kiln")(x).pow(2).sum().backward()
    f(x_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    assert kiln.backend.stats()["backward"] == 1


@torch.library.custom_op("kiln_test_backend::opaque", mutates_args=())
def _opaque(x: torch.Tensor) -> torch.Tensor:
    """A custom op: neither lowered by kiln nor an ATen op its fallback could call."""
    return x * 3 - 1


@_opaque.register_fake
def _(x):
    return torch.empty_like(x)


def test_backend_falls_back_on_unsupported_graph_with_a_warning():
    def f(x):
        return _opaque(x) * 2

    x = torch.rand(5) + 1
    made = []

    def backend(gm, inputs):
        made.append(kiln.backend.kiln_backend(gm, inputs))
        return made[-1]

    fn = torch.compile(f, backend=backend)
    with pytest.warns(kiln.backend.KilnFallbackWarning,
                      match=r"graph \(2 ops: opaque, mul\) runs eagerly \(not compiled by "
                            r"kiln\): UnsupportedError: .*kiln_test_backend.opaque"):
        torch.testing.assert_close(fn(x), f(x))
    assert made and not hasattr(made[0], "kiln_compiled")
    s = kiln.backend.stats()
    assert s["eager"] == 1 and s["compiled"] == 0 and s["eager_reasons"] == {
        "UnsupportedError": 1}, s


@pytest.mark.slow  # heavy (cold cache: 15-100 s on 2 cores); make test-slow
def test_attention_training_gradients_equal_eager():
    """AOTAutograd saves attention's logsumexp for the backward: whatever kiln compiles or
    refuses of that forward, the gradients are eager's (a forward whose outputs differ from the
    graph's at the example inputs runs eagerly, with the reason)."""
    torch.manual_seed(0)
    proj = torch.nn.Linear(16, 48)
    ref = torch.nn.Linear(16, 48)
    ref.load_state_dict(proj.state_dict())

    def f(lin, x):
        q, k, v = lin(x).view(2, 5, 3, 4, 4).permute(2, 0, 3, 1, 4)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).sum()

    x = torch.randn(2, 5, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kiln.backend.KilnFallbackWarning)
        torch.compile(f, backend="kiln")(proj, x).backward()
    f(ref, x).backward()
    torch.testing.assert_close(proj.weight.grad, ref.weight.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(proj.bias.grad, ref.bias.grad, rtol=1e-4, atol=1e-5)
    s = kiln.backend.stats()
    assert s["forward"] + s["backward"] + s["eager"] >= 2, s
