"""User-written Triton kernels in CUDA packages on a GPU (`make test-gpu`; skipped without
CUDA): each model of user_triton_kernels.py against eager (which runs the same kernels through
Triton) on fresh inputs at several dynamic sizes, an empty batch (no launch), a user kernel
between kiln's own GEMM and layer norm, autotuning measured on the device, and the Python
printer (triton_py.py) launching the user kernel through Triton."""

from __future__ import annotations


import pytest
import torch
from torch.export import Dim

pytest.importorskip("triton")

import kiln  # noqa: E402
import user_triton_kernels as K  # noqa: E402
from kiln.options import Options  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

B = Dim("b")
# name -> (module, export args (CPU), dynamic shapes, maker of fresh inputs for batch b)
CASES = {
    "add_relu": (K.AddRelu, (torch.randn(8, 16), torch.randn(8, 16)), ({0: B}, {0: B}),
                 lambda b: (torch.randn(b, 16), torch.randn(b, 16))),
    "scale_autotuned": (K.Scale, (torch.randn(8, 16),), ({0: B},),
                        lambda b: (torch.randn(b, 16),)),
    "row_scale_2d_grid": (K.RowScale, (torch.randn(4, 40),), ({0: B},),
                          lambda b: (torch.randn(b, 40),)),
    "in_place": (K.InPlace, (torch.randn(4, 40),), ({0: B},), lambda b: (torch.randn(b, 40),)),
    "linear_kernel_layernorm": (K.Fused, (torch.randn(4, 16), torch.randn(4, 32)),
                                ({0: B}, {0: B}),
                                lambda b: (torch.randn(b, 16), torch.randn(b, 32))),
    "triton_op_out_arg_float16": (K.Affine, (torch.randn(8, 16, dtype=torch.float16),),
                                  ({0: B},),
                                  lambda b: (torch.randn(b, 16, dtype=torch.float16),)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def compiled(request, tmp_path_factory):
    make, args, dyn, fresh = CASES[request.param]
    torch.manual_seed(0)
    module = make().eval()
    cm = kiln.compile(torch.export.export(module, args, dynamic_shapes=dyn), device="cuda",
                      options=Options())
    path = cm.save(tmp_path_factory.mktemp("user") / f"{request.param}.kiln")
    return request.param, module.cuda(), cm, kiln.load(path, device="cuda:0"), fresh


def _outs(x):
    return list(x) if isinstance(x, (tuple, list)) else [x]


def test_matches_eager_at_dynamic_sizes(compiled):
    name, module, _, runner, fresh = compiled
    for seed, b in enumerate([1, 7, 64, 1000, 3]):
        torch.manual_seed(100 + seed)
        args = [a.cuda() for a in fresh(b)]
        want = _outs(module(*[a.clone() for a in args]))
        got = _outs(runner(*args))
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape, (name, b)
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_empty_batch_launches_nothing(compiled):
    name, _, _, runner, fresh = compiled
    got = _outs(runner(*[a.cuda() for a in fresh(0)]))
    assert all(g.shape[0] == 0 for g in got), name


def test_autotune_measures_every_config():
    cm = kiln.compile(torch.export.export(K.Scale(), (torch.randn(8, 16),),
                                          dynamic_shapes=({0: B},)), device="cuda")
    info = cm.manifest["cuda"]["user_kernels"]["scale_kernel"]
    assert len(info["measured_ms"]) == 2 and all(v > 0 for v in info["measured_ms"].values())
    best = min(info["measured_ms"], key=info["measured_ms"].get)
    assert str(info["config"]) == str(best)


def test_python_printer_launches_user_kernels(compiled):
    from kiln.targets.cuda.kernel import choose_config, print_triton_kernel
    from kiln.targets.cuda.wrapper_py import import_triton_module, run_program
    from kiln.ir import loop as L
    from kiln.schedule import Kernel
    from kiln.targets.cuda.user_triton import prepare

    name, module, cm, _, fresh = compiled
    b = cm.built
    mod = import_triton_module(b.sources["kernels_triton.py"])
    hints = {s.name: s.example for s in b.graph.symbols}
    bufs = L.all_buffers(b.loop)
    ks = {s.name: print_triton_kernel(s, bufs, hints, choose_config(s, hints))
          for s in b.steps if isinstance(s, Kernel)}
    ks.update({s.name: prepare(s, 0, bufs) for s in b.steps if isinstance(s, L.UserKernel)})
    args = [a.cuda() for a in fresh(5)]
    outs = run_program(b.program, ks, mod, b.weights, args, device="cuda")
    for o, w in zip(outs, _outs(module(*[a.clone() for a in args]))):
        torch.testing.assert_close(o.reshape(w.shape), w, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("make,args", [
    (K.UnbackedGrid, lambda k: (torch.randn(300), torch.randn(300), torch.tensor(k))),
    (K.UnbackedSized, lambda k: (torch.randn(4), torch.tensor(k)))],
    ids=["grid_from_item", "sized_by_item"])
def test_unbounded_data_dependent_size_in_the_grid(make, args, tmp_path):
    """Grids (and tensor sizes) from k.item() with no upper bound: evaluated at run time for
    each k, far above the example value too (the output differs for any other grid)."""
    module = make()
    cm = kiln.compile(torch.export.export(module, args(100)), device="cuda", options=Options())
    runner = kiln.load(cm.save(tmp_path / "m.kiln"), device="cuda:0")
    for seed, k in enumerate([100, 0, 1, 63, 64, 65, 299, 300, 5000]):
        torch.manual_seed(200 + seed)
        a = [t.cuda() for t in args(k)]
        want = _outs(module(*[t.clone() for t in a]))
        got = _outs(runner(*a))
        for g, w in zip(got, want):
            assert g.shape == w.shape, k
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
