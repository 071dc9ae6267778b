"""CUDA packages on a GPU (`make test-gpu`; skipped without CUDA): every zoo model against
eager (fp32, CPU reference) on fresh random inputs at several sizes inside its Dim ranges,
inputs on the wrong device, a missing device index, index errors, and the caller's stream
being honoured; zoo models in bfloat16/float16 against a float64 reference (kiln's error at
most eager's in the same dtype, with slack); CUDA graphs: replays with fresh inputs and sizes
that grow the arena, state that persists across replays, and graphs seen in the profile."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch.utils import _pytree as pytree

import kiln
from kiln.errors import InputError, KilnError, PackageError
from kiln.models import ALL_MODELS
from kiln.models.zoo import in_dtype
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
    runner(idx.cuda())  # reported by the next run (no host wait per run)
    good = spec.make_inputs(2)
    with pytest.raises(KilnError, match="index out of range.*earlier run"):
        runner(*_to(good, "cuda:0"))
    _check(spec, runner, good)  # still usable afterwards, the flag cleared
    _check(spec, runner, good)


class _Embed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.e = torch.nn.Embedding(50, 16)

    def forward(self, i):
        return self.e(i) * 2


@pytest.mark.parametrize("sync", [False, True], ids=["deferred", "sync_checks"])
def test_index_status_with_graphs_and_streams(sync, tmp_path):
    """The index status across graph replays: a bad run inside a run of good ones is reported
    by the run after it (or, with cuda_sync_checks, by itself), exactly once; runs on another
    stream see it too."""
    m = _Embed()
    ids = torch.randint(0, 50, (2, 5))
    cm = kiln.compile(torch.export.export(m, (ids,)), device="cuda",
                      options=Options(cuda_sync_checks=sync))
    r = cm.load(tmp_path / "e.kiln", device="cuda:0")
    for _ in range(3):  # the second run captures the graph, the third replays it
        torch.testing.assert_close(r(ids.cuda()).cpu(), m(ids), rtol=0, atol=0)
    bad = ids.clone()
    bad[1, 4] = 50
    if sync:
        with pytest.raises(KilnError, match="index out of range"):
            r(bad.cuda())
    else:
        r(bad.cuda())
        side = torch.cuda.Stream()
        with torch.cuda.stream(side), pytest.raises(KilnError, match="earlier run"):
            r(ids.cuda())
        side.synchronize()
    for _ in range(2):  # reported once, then clean
        torch.testing.assert_close(r(ids.cuda()).cpu(), m(ids), rtol=0, atol=0)
    torch.cuda.synchronize()


HALF = [("mlp", torch.bfloat16), ("mlp", torch.float16), ("gpt", torch.bfloat16),
        ("gpt", torch.float16), ("ln_softmax", torch.bfloat16), ("resnet18", torch.bfloat16)]


def _f64(x):
    return pytree.tree_map(lambda t: t.double() if isinstance(t, torch.Tensor) and
                           t.is_floating_point() else t, x)


@pytest.mark.parametrize("name,dtype", HALF, ids=[f"{n}-{d}" for n, d in HALF])
def test_half_zoo_matches_float64(name, dtype, tmp_path):
    spec = in_dtype(ALL_MODELS[name](), dtype)
    cm = kiln.compile(spec.export(), device="cuda")
    runner = kiln.load(cm.save(tmp_path / "m.kiln"), device="cuda:0")
    eager = copy.deepcopy(spec.module).cuda()
    ref = copy.deepcopy(spec.module).double().cuda()
    with torch.no_grad():
        for seed in (1, 2, 3):  # the third run replays a CUDA graph
            args = _to(spec.make_inputs(seed), "cuda:0")
            got = pytree.tree_leaves(runner(*args))
            want = pytree.tree_leaves(ref(*_f64(args)))
            ours = pytree.tree_leaves(eager(*args))
            for g, w, o in zip(got, want, ours):
                assert g.dtype == o.dtype == dtype
                err = (g.double() - w).abs().max().item()
                eager_err = (o.double() - w).abs().max().item()
                scale = w.abs().max().item()
                print(f"{name} {dtype}: kiln err {err:.3g}, eager err {eager_err:.3g}, "
                      f"scale {scale:.3g}", file=sys.stderr)
                assert err <= 2 * eager_err + 1e-3 * scale, (err, eager_err, scale)


@pytest.fixture(scope="module")
def gpt_graphs(tmp_path_factory):
    spec = ALL_MODELS["gpt"]()
    d = tmp_path_factory.mktemp("graphs")
    on = kiln.load(kiln.compile(spec.export(), device="cuda").save(d / "on.kiln"),
                   device="cuda:0")
    off = kiln.load(kiln.compile(spec.export(), device="cuda",
                                 options=Options(cuda_graphs=False)).save(d / "off.kiln"),
                    device="cuda:0")
    return spec, on, off


def test_cuda_graph_replays_fresh_inputs_and_sizes(gpt_graphs):
    spec, on, off = gpt_graphs
    # the same sizes again (direct, capture, replays), a larger size (the arena grows: the
    # first graph is stale), then back, then a third size
    sizes = [(2, 16)] * 3 + [(4, 256)] * 3 + [(2, 16)] * 3 + [(1, 3)] * 3
    for seed, (b, t) in enumerate(sizes):
        args = spec.make_inputs(100 + seed, batch=b, seq=t)  # fresh tensors and values
        _check(spec, on, args)
        got_on = on(*_to(args, "cuda:0"))
        got_off = off(*_to(args, "cuda:0"))
        torch.testing.assert_close(got_on, got_off, rtol=0, atol=0)


def test_cuda_graph_state_persists(tmp_path):
    from test_mutation import Stateful
    torch.manual_seed(0)
    m = Stateful().eval()
    x, slot = torch.randn(3, 4), torch.tensor([2.0])
    runner = kiln.load(kiln.compile(torch.export.export(copy.deepcopy(m), (x, slot)),
                                    device="cuda").save(tmp_path / "s.kiln"), device="cuda:0")
    for i in range(6):  # direct, capture, replays: every run must advance the state once
        xi = torch.randn(3, 4)
        want = m(xi, slot)
        got = runner(xi.cuda(), slot.cuda())
        for g, w in zip(got, want):
            torch.testing.assert_close(g.cpu(), w, rtol=1e-5, atol=1e-5)


def _driver_launches(fn) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names: dict[str, int] = {}
    for ev in prof.events():
        if "Launch" in ev.name:
            names[ev.name] = names.get(ev.name, 0) + 1
    return names


def test_cuda_graph_is_replayed(gpt_graphs):
    spec, on, off = gpt_graphs
    args = _to(spec.make_inputs(1, batch=2, seq=32), "cuda:0")
    for _ in range(3):
        on(*args)
    seen_on = _driver_launches(lambda: on(*args))
    seen_off = _driver_launches(lambda: off(*args))
    print("graphs on:", seen_on, "off:", seen_off, file=sys.stderr)
    def count(seen, part):
        return sum(n for name, n in seen.items() if part in name)
    # without graphs every kernel and GEMM is a launch; with graphs none is (the profiler
    # does not list cuGraphLaunch itself; correctness of replays is checked above)
    assert count(seen_off, "LaunchKernel") >= 10
    assert count(seen_on, "LaunchKernel") == 0


def test_autotune_measures_once_and_caches(tmp_path):
    spec = ALL_MODELS["ln_softmax"]()
    opts = Options(cache_dir=str(tmp_path / "cache"))
    first = kiln.compile(spec.export(), device="cuda", options=opts)
    tuned = first.manifest["cuda"]["autotuned"]
    print("autotuned:", tuned, file=sys.stderr)
    assert tuned and all(len(t) >= 2 for t in tuned.values())  # candidates were timed
    chosen = {k: (v["xblock"], v["rblock"], v["num_warps"])
              for k, v in first.manifest["cuda"]["kernels"].items()}
    again = kiln.compile(spec.export(), device="cuda", options=opts)
    assert again.manifest["cuda"]["autotuned"] == {}  # every kernel from the disk cache
    assert {k: (v["xblock"], v["rblock"], v["num_warps"])
            for k, v in again.manifest["cuda"]["kernels"].items()} == chosen
    runner = kiln.load(again.save(tmp_path / "t.kiln"), device="cuda:0")
    _check(spec, runner, spec.make_inputs(4))


@pytest.mark.parametrize("graphs", [True, False])
def test_dynamic_int_inputs_on_cuda(tmp_path, graphs):
    """Int inputs marked dynamic: host values binding sizes of a CUDA program (with and without
    CUDA graphs, whose key then includes the value)."""
    from test_io import IntInput, _int_input_export

    cm = kiln.compile(_int_input_export(), device="cuda",
                      options=Options(cuda_graphs=graphs))
    runner = cm.load(tmp_path / "i.kiln", device="cuda")
    for rows, n, scale in ((6, 3, 2), (8, 8, 4), (12, 5, 3), (6, 3, 2)):
        x = torch.randn(rows, 4)
        got, want = runner(x.cuda(), n, scale), IntInput()(x, n, scale)
        for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
            torch.testing.assert_close(g.cpu() if isinstance(g, torch.Tensor) else g, w)
    with pytest.raises(InputError, match=r"input sizes: aten.reshape"):
        runner(torch.randn(4, 4, device="cuda"), 2, 0)


def test_aten_fallback_on_cuda(tmp_path):
    """frexp / special.i1 through ATen on the device (topk, scatter_add Triton kernels), on
    the caller's stream (a non-default stream here), against eager on fresh inputs."""
    from test_cuda_codegen import _LibraryOps

    m = _LibraryOps()
    x, idx = torch.randn(4, 5), torch.randint(0, 5, (4, 5))
    runner = kiln.compile(m, (x, idx), device="cuda").load(tmp_path / "f.kiln", device="cuda")
    s = torch.cuda.Stream()
    for _ in range(3):
        x, idx = torch.randn(4, 5), torch.randint(0, 5, (4, 5))
        with torch.cuda.stream(s):
            got = runner(x.cuda(), idx.cuda())
        s.synchronize()
        for g, w in zip(got, m(x, idx)):
            torch.testing.assert_close(g.cpu(), w)
