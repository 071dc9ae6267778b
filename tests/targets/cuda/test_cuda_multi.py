"""One CUDA package on several GPUs (`make test-gpu` on a machine with two or more; skipped
otherwise): the same file loaded on cuda:0 and cuda:1 (each instance owns its modules,
weights, arena and graphs on its device), both giving eager's answers with outputs on their
own device, run one after the other and from two threads at once; an instance refuses
inputs on the other GPU by name; a package compiled with `device="cuda:1"` runs on cuda:1."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils import _pytree as pytree

import kiln
from kiln.errors import InputError
from kiln.models import ALL_MODELS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs two CUDA GPUs")]


def _to(x, dev):
    return pytree.tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, x)


def _check(spec, runner, args, dev):
    want = pytree.tree_leaves(spec.module(*args))
    got = pytree.tree_leaves(runner(*_to(args, dev)))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.device == torch.device(dev)
        torch.testing.assert_close(g.cpu(), w, rtol=spec.rtol, atol=spec.atol)


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet18"])
def test_one_package_on_two_devices(tmp_path, name):
    spec = ALL_MODELS[name]()
    path = kiln.compile(spec.export(), device="cuda").save(tmp_path / f"{name}.kiln")
    r0, r1 = kiln.load(path, device="cuda:0"), kiln.load(path, device="cuda:1")
    for seed in (1, 2):
        args = spec.make_inputs(seed)
        _check(spec, r1, args, "cuda:1")
        _check(spec, r0, args, "cuda:0")
    with pytest.raises(InputError, match="expected a tensor on device cuda:1, got one on cuda:0"):
        r1(*_to(spec.make_inputs(3), "cuda:0"))
    # both instances at once, from two threads, each on its own device's current stream
    errors: list[BaseException] = []
    inputs = [spec.make_inputs(10 + i) for i in range(4)]

    def work(runner, dev):
        try:
            with torch.cuda.device(dev):
                for args in inputs:
                    _check(spec, runner, args, dev)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
    ts = [threading.Thread(target=work, args=(r, d)) for r, d in ((r0, "cuda:0"), (r1, "cuda:1"))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


def test_compiled_for_cuda_1(tmp_path):
    spec = ALL_MODELS["mlp"]()
    cm = kiln.compile(spec.export(), device="cuda:1")
    runner = kiln.load(cm.save(tmp_path / "m.kiln"), device="cuda:1")
    _check(spec, runner, spec.make_inputs(4), "cuda:1")
