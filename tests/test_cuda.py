"""CUDA packages on a GPU (`make test-gpu`; skipped without CUDA): every zoo model against
eager (fp32, CPU reference) on fresh random inputs at several sizes inside its Dim ranges,
inputs on the wrong device, a missing device index, index errors, and the caller's stream
being honoured."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import kiln
from kiln.errors import InputError, KilnError, PackageError
from kiln.models import ALL_MODELS
from kiln.options import Options

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# make_inputs keyword sizes to try per model (beyond the defaults), inside the Dim ranges
SIZES = {"mlp": [{"batch": 1}, {"batch": 7}, {"batch": 64}],
         "gpt": [{"batch": 1, "seq": 2}, {"batch": 3, "seq": 77}, {"batch": 4, "seq": 256}],
         "intermediates": [{"n": 2}, {"n": 64}]}


@pytest.fixture(scope="module", params=sorted(ALL_MODELS))
def zoo(request, tmp_path_factory):
    spec = ALL_MODELS[request.param]()
    cm = kiln.compile(spec.export(), device="cuda", options=Options())
    path = cm.save(tmp_path_factory.mktemp("gpu") / f"{spec.name}.kiln")
    return spec, kiln.load(path, device="cuda:0"), path


def _to(x, dev):
    return pytree.tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, x)


def _check(spec, runner, args):
    want = pytree.tree_leaves(spec.module(*args))
    got = pytree.tree_leaves(runner(*_to(args, "cuda:0")))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.device == torch.device("cuda", 0)
        torch.testing.assert_close(g.cpu(), w, rtol=spec.rtol, atol=spec.atol)


def test_zoo_matches_eager(zoo):
    spec, runner, _ = zoo
    for seed, sizes in enumerate([{}] + SIZES.get(spec.name, [])):
        _check(spec, runner, spec.make_inputs(seed + 1, **sizes))


def test_wrong_device_inputs(zoo):
    spec, runner, path = zoo
    args = spec.make_inputs(3)
    with pytest.raises(InputError, match="expected a tensor on device cuda:0, got one on cpu"):
        runner(*args)
    if torch.cuda.device_count() > 1:
        with pytest.raises(InputError, match="got one on cuda:1"):
            runner(*_to(args, "cuda:1"))
    else:
        with pytest.raises(PackageError, match="device cuda:1 does not exist"):
            kiln.load(path, device="cuda:1")


def test_stream_is_honoured(zoo):
    spec, runner, _ = zoo
    args = spec.make_inputs(5)
    want = pytree.tree_leaves(spec.module(*args))
    dev = _to(args, "cuda:0")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(20_000_000)  # the inputs below are written late on `side`
        late = pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, dev)
        got = pytree.tree_leaves(runner(*late))  # must run after the clones, on `side`
    side.synchronize()
    for g, w in zip(got, want):
        torch.testing.assert_close(g.cpu(), w, rtol=spec.rtol, atol=spec.atol)


def test_index_out_of_range_is_an_error(zoo):
    spec, runner, _ = zoo
    if spec.name != "gpt":
        pytest.skip("gpt embeds token ids")
    (idx,) = spec.make_inputs(1)
    idx = idx.clone()
    idx[0, 0] = 10_000
    with pytest.raises(KilnError, match="index out of range"):
        runner(idx.cuda())
    _check(spec, runner, spec.make_inputs(2))  # still usable afterwards
