"""Random ops (rand, randn, *_like, randint, bernoulli, dropout, normal, uniform) through kiln's
own Philox4x32-10 generator. Values are not torch's (kiln does not use torch's generator), so
the checks are: the generator's known-answer vectors, the compiled code producing exactly the
words of the numpy reference, determinism for one seed, fresh numbers on every run and for
every seed, distribution statistics on large samples, and dropout's keep rate and exact
scaling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import kiln
from difftest import Fn, gen, rand
from kiln.ir.interp import philox4x32

N = 1 << 18  # samples for the statistics: standard errors ~ 1/sqrt(N) = 0.002


def _load(tmp_path, fn, args, name, seed=None):
    opts = kiln.Options() if seed is None else kiln.Options(seed=seed)
    return kiln.compile(Fn(fn), args, options=opts).load(tmp_path / f"{name}.kiln")


def test_philox_known_answers():
    """Random123's known-answer vectors for Philox4x32-10."""
    assert [int(w) for w in philox4x32((0, 0), (0, 0, 0, 0))] == [
        0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert [int(w) for w in philox4x32((0xFFFFFFFF,) * 2, (0xFFFFFFFF,) * 4)] == [
        0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert [int(w) for w in philox4x32((0xA4093822, 0x299F31D0),
                                       (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344))] == [
        0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_compiled_words_match_the_reference(tmp_path):
    """float32 rand = top 24 bits of word 0 for counter (index, stream 1, run r), key seed."""
    seed = 0x1234_5678_9ABC
    runner = _load(tmp_path, lambda x: x + torch.rand(3, 5, 7), (torch.zeros(1),), "w", seed)
    index = np.arange(3 * 5 * 7, dtype=np.uint64)
    for run in range(2):
        words = philox4x32((seed & 0xFFFFFFFF, seed >> 32), (index, index >> np.uint64(32),
                                                              1, run))
        want = (words[0] >> np.uint64(8)).astype(np.float64) * 2.0 ** -24
        got = runner(torch.zeros(1))
        assert torch.equal(got.double().flatten(), torch.from_numpy(want)), f"run {run}"


def _sampler(x):
    return {"rand": torch.rand(N), "randn": torch.randn(N, dtype=torch.float64),
            "rand_like": torch.rand_like(x), "randint": torch.randint(-3, 7, (N,)),
            "bernoulli": torch.bernoulli(torch.full((N,), 0.3)),
            "bernoulli_t": torch.bernoulli(x.sigmoid()),
            "normal": torch.normal(torch.full((N,), 2.0), 3.0),
            "uniform": torch.empty(N).uniform_(-2, 5), "randn_like": torch.randn_like(x)}


def test_determinism_and_fresh_draws(tmp_path):
    x = torch.zeros(64, 64)
    a = _load(tmp_path, _sampler, (x,), "a")
    path = tmp_path / "a.kiln"
    first, second = a(x), a(x)
    replay = kiln.load(path)(x)  # a fresh instance replays the sequence from run 0
    other = _load(tmp_path, _sampler, (x,), "b", seed=7)(x)
    for k in first:
        assert torch.equal(first[k], replay[k]), k
        if k.startswith(("rand", "normal", "uniform")):
            assert not torch.equal(first[k], second[k]), f"{k}: same values on the next run"
            assert not torch.equal(first[k], other[k]), f"{k}: same values for another seed"
    # two random nodes of one program draw different streams
    assert not torch.equal(first["rand_like"].flatten()[:100], first["rand"][:100])


def test_distributions(tmp_path):
    x = rand((256, 256), torch.float32, gen("dist"))
    out = _load(tmp_path, _sampler, (x,), "dist")(x)
    tol = 6 / N ** 0.5
    u = out["rand"].double()
    assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < tol and abs(u.var() - 1 / 12) < tol
    z = out["randn"]
    assert z.dtype == torch.float64
    assert abs(z.mean()) < tol and abs(z.var() - 1) < 4 * tol
    assert abs((z.abs() < 1).double().mean() - 0.682689) < tol  # the normal's shape
    r = out["randint"]
    assert r.dtype == torch.int64 and r.min() == -3 and r.max() == 6
    counts = torch.bincount(r + 3).double() / N
    assert (counts - 0.1).abs().max() < tol
    assert abs(out["bernoulli"].mean() - 0.3) < tol
    assert set(out["bernoulli"].unique().tolist()) <= {0.0, 1.0}
    p = x.sigmoid()
    assert abs((out["bernoulli_t"] - p).mean()) < tol  # E[bernoulli(p)] = p element-wise
    nrm = out["normal"].double()
    assert abs(nrm.mean() - 2) < 3 * tol and abs(nrm.std() - 3) < 3 * tol
    un = out["uniform"].double()
    assert -2 <= un.min() and un.max() < 5 and abs(un.mean() - 1.5) < 7 * tol
    for k in ("rand_like", "randn_like"):
        assert out[k].shape == x.shape and out[k].dtype == x.dtype


@pytest.mark.parametrize("p", [0.0, 0.2, 0.5, 1.0])
def test_dropout_keep_rate_and_exact_scaling(tmp_path, p):
    x = rand((512, 512), torch.float32, gen("dropout", p)) + 10  # never 0
    runner = _load(tmp_path, lambda x: (F.dropout(x, p, training=True),
                                        torch.ops.aten.native_dropout(x, p, True)), (x,),
                   f"drop{p}")
    out, (out2, mask) = runner(x)
    kept = out != 0
    if p == 1.0:
        assert not kept.any() and not mask.any()
        return
    assert abs(kept.double().mean() - (1 - p)) < 6 / x.numel() ** 0.5
    scale = torch.tensor(1 / (1 - p), dtype=torch.float32)
    torch.testing.assert_close(out[kept], x[kept] * scale, rtol=0, atol=0)
    assert mask.dtype == torch.bool and torch.equal(mask, out2 != 0)
    torch.testing.assert_close(out2[mask], x[mask] * scale, rtol=0, atol=0)


def test_dropout_in_eval_mode_is_identity(tmp_path):
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).eval()
    x = rand((4, 8), torch.float32, gen("drop-eval"))
    runner = kiln.compile(m, (x,)).load(tmp_path / "eval.kiln")
    torch.testing.assert_close(runner(x), m(x))


def test_random_fuses_into_its_consumer(tmp_path):
    """x * rand + 1 is one kernel (the generator is a pointwise expression); the other kernel
    advances the run counter."""
    compiled = kiln.compile(Fn(lambda x: x * torch.rand_like(x) + 1), (torch.ones(16, 16),))
    assert compiled.report["fused_kernels"] == 2
    src = "\n".join(compiled.sources.values())
    assert src.count("kr::philox(") == 1


def test_update_weights_restarts_the_sequence(tmp_path):
    lin = torch.nn.Linear(6, 6)
    m = Fn(lambda x: F.dropout(lin(x), 0.5, training=True))
    m.lin = lin
    x = rand((32, 6), torch.float32, gen("upd"))
    runner = kiln.compile(m, (x,)).load(tmp_path / "u.kiln")
    first, second = runner(x), runner(x)
    assert not torch.equal(first, second)
    runner.update_weights(m.state_dict())  # the generator state is not in it: restarts
    torch.testing.assert_close(runner(x), first, rtol=0, atol=0)


def test_loop_interpreter_draws_the_same_numbers(tmp_path):
    """The numpy Loop IR interpreter's philox gives the compiled kernels' values exactly."""
    from kiln.frontend.export import import_program
    from kiln.ir.interp import run_loop
    from kiln.lowering import lower
    from kiln.passes.dce import dce
    fn = Fn(lambda x: (torch.rand(4, 9, dtype=torch.float64) + x, torch.randn_like(x),
                       torch.randint(0, 1000, (4, 9))))
    x = torch.zeros(4, 9)
    imp = import_program(torch.export.export(fn, (x,)))
    graph = dce(imp.graph)
    feeds = {graph.user_inputs[0].name: x.numpy(), **{k: v.numpy()
                                                      for k, v in imp.weights.items()}}
    want = run_loop(lower(graph), feeds, {})
    got = _load(tmp_path, fn.fn, (x,), "interp")(x)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-6, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_matches_cpu_words_and_new_ops(tmp_path):
    """On the GPU (Triton kernels): uniform draws equal the CPU package's bit for bit (same
    Philox words, exact arithmetic); normals agree to rounding; the new views and pointwise
    ops agree with eager."""
    def fn(x, i):
        return {"rand": torch.rand(5, 300) + 0 * x.sum(),
                "rand64": torch.rand(7, 11, dtype=torch.float64),
                "randint": torch.randint(-5, 1 << 20, (9, 33)),
                "randn": torch.randn_like(x), "drop": F.dropout(x, 0.25, training=True),
                "flip_roll": x.flip(0).roll(3, 1), "diag": x.diagonal(1),
                "scatter": torch.slice_scatter(x, x[:, ::3] * 2, 1, 0, None, 3),
                "math": torch.i0(x) + torch.hypot(x, x) + torch.log10(x.abs() + 1)
                + torch.copysign(x, -x) + torch.round(x, decimals=1),
                "bits": (i << 3) + (i >> 2) + torch.signbit(x).long()}
    x = rand((16, 40), torch.float32, gen("cuda-rand"))
    i = rand((16, 40), torch.int64, gen("cuda-rand-i"), low=-1000, high=1000)
    cpu = kiln.compile(Fn(fn), (x, i)).load(tmp_path / "cpu.kiln")
    gpu = kiln.compile(Fn(fn), (x, i), device="cuda").load(tmp_path / "gpu.kiln",
                                                          device="cuda:0")
    want = fn(x, i)
    for run in range(2):
        c, g = cpu(x, i), gpu(x.cuda(), i.cuda())
        g = {k: v.cpu() for k, v in g.items()}
        for k in ("rand", "rand64", "randint", "drop"):
            assert torch.equal(c[k], g[k]), f"{k} (run {run})"
        torch.testing.assert_close(g["randn"], c["randn"], rtol=1e-5, atol=1e-5)
        for k in ("flip_roll", "diag", "scatter", "math", "bits"):
            torch.testing.assert_close(g[k], want[k], rtol=1e-5, atol=1e-5, msg=k)
