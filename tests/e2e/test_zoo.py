"""The bundled model zoo: every model builds reproducibly, runs eagerly and exports."""

from __future__ import annotations

import pytest
import torch

from kiln.models import ALL_MODELS, ModelSpec, get

NAMES = sorted(ALL_MODELS)


@pytest.mark.parametrize("name", NAMES)
def test_exports_and_matches_eager(name: str) -> None:
    spec = get(name)
    assert isinstance(spec, ModelSpec) and spec.name == name
    assert not spec.module.training
    ep = spec.export()
    with torch.no_grad():
        want = spec.module(*spec.example_args)
        got = ep.module()(*spec.example_args)
    torch.testing.assert_close(got, want, rtol=spec.rtol, atol=spec.atol)


@pytest.mark.parametrize("name", NAMES)
def test_reproducible(name: str) -> None:
    a, b = get(name), get(name)
    for (ka, va), (kb, vb) in zip(a.module.state_dict().items(), b.module.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    for x, y in zip(a.make_inputs(7), b.make_inputs(7)):
        assert torch.equal(x, y)


@pytest.mark.parametrize(("name", "sizes"), [
    ("mlp", {"batch": 1}), ("gpt", {"batch": 4, "seq": 5}), ("intermediates", {"n": 64}),
    ("demo", {"batch": 1024}),
])
def test_dynamic_sizes_run_through_export(name: str, sizes: dict[str, int]) -> None:
    spec = get(name)
    ep = spec.export()
    args = spec.make_inputs(1, **sizes)
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(*args), spec.module(*args),
                                   rtol=spec.rtol, atol=spec.atol)


def test_unknown_name() -> None:
    with pytest.raises(KeyError, match="known"):
        get("nope")
